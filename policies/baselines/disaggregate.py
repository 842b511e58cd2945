"""`disaggregate`: a fixed prefill/decode split (vllm-router, SGLang gateway)."""

from __future__ import annotations

from policies.eligibility import (
    DECODE_ROLES,
    PREFILL_ROLES,
    colocate_or_recompute,
    least_loaded,
    reject_no_worker,
    resident_worker,
)
from policies.params import NoParams
from policies.types import ClusterView, Decision, Handoff, Outcome, Turn


def handoff_to_decode_worker(view: ClusterView, reason: str) -> Decision:
    """Prefill on the least-loaded prefill worker, decode on the session's decode worker.

    The decode worker is the resident one if eligible, else the least-loaded decode/mixed
    worker. The prefill worker is never the decode worker itself (a mixed worker can be
    both); when no other prefill worker is eligible, the turn runs whole on the decode worker.
    """
    decode = resident_worker(view, DECODE_ROLES) or least_loaded(view, DECODE_ROLES)
    if decode is None:
        return reject_no_worker("decode")
    prefill = least_loaded(view, PREFILL_ROLES, exclude=decode.worker_id)
    if prefill is None:
        return colocate_or_recompute(
            view, decode.worker_id, "no other eligible prefill worker: colocate on decode worker"
        )
    return Handoff(prefill_worker=prefill.worker_id, decode_worker=decode.worker_id, reason=reason)


class DisaggregatePolicy:
    """Hand every turn off from a prefill worker to the session's decode worker."""

    name = "disaggregate"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params if params is not None else NoParams()

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        return handoff_to_decode_worker(view, "fixed split")

    def observe(self, outcome: Outcome) -> None:
        """A fixed split learns nothing from outcomes."""
