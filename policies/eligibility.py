"""Shared load scoring and placement helpers for the baseline policies.

Only workers that accept new work (healthy, not draining) are eligible. Prefill work goes to
role "prefill" or "mixed"; decode work, and a colocated turn, to "decode" or "mixed".
"Least loaded" means the lowest `inflight + running + 2 x waiting`, ties broken by
worker_id, so a decision depends only on the view, never on the order of its workers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from policies.types import ClusterView, Colocate, Recompute, Reject, Role, WorkerView

PREFILL_ROLES: frozenset[Role] = frozenset(("prefill", "mixed"))
DECODE_ROLES: frozenset[Role] = frozenset(("decode", "mixed"))

# A missing role is usually a restart or a drain in progress: worth one quick retry.
NO_WORKER_RETRY_AFTER_S = 1.0

Work = Literal["prefill", "decode"]

_ROLES_OF: dict[Work, frozenset[Role]] = {"prefill": PREFILL_ROLES, "decode": DECODE_ROLES}


def load_score(worker: WorkerView) -> int:
    """Requests the worker holds or is about to get; waiting ones count double."""
    return worker.inflight + worker.running + 2 * worker.waiting


def can_serve(worker: WorkerView, roles: frozenset[Role]) -> bool:
    """Whether `worker` accepts new work in one of `roles`."""
    return worker.accepts_new_work and worker.role in roles


def least_loaded(
    view: ClusterView, roles: frozenset[Role], exclude: str | None = None
) -> WorkerView | None:
    """The least-loaded eligible worker in `roles` other than `exclude`, or None."""
    return _least_loaded(
        w for w in view.workers if w.accepts_new_work and w.role in roles and w.worker_id != exclude
    )


def resident_worker(view: ClusterView, roles: frozenset[Role]) -> WorkerView | None:
    """The session's resident worker when it can take work in `roles`, else None."""
    residency = view.residency
    if residency is None:
        return None
    worker = view.worker(residency.worker_id)
    if worker is None or not can_serve(worker, roles):
        return None
    return worker


def colocate_or_recompute(view: ClusterView, worker: str, reason: str) -> Colocate | Recompute:
    """Serve the whole turn on `worker`: a Recompute when the session's state lives elsewhere.

    Callers pick the resident worker whenever it is eligible, so a residency on another worker
    means that worker is unavailable.
    """
    residency = view.residency
    if residency is not None and residency.worker_id != worker:
        return Recompute(
            worker=worker, reason=f"{reason}; resident {residency.worker_id} unavailable"
        )
    return Colocate(worker=worker, reason=reason)


def reject_no_worker(work: Work) -> Reject:
    """Refuse a turn because no eligible worker can do `work`."""
    roles = " or ".join(sorted(_ROLES_OF[work]))
    return Reject(
        retry_after_s=NO_WORKER_RETRY_AFTER_S,
        reason=f"no eligible {work} worker (role {roles}, healthy, not draining)",
    )


def _least_loaded(workers: Iterable[WorkerView]) -> WorkerView | None:
    best: WorkerView | None = None
    best_score = 0
    for worker in workers:
        score = load_score(worker)
        if (
            best is None
            or score < best_score
            or (score == best_score and worker.worker_id < best.worker_id)
        ):
            best, best_score = worker, score
    return best
