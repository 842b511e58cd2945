"""How `adaptive` ranks a turn's candidates (`Rank`: its own objectives met first, then the
lower cost, a separation from the colocated reference winning only by `SEPARATION_MARGIN`),
and what its search finds (`Search`)."""

from __future__ import annotations

import math

from policies.adaptive import tuning
from policies.adaptive.candidates import Candidate
from policies.adaptive.scoring import Floor, Scorer
from policies.types import Action, Turn, WorkerView

TIE_ORDER: dict[Action, int] = {"colocate": 0, "handoff": 1, "migrate": 2, "recompute": 3}


class Search:
    """What `AdaptivePolicy.search` found for one turn: the `best` candidate, the colocated
    `reference`, the best ranked of the others (`rival`), the `scorer` that priced them (it
    prices any other placement of the turn on the same state) and the view's workers by id
    (the policy's `FleetIndex.index`, edited as later views change: read it before the next
    turn is searched)."""

    __slots__ = ("best", "index", "reference", "rival", "scorer")

    def __init__(
        self,
        best: Candidate,
        reference: Candidate,
        rival: Candidate | None,
        scorer: Scorer,
        index: dict[str, WorkerView],
    ) -> None:
        self.best = best
        self.reference = reference
        self.rival = rival
        self.scorer = scorer
        self.index = index


Key = tuple[bool, float, int, tuple[str, ...]]


class Rank:
    """Meets the turn's own objectives first (its TTFT, and its ITL: fewer slow gaps expected
    where it decodes than its budget, `Candidate.exposure` < 1) at a harm within one miss of
    the colocated `reference`'s, or without one (a new session) of `least_harm` (meeting them
    saves one turn: costing the streams beside its prefill more saves nothing), then the
    lower cost; a candidate other than `reference` must win by `SEPARATION_MARGIN` (what the
    model leaves out: a turn moved off its resident worker moves load and cache with it, its
    gain is an estimate)."""

    __slots__ = ("_harmful", "_objective", "_reference")

    def __init__(self, turn: Turn, reference: Candidate | None, least_harm: float) -> None:
        self._objective = turn.objectives.ttft_ms
        self._harmful = (least_harm if reference is None else reference.harm) + 1.0
        self._reference = reference

    def __call__(self, candidate: Candidate) -> Key:
        reference = self._reference
        margin = 0.0 if reference is None or candidate is reference else tuning.SEPARATION_MARGIN
        return (
            candidate.ttft_ms > self._objective
            or candidate.exposure >= 1.0
            or candidate.harm >= self._harmful,
            candidate.cost + margin,
            TIE_ORDER[candidate.action],
            candidate.workers,
        )

    def floor(self, floor: Floor, action: Action, workers: tuple[str, ...]) -> Key:
        """A key no later than the key of the split candidate (never the reference) whose
        `Scorer.handoff_floor` is `floor`."""
        ttft, harm, exposure, cost = floor
        margin = 0.0 if self._reference is None else tuning.SEPARATION_MARGIN
        return (
            ttft > self._objective or exposure >= 1.0 or harm >= self._harmful,
            cost + margin,
            TIE_ORDER[action],
            workers,
        )


def rank_key(turn: Turn, reference: Candidate | None = None, least_harm: float = math.inf) -> Rank:
    """The key candidates rank by (`Rank`)."""
    return Rank(turn, reference, least_harm)
