"""Who is in the fleet: applies what the static configuration, discovery and /admin say.

Each worker has one origin: `static` (the configuration), `admin` (POST /admin/workers), or
the discovery source that reported it. A source's report is its whole set: workers of that
origin missing from it leave, new ones join, changed ones (a pod's new address) join again
with their new spec. A worker id already present from another origin is kept as it is (the
report's duplicate is logged and skipped): the static configuration and /admin win.

Joining and leaving run hooks (`on_join`, `on_leave`) that the router uses for the scraper,
the link capacities and the metrics; a worker that leaves drains in the pool
(`WorkerPool.leave`) and is forgotten by `reap` (`on_forget`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

from router.config import WorkerSpec
from router.fleet.workers import WorkerPool, WorkerState

log = logging.getLogger("router.fleet.membership")

STATIC = "static"
ADMIN = "admin"


class MembershipError(ValueError):
    """An /admin change that cannot be made (the message says why); `status` is its HTTP
    status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Membership:
    def __init__(
        self,
        pool: WorkerPool,
        on_join: Callable[[WorkerState], None],
        on_leave: Callable[[str], None],
        on_forget: Callable[[str], None] | None = None,
    ) -> None:
        self._pool = pool
        self._on_join = on_join
        self._on_leave = on_leave
        self._on_forget = on_forget
        self.origins: dict[str, str] = {worker_id: STATIC for worker_id in pool.workers}

    def origin(self, worker_id: str) -> str | None:
        return self.origins.get(worker_id)

    def reconcile(self, origin: str, specs: Sequence[WorkerSpec]) -> tuple[list[str], list[str]]:
        """Make the workers of `origin` exactly `specs`; the ids that joined and that left."""
        wanted: dict[str, WorkerSpec] = {}
        for spec in specs:
            worker_id = spec.worker_id
            owner = self.origins.get(worker_id)
            if owner is not None and owner != origin:
                log.warning("%s reports worker %s, already in the fleet from %s: skipped",
                            origin, worker_id, owner)  # fmt: skip
                continue
            wanted[worker_id] = spec
        joined = [w for w, spec in wanted.items() if not self._present(w, spec)]
        left = [
            worker_id for worker_id, owner in self.origins.items()
            if owner == origin and worker_id not in wanted
        ]  # fmt: skip
        for worker_id in left:
            self._leave(worker_id)
        for worker_id in joined:
            self._join(wanted[worker_id], origin)
        if joined or left:
            log.info("%s: %d workers joined %s, %d left %s", origin, len(joined), joined,
                     len(left), left)  # fmt: skip
        return joined, left

    def add(self, spec: WorkerSpec) -> WorkerState:
        """POST /admin/workers: a worker joins, unless its id is in the fleet already."""
        worker_id = spec.worker_id
        if worker_id in self.origins:
            raise MembershipError(409, f"worker {worker_id!r} is in the fleet already "
                                       f"({self.origins[worker_id]})")  # fmt: skip
        return self._join(spec, ADMIN)

    def remove(self, worker_id: str) -> WorkerState:
        """DELETE /admin/workers/{id}: a static or admin-added worker leaves (and drains). A
        discovered one would be found again: drain it instead, or remove it at its source."""
        owner = self.origins.get(worker_id)
        if owner is None:
            raise MembershipError(404, f"unknown worker {worker_id!r}")
        if owner not in (STATIC, ADMIN):
            raise MembershipError(
                409, f"worker {worker_id!r} comes from {owner} discovery, which would add it "
                "again: drain it (POST /admin/workers/{id}/drain) or remove it there",
            )  # fmt: skip
        state = self._pool.workers[worker_id]
        self._leave(worker_id)
        return state

    def reap(self) -> list[str]:
        """Forget the workers that left and have drained (`WorkerPool.reap`)."""
        gone = self._pool.reap()
        for worker_id in gone:
            if self._on_forget is not None:
                self._on_forget(worker_id)
        return gone

    def specs(self, origin: str) -> Iterable[WorkerSpec]:
        pool = self._pool.workers
        return (pool[w].spec for w, owner in self.origins.items() if owner == origin)

    def _present(self, worker_id: str, spec: WorkerSpec) -> bool:
        state = self._pool.workers.get(worker_id)
        return (
            state is not None
            and not state.leaving
            and state.spec == spec
            and worker_id in self.origins
        )

    def _join(self, spec: WorkerSpec, origin: str) -> WorkerState:
        state = self._pool.add(spec)
        self.origins[spec.worker_id] = origin
        self._on_join(state)
        return state

    def _leave(self, worker_id: str) -> None:
        del self.origins[worker_id]
        self._pool.leave(worker_id)
        self._on_leave(worker_id)
