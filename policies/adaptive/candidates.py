"""One candidate placement of a turn and its cost in expected objective misses, and the
per-worker terms candidates are built from (the formulas are in `policies.adaptive.scoring`,
which builds candidates; `policies.adaptive.terms` computes the terms)."""

from __future__ import annotations

import math
from typing import NamedTuple

from policies.adaptive import tuning
from policies.adaptive.ledgers.cache import Fill
from policies.costmodel.estimates import PrefillLeg
from policies.types import Action


class PrefillTerms(NamedTuple):
    """The turn's prefill on one worker: the terms of every candidate prefilling there."""

    compute_ms: float
    own_wait_ms: float
    harm_ms: float
    slow_steps: int
    harm: float
    leg: PrefillLeg
    work_ms: float


class DecodeTerms(NamedTuple):
    """The turn's decode leg sent to one worker: the terms of every handoff there."""

    lacking: int  # the prompt tokens it lacks, to transfer
    queue_ms: float
    slot_ms: float
    first_step_ms: float
    exposure: float
    pace: float


def costs(
    harm: float,
    exposure: float,
    eviction: float,
    ttft_ms: float,
    compute_ms: float,
    pace: float,
    objective_ms: float,
) -> tuple[float, float, float]:
    """(TTFT risk, misses, cost) of a placement with these terms (`policies.adaptive.scoring`
    has the formulas). Each is non-decreasing in every argument but the objective, and
    computed in one order, so terms no larger give results no larger, to the last bit (what
    `Scorer.handoff_floor` bounds a candidate with)."""
    share = ttft_ms / objective_ms if objective_ms > 0.0 else math.inf
    # min() and max() spelled out: a turn computes this per placement it weighs.
    risk_from = tuning.RISK_FROM
    risk = (share - risk_from) / (1.0 - risk_from)
    risk = (risk if risk < 1.0 else 1.0) if risk > 0.0 else 0.0
    misses = harm + exposure + eviction + risk
    work = compute_ms / objective_ms if objective_ms > 0.0 else math.inf
    pacing = share + tuning.WORK_WEIGHT * work + pace
    return risk, misses, misses + tuning.TTFT_WEIGHT * (1e9 if pacing > 1e9 else pacing)


class Candidate:
    """One feasible placement: its predicted terms (ms) and expected objective misses."""

    __slots__ = (
        "action",
        "compute_ms",
        "cost",
        "decode_ms",
        "eviction",
        "exposure",
        "fills",
        "harm",
        "harm_ms",
        "hold_ms",
        "interference_ms",
        "leg",
        "leg_tokens",
        "misses",
        "prefill_ms",
        "queue_ms",
        "risk",
        "sent_ms",
        "slow_steps",
        "transfer_ms",
        "ttft_ms",
        "work_ms",
        "workers",
    )

    def __init__(
        self,
        action: Action,
        workers: tuple[str, ...],
        objective_ms: float,
        *,
        queue_ms: float,
        compute_ms: float,
        own_wait_ms: float,
        harm_ms: float,
        harm: float,
        exposure: float,
        slow_steps: int,
        leg: PrefillLeg,
        work_ms: float,
        pace: float = 0.0,
        transfer_ms: float = 0.0,
        sent_ms: float = 0.0,
        leg_tokens: int = 0,
        prefill_ms: float | None = None,
        hold_ms: float = 0.0,
        decode_ms: float = 0.0,
        fills: tuple[Fill, ...] = (),
        eviction: float = 0.0,
    ) -> None:
        # The KV it puts on its workers, and the live contexts that evicts there.
        self.fills = fills
        self.work_ms = work_ms
        # The router holds the turn this long first (its queue, `queue_ms`, counts it).
        self.hold_ms = hold_ms
        # Its answer's decode after the first token.
        self.decode_ms = decode_ms
        # Its prefill alone: what a request queued behind it there waits for it.
        self.prefill_ms = compute_ms if prefill_ms is None else prefill_ms
        # A split turn's decode leg: sent when its prefill ends, with the KV it adds there.
        self.sent_ms = sent_ms
        self.leg_tokens = leg_tokens
        self.action: Action = action
        self.leg = leg
        self.workers = workers
        self.slow_steps = slow_steps
        self.queue_ms = queue_ms
        self.compute_ms = compute_ms
        self.transfer_ms = transfer_ms
        self.harm_ms = harm_ms
        self.interference_ms = harm_ms + own_wait_ms
        self.ttft_ms = ttft = queue_ms + compute_ms + own_wait_ms + transfer_ms
        self.harm = harm
        self.exposure = exposure
        self.eviction = eviction
        self.risk, self.misses, self.cost = costs(
            harm, exposure, eviction, ttft, compute_ms, pace, objective_ms
        )

    @property
    def interference(self) -> float:
        """I of this placement, in expected misses: what its stalls and evictions cost."""
        return self.harm + self.exposure + self.eviction

    def describe(self) -> str:
        held = f" held {self.hold_ms:.0f}ms" if self.hold_ms > 0.0 else ""
        if len(self.workers) == 1:
            return f"{self.action} on {self.workers[0]}{held}"
        return f"{self.action} {self.workers[0]}->{self.workers[1]}{held}"
