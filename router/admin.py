"""Operator endpoints under /admin, enabled only when an admin token is configured."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from policies import PolicyConfigError, create_policy
from router.errors import error_response
from router.events import EventLog
from router.proxy import PolicyHolder
from router.state import UNKNOWN, SharedState
from router.workers import WorkerPool

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_encode = msgspec.json.Encoder().encode


class PolicyUpdate(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    params: dict[str, Any] = {}


class Admin:
    def __init__(
        self,
        token: str | None,
        pool: WorkerPool,
        state: SharedState,
        events: EventLog,
        policy: PolicyHolder,
    ) -> None:
        self._token = token
        self._pool = pool
        self._state = state
        self._events = events
        self._policy = policy

    def add_routes(self, app: web.Application) -> None:
        routes = [
            ("GET", "/admin/sessions/{session_id}", self.session),
            ("GET", "/admin/workers", self.workers),
            ("POST", "/admin/workers/{worker_id}/drain", self.drain),
            ("DELETE", "/admin/workers/{worker_id}/drain", self.undrain),
            ("GET", "/admin/decisions", self.decisions),
            ("GET", "/admin/policy", self.get_policy),
            ("PUT", "/admin/policy", self.put_policy),
        ]
        for method, path, handler in routes:
            app.router.add_route(method, path, self._guard(handler))

    def _guard(self, handler: Handler) -> Handler:
        async def guarded(request: web.Request) -> web.StreamResponse:
            if self._token is None:
                return error_response(404, f"{request.path} not found")
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self._token}".encode()):
                return error_response(401, "admin endpoints need 'Authorization: Bearer <token>'")
            return await handler(request)

        return guarded

    async def session(self, request: web.Request) -> web.Response:
        session_id = request.match_info["session_id"]
        record = self._state.cached_session(session_id)
        if record is UNKNOWN:
            record = await self._state.load_session(session_id)
        if record is None:
            return error_response(404, f"no residency known for session {session_id!r}")
        return _json(record)

    async def workers(self, request: web.Request) -> web.Response:
        fleet = self._state.fleet_inflight()
        rows = []
        for worker_id, state in self._pool.workers.items():
            rows.append({
                "id": worker_id, "url": state.spec.url, "role": state.spec.role,
                "engine": state.spec.engine, "healthy": state.healthy,
                "draining": state.draining, "inflight": state.inflight,
                "fleet_inflight": fleet.get(worker_id, 0),
                "load": state.load, "models": state.models,
            })  # fmt: skip
        return _json({"workers": rows})

    async def drain(self, request: web.Request) -> web.Response:
        return self._set_draining(request, True)

    async def undrain(self, request: web.Request) -> web.Response:
        return self._set_draining(request, False)

    def _set_draining(self, request: web.Request, draining: bool) -> web.Response:
        worker_id = request.match_info["worker_id"]
        state = self._pool.get(worker_id)
        if state is None:
            return error_response(404, f"unknown worker {worker_id!r}", "worker_id")
        state.draining = draining
        return _json({"id": worker_id, "draining": draining, "inflight": state.inflight})

    async def decisions(self, request: web.Request) -> web.Response:
        try:
            limit = int(request.query.get("limit", "100"))
        except ValueError:
            return error_response(400, "limit must be an integer", "limit")
        if limit < 1:
            return error_response(400, "limit must be at least 1", "limit")
        return _json({"decisions": self._events.recent(limit)})

    async def get_policy(self, request: web.Request) -> web.Response:
        return _json({"name": self._policy.name})

    async def put_policy(self, request: web.Request) -> web.Response:
        try:
            update = msgspec.json.decode(await request.read(), type=PolicyUpdate)
            policy = create_policy(update.name, update.params)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return error_response(400, f"invalid policy update: {exc}")
        except PolicyConfigError as exc:
            return error_response(400, str(exc), "params")
        # One assignment: turns already placed keep the policy object they were decided with.
        self._policy.policy, self._policy.name = policy, update.name
        return _json({"name": update.name, "params": update.params})


def _json(payload: Any) -> web.Response:
    return web.Response(body=_encode(payload), content_type="application/json")
