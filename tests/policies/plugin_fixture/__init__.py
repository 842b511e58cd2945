"""A minimal third-party policy plugin, as a package would ship it.

A real plugin registers it in its own pyproject.toml:

    [project.entry-points."session_router.policies"]
    pinned = "my_package:PinnedPolicy"
"""

from __future__ import annotations

import msgspec

from policies import ClusterView, Colocate, Decision, Outcome, PolicyConfigError, Reject, Turn


class PinnedParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    worker: str
    retry_after_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.worker:
            raise PolicyConfigError("worker must not be empty")


class PinnedPolicy:
    """Run every turn whole on one named worker; reject while it cannot take work."""

    name = "pinned"
    Params = PinnedParams

    def __init__(self, params: PinnedParams) -> None:
        self.params = params

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        worker = view.worker(self.params.worker)
        if worker is None or not worker.accepts_new_work:
            return Reject(retry_after_s=self.params.retry_after_s, reason="pinned worker down")
        return Colocate(worker=worker.worker_id, reason="pinned")

    def observe(self, outcome: Outcome) -> None:
        """Pinned learns nothing."""
