"""An example session-router placement policy, shipped in its own package.

`least-waiting` keeps a session on its resident worker while that worker's waiting queue is
at most `max_waiting`; otherwise (and for new sessions) it colocates the turn on the
decode-capable worker with the fewest waiting requests. It shows the whole plugin contract:
a `Params` struct validated at construction, `decide` (pure, no I/O) and `observe`.
"""

from __future__ import annotations

import msgspec

from policies import PolicyConfigError
from policies.types import ClusterView, Colocate, Decision, Outcome, Recompute, Reject, Turn


class LeastWaitingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_waiting: int = 4

    def __post_init__(self) -> None:
        if self.max_waiting < 0:
            raise PolicyConfigError(f"max_waiting must be >= 0, got {self.max_waiting}")


class LeastWaitingPolicy:
    Params = LeastWaitingParams
    name = "least-waiting"

    def __init__(self, params: LeastWaitingParams | None = None) -> None:
        self.params = params if params is not None else LeastWaitingParams()
        self.turns_seen = 0

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        eligible = [w for w in view.workers if w.accepts_new_work and w.role in ("decode", "mixed")]
        if not eligible:
            return Reject(retry_after_s=1.0, reason="no decode-capable worker")
        residency = view.residency
        if residency is not None:
            resident = next((w for w in eligible if w.worker_id == residency.worker_id), None)
            if resident is not None and resident.waiting <= self.params.max_waiting:
                return Colocate(resident.worker_id, reason="resident queue short")
        best = min(eligible, key=lambda w: (w.waiting, w.running, w.worker_id))
        if residency is not None and residency.worker_id != best.worker_id:
            return Recompute(best.worker_id, reason="resident queue too long or gone")
        return Colocate(best.worker_id, reason="fewest waiting")

    def observe(self, outcome: Outcome) -> None:
        self.turns_seen += 1
