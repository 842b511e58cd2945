"""`StreamLedger`: the requests the adaptive policy placed on each worker and has not seen
finish, and when each is predicted to be done there (a decode stream at its last token, a
split turn's prefill leg when its KV leaves). Once a worker's requests are done, a prefill
held until then (`Colocate.hold_s`) stalls no stream there.
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.adaptive_ledgers import MAX_TRACKED_REQUESTS, MAX_TRACKED_WORKERS

# A request predicted done this long ago whose outcome never came (lost, or a replica's
# restart) no longer counts.
STALE_AFTER_S = 60.0

Leg = tuple[str, float]  # worker, when predicted done there (s)


class StreamLedger:
    """Per worker, the predicted end of each request this policy placed there."""

    def __init__(self) -> None:
        self._placed: dict[str, tuple[Leg, ...]] = {}
        self._ends: dict[str, dict[str, float]] = {}

    def place(self, request_id: str, legs: Sequence[Leg]) -> None:
        """`request_id` is on each (worker, until) of `legs` (none: rejected); deciding a
        turn again replaces what it placed before."""
        self.finish(request_id)
        kept = tuple(e for e in legs if e[0] in self._ends or len(self._ends) < MAX_TRACKED_WORKERS)
        if not kept:
            return
        self._placed[request_id] = kept
        for worker, end_s in kept:
            self._ends.setdefault(worker, {})[request_id] = end_s
        if len(self._placed) > MAX_TRACKED_REQUESTS:
            for request in list(self._placed)[: MAX_TRACKED_REQUESTS // 4]:
                self.finish(request)

    def finish(self, request_id: str) -> None:
        for worker, _ in self._placed.pop(request_id, ()):
            ends = self._ends.get(worker)
            if ends is not None:
                ends.pop(request_id, None)
                if not ends:
                    del self._ends[worker]

    def done_at(self, worker: str, now_s: float, exclude: str = "") -> tuple[int, float]:
        """(how many, when the last is done) of the requests placed on `worker` and not seen
        finish, `exclude`'s own left out; one predicted done already is late: it ends any
        moment (now)."""
        ends = self._ends.get(worker)
        if not ends:
            return 0, now_s
        count, last = 0, now_s
        stale = now_s - STALE_AFTER_S
        gone = []
        for request, end_s in ends.items():
            if end_s < stale:
                gone.append(request)
            elif request != exclude:
                count += 1
                last = end_s if end_s > last else last
        for request in gone:
            self.finish(request)
        return count, last
