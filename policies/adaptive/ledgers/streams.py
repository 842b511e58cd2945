"""`StreamLedger`: the requests the adaptive policy placed on each worker and has not seen
finish, and when each is predicted to be done there (a decode stream at its last token, a
split turn's prefill leg when its KV leaves); the rate it places answers on each worker; and
the prefills it holds for each worker (`Colocate.hold_s`), when they will run there. Once a
worker's requests are done, a prefill held until then stalls no stream there but those placed
there meanwhile; an answer placed there meets its slow steps if it decodes while it runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.adaptive import tuning
from policies.adaptive.ledgers.legs import StallLedger

Leg = tuple[str, float]  # worker, when predicted done there (s)
Held = tuple[float, float, int]  # a held prefill's release and end (s), its slow steps


class StreamLedger:
    """Per worker, the predicted end of each request this policy placed there, and the
    answers placed there as a count decaying with time constant `window_s`."""

    def __init__(self, window_s: float) -> None:
        self._placed: dict[str, tuple[Leg, ...]] = {}
        # worker -> request -> (predicted done, whether it is an answer)
        self._ends: dict[str, dict[str, tuple[float, bool]]] = {}
        # The answers placed on each worker, one count each (a re-decided turn's replaced).
        self._answers = StallLedger(window_s)
        # worker -> request -> (release, prefill done, slow steps) of each prefill held there
        self._held: dict[str, dict[str, Held]] = {}
        self._holding: dict[str, str] = {}  # request -> the worker its prefill is held for
        # worker -> request -> when its KV leaves, of each split turn's prefill leg there
        self._prefilling: dict[str, dict[str, float]] = {}

    def place(
        self, request_id: str, legs: Sequence[Leg], at_s: float, held: Held | None = None
    ) -> None:
        """`request_id`, placed at `at_s`, is on each (worker, until) of `legs` (none:
        rejected; the last one is its answer, a split turn's first its prefill leg), its
        prefill `held` (release, done, slow steps) on the first; deciding a turn again
        replaces what it placed before."""
        self.finish(request_id)
        if held is not None and legs and held[2] > 0:
            worker = legs[0][0]
            if worker in self._held or len(self._held) < tuning.MAX_TRACKED_WORKERS:
                self._held.setdefault(worker, {})[request_id] = held
                self._holding[request_id] = worker
        self._answers.place(request_id, legs[-1][0] if legs else None, at_s, 1)
        last = len(legs) - 1
        kept = []
        for i, (worker, end_s) in enumerate(legs):
            if worker in self._ends or len(self._ends) < tuning.MAX_TRACKED_WORKERS:
                self._ends.setdefault(worker, {})[request_id] = (end_s, i == last)
                kept.append((worker, end_s))
                if i != last:
                    self._prefilling.setdefault(worker, {})[request_id] = end_s
        if kept:
            self._placed[request_id] = tuple(kept)
        limit = tuning.MAX_TRACKED_REQUESTS
        if len(self._placed) > limit:
            for request in list(self._placed)[: limit // 4]:
                self.finish(request)

    def finish(self, request_id: str) -> None:
        held = self._holding.pop(request_id, None)
        if held is not None:
            holds = self._held[held]
            del holds[request_id]
            if not holds:
                del self._held[held]
        for worker, _ in self._placed.pop(request_id, ()):
            ends = self._ends.get(worker)
            if ends is not None:
                ends.pop(request_id, None)
                if not ends:
                    del self._ends[worker]
            legs = self._prefilling.get(worker)
            if legs is not None and legs.pop(request_id, None) is not None and not legs:
                del self._prefilling[worker]

    def prefill_legs(self, worker: str, now_s: float, exclude: str = "") -> int:
        """How many split turns' prefill legs placed on `worker` are predicted to run there
        still (their KV not sent yet), `exclude`'s own left out: the engine counts each
        running from its prefill on, yet none decodes there."""
        legs = self._prefilling.get(worker)
        if not legs:
            return 0
        return sum(1 for request, sent_s in legs.items() if sent_s > now_s and request != exclude)

    def held_steps(self, worker: str, start_s: float, end_s: float, exclude: str = "") -> float:
        """The slow steps an answer decoding on `worker` from `start_s` to `end_s` meets of
        the prefills held for it (of each, the share of its run the answer overlaps),
        `exclude`'s own left out."""
        holds = self._held.get(worker)
        if not holds:
            return 0.0
        met = 0.0
        gone = []
        for request, (release_s, done_s, steps) in holds.items():
            if done_s < start_s - tuning.STALE_AFTER_S:
                gone.append(request)
            elif request != exclude and release_s < end_s and done_s > start_s:
                if done_s <= release_s:
                    met += steps
                else:
                    first = release_s if release_s > start_s else start_s
                    last = done_s if done_s < end_s else end_s
                    met += steps * (last - first) / (done_s - release_s)
        for request in gone:
            self.finish(request)
        return met

    def answer_rate(self, worker: str, now_s: float, exclude: str = "") -> float:
        """Answers per second placed on `worker` lately, `exclude`'s own left out."""
        return self._answers.rate(worker, now_s, exclude)

    def done_at(self, worker: str, now_s: float, exclude: str = "") -> tuple[int, float]:
        """(how many requests, when the last answer is done) of those placed on `worker` and
        not seen finish, `exclude`'s own left out; an answer predicted done already is late:
        it ends any moment (now). A prefill leg there counts, but is no stream for a prefill
        to wait for (with none but prefill legs, a prefill there waits for nothing: now)."""
        ends = self._ends.get(worker)
        if not ends:
            return 0, now_s
        count, last = 0, now_s
        stale = now_s - tuning.STALE_AFTER_S
        gone = []
        for request, (end_s, answer) in ends.items():
            if end_s < stale:
                gone.append(request)
            elif request != exclude:
                count += 1
                if answer and end_s > last:
                    last = end_s
        for request in gone:
            self.finish(request)
        return count, last
