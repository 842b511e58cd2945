"""`round-robin`: vLLM's example disaggregation proxy, blind to sessions and load."""

from __future__ import annotations

from policies.eligibility import reject_no_worker
from policies.params import NoParams
from policies.types import ClusterView, Colocate, Decision, Handoff, Outcome, Turn


class RoundRobinPolicy:
    """Prefill on the next prefill worker and decode on the next decode worker, in turn.

    Pools are the eligible workers sorted by worker_id (a mixed worker belongs to both), so
    two instances fed the same turns and views place them identically. With only mixed
    workers eligible there is no split: turns rotate over them whole (Colocate). Stateful:
    each cursor advances once per turn placed through it.
    """

    name = "round-robin"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params if params is not None else NoParams()
        self._next_prefill = 0
        self._next_decode = 0

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        prefill_pool: list[str] = []
        decode_pool: list[str] = []
        split = False
        for worker in view.workers:
            if not worker.accepts_new_work:
                continue
            role = worker.role
            if role != "decode":
                prefill_pool.append(worker.worker_id)
            if role != "prefill":
                decode_pool.append(worker.worker_id)
            split = split or role != "mixed"
        if not decode_pool:
            return reject_no_worker("decode")
        if not prefill_pool:
            return reject_no_worker("prefill")
        decode_pool.sort()
        decode = decode_pool[self._next_decode % len(decode_pool)]
        self._next_decode += 1
        if not split:
            return Colocate(worker=decode, reason="round robin over mixed workers")
        prefill_pool.sort()
        prefill = prefill_pool[self._next_prefill % len(prefill_pool)]
        self._next_prefill += 1
        if prefill == decode:
            return Colocate(worker=decode, reason="round robin picked one mixed worker for both")
        return Handoff(prefill_worker=prefill, decode_worker=decode, reason="round robin")

    def observe(self, outcome: Outcome) -> None:
        """Round robin learns nothing from outcomes."""
