"""Operator endpoints under /admin, enabled only when an admin token is configured."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from policies import PolicyConfigError, available_policies, create_policy
from router.config import ConfigError, WorkerSpec, check_workers
from router.errors import error_response
from router.fleet.membership import Membership, MembershipError
from router.fleet.workers import WorkerPool
from router.http import Request, Response
from router.obs.events import EventLog
from router.state.shared import UNKNOWN, SharedState
from router.turn.pipeline import PolicyHolder

_encode = msgspec.json.Encoder().encode
AdminHandler = Callable[[Request, str], Awaitable[Response]]


class PolicyUpdate(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    params: dict[str, Any] = {}


class Admin:
    PREFIX = "/admin/"

    def __init__(
        self,
        token: str | None,
        pool: WorkerPool,
        state: SharedState,
        events: EventLog,
        policy: PolicyHolder,
        allow_policy_import: bool = False,
        membership: Membership | None = None,
    ) -> None:
        self._token = token
        self._membership = membership if membership is not None else Membership(
            pool, lambda state: None, lambda worker_id: None
        )  # fmt: skip
        # PUT /admin/policy swaps to registered policies (built-ins, entry points) and to the
        # one the router started with; `module:attr` of any other class only when allowed
        self._allow_policy_import = allow_policy_import
        self._started_policy = policy.name
        self._pool = pool
        self._state = state
        self._events = events
        self._policy = policy
        # (method, first path segment after /admin/, has an id) -> handler
        self._routes: dict[tuple[str, str, bool], AdminHandler] = {
            ("GET", "sessions", True): self._session,
            ("GET", "workers", False): self._workers,
            ("POST", "workers", False): self._add_worker,
            ("DELETE", "workers", True): self._remove_worker,
            ("POST", "workers/drain", True): self._drain,
            ("DELETE", "workers/drain", True): self._undrain,
            ("GET", "decisions", False): self._decisions,
            ("GET", "policy", False): self._get_policy,
            ("PUT", "policy", False): self._put_policy,
        }

    async def handle(self, request: Request) -> Response:
        """Everything under /admin/: 404 unless a token is configured, 401 without it."""
        if self._token is None:
            return error_response(404, f"{request.path} not found")
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self._token}".encode()):
            return error_response(401, "admin endpoints need 'Authorization: Bearer <token>'")
        route, ident = _match(request.path[len(self.PREFIX) :])
        handler = self._routes.get((request.method, route, ident is not None))
        if handler is None:
            known = any(key[1] == route for key in self._routes)
            if known:
                return error_response(405, f"method {request.method} not allowed")
            return error_response(404, f"{request.path} not found")
        return await handler(request, ident or "")

    async def _session(self, request: Request, session_id: str) -> Response:
        """The session's residency and `degraded`: true while Redis is unreachable and the
        answer is this replica's local view (503 where the view does not know the session)."""
        state = self._state
        record = state.cached_session(session_id)
        if record is UNKNOWN and not state.degraded:
            loaded = await state.load_session(session_id)  # UNKNOWN still if Redis just failed
            record = state.cached_session(session_id) if loaded is None else loaded
        if record is UNKNOWN:
            message = f"shared state unreachable; session {session_id!r} not in the local view"
            return error_response(503, message, retry_after_s=1.0)
        if record is None:
            return error_response(404, f"no residency known for session {session_id!r}")
        return _json({**msgspec.structs.asdict(record), "degraded": state.degraded})

    async def _workers(self, request: Request, _: str) -> Response:
        fleet = self._state.fleet_inflight()
        rows = []
        for worker_id, state in self._pool.workers.items():
            ejected_for = self._pool.ejected_for(worker_id)  # ends a finished ejection first
            rows.append({
                "id": worker_id, "url": state.spec.url, "role": state.spec.role,
                "engine": state.spec.engine, "healthy": state.healthy,
                "draining": state.draining, "inflight": state.inflight,
                "fleet_inflight": fleet.get(worker_id, 0),
                "started_since_scrape": state.started_since_scrape,
                "load": state.load, "models": state.models,
                "ejected": state.ejected, "ejected_for_s": ejected_for,
                "ejections": state.ejections, "consecutive_failures": state.consecutive_failures,
                "leaving": state.leaving,
                "origin": self._membership.origin(worker_id),
            })  # fmt: skip
        return _json({"workers": rows})

    async def _add_worker(self, request: Request, _: str) -> Response:
        """A worker joins this replica's fleet: the body is a `[[workers]]` entry as JSON."""
        try:
            spec = msgspec.json.decode(request.body, type=WorkerSpec)
            check_workers((spec,))
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            return error_response(400, f"invalid worker: {exc}")
        except ConfigError as exc:
            return error_response(400, str(exc), "url")
        try:
            state = self._membership.add(spec)
        except MembershipError as exc:
            return error_response(exc.status, str(exc), "id")
        body = {"id": spec.worker_id, "url": spec.url, "role": spec.role, "origin": "admin",
                "leaving": state.leaving}  # fmt: skip
        return Response(201, _encode(body))

    async def _remove_worker(self, request: Request, worker_id: str) -> Response:
        """A static or admin-added worker leaves this replica's fleet and drains (202)."""
        try:
            state = self._membership.remove(worker_id)
        except MembershipError as exc:
            return error_response(exc.status, str(exc), "worker_id")
        body = {"id": worker_id, "leaving": True, "inflight": state.inflight}
        return Response(202, _encode(body))

    async def _drain(self, request: Request, worker_id: str) -> Response:
        return self._set_draining(worker_id, True)

    async def _undrain(self, request: Request, worker_id: str) -> Response:
        return self._set_draining(worker_id, False)

    def _set_draining(self, worker_id: str, draining: bool) -> Response:
        state = self._pool.get(worker_id)
        if state is None:
            return error_response(404, f"unknown worker {worker_id!r}", "worker_id")
        state.draining = draining
        return _json({"id": worker_id, "draining": draining, "inflight": state.inflight})

    async def _decisions(self, request: Request, _: str) -> Response:
        try:
            limit = int(request.query.get("limit", "100"))
        except ValueError:
            return error_response(400, "limit must be an integer", "limit")
        if limit < 1:
            return error_response(400, "limit must be at least 1", "limit")
        return _json({"decisions": self._events.recent(limit)})

    async def _get_policy(self, request: Request, _: str) -> Response:
        return _json({"name": self._policy.name})

    async def _put_policy(self, request: Request, _: str) -> Response:
        try:
            update = msgspec.json.decode(request.body, type=PolicyUpdate)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            return error_response(400, f"invalid policy update: {exc}")
        if (
            ":" in update.name
            and not self._allow_policy_import
            and update.name != self._started_policy
        ):
            registered = ", ".join(available_policies())
            return error_response(
                403, f"policy {update.name[:200]!r} is a module to import: the router swaps "
                f"only to registered policies ({registered}) unless started with "
                "--allow-policy-import", "name",
            )  # fmt: skip
        try:
            policy = create_policy(update.name, update.params)
        except PolicyConfigError as exc:
            return error_response(400, str(exc), "params")
        # No await between the two stores: turns already placed keep the policy they used.
        self._policy.policy, self._policy.name = policy, update.name
        return _json({"name": update.name, "params": update.params})


def _match(rest: str) -> tuple[str, str | None]:
    """`sessions/ID` -> ("sessions", ID); `workers/ID/drain` -> ("workers/drain", ID)."""
    parts = rest.split("/")
    if len(parts) == 1:
        return parts[0], None
    if len(parts) == 2 and parts[1]:
        return parts[0], parts[1]
    if len(parts) == 3 and parts[1]:
        return f"{parts[0]}/{parts[2]}", parts[1]
    return rest, None


def _json(payload: Any) -> Response:
    return Response(200, _encode(payload))
