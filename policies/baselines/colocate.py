"""`colocate`: session affinity; every turn runs whole on one worker, never handed off."""

from __future__ import annotations

from policies.eligibility import (
    DECODE_ROLES,
    colocate_or_recompute,
    least_loaded,
    reject_no_worker,
    resident_worker,
)
from policies.params import NoParams
from policies.types import ClusterView, Colocate, Decision, Outcome, Recompute, Reject, Turn


def serve_on_decode_worker(view: ClusterView) -> Colocate | Recompute | Reject:
    """Run the turn on the session's decode worker: resident if eligible, else least loaded.

    Least loaded is a Recompute when the session had a residency (on a worker that is gone,
    unhealthy, draining or not a decode/mixed worker), a Colocate for a new session.
    """
    resident = resident_worker(view, DECODE_ROLES)
    if resident is not None:
        return Colocate(worker=resident.worker_id, reason="resident worker")
    target = least_loaded(view, DECODE_ROLES)
    if target is None:
        return reject_no_worker("decode")
    return colocate_or_recompute(view, target.worker_id, "least-loaded decode worker")


class ColocatePolicy:
    """Affinity routing: keep each session on the worker that holds its KV state."""

    name = "colocate"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params if params is not None else NoParams()

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        return serve_on_decode_worker(view)

    def observe(self, outcome: Outcome) -> None:
        """Colocate learns nothing from outcomes."""
