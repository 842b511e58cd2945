"""The rest of the OpenAI-compatible API: what is not a chat or completions turn.

Embeddings, tokenize/detokenize, score and rerank go to a healthy worker serving the request's
model, the least loaded, with no session affinity and no handoff; the worker's answer is
relayed as it comes (status, body, a stream as a stream). `/v1/responses` (the Responses API)
is placed with session affinity but not through the turn pipeline: it goes whole to the
session's resident worker (else the least loaded), and its residency is committed under the
session and under the new response's id, which the next request names as its
`previous_response_id` (vLLM keeps a stored response on the worker that made it).
`GET /version` answers the router's version and each worker's; `DELETE /v1/sessions/{id}`
ends a session's residency.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from typing import Any
from urllib.parse import urlencode

import aiohttp
import msgspec

from policies.plan import kv_bytes
from router.config import RouterConfig
from router.errors import RouterError, error_response
from router.fleet.workers import ModelPool, WorkerPool
from router.http import (
    Request,
    Response,
    StreamWriter,
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeout,
)
from router.state.shared import UNKNOWN, SessionRecord, SharedState
from router.turn.fields import (
    MAX_JSON_DEPTH,
    RoutingFields,
    checked_header_id,
    session_identity,
    trace_headers,
)
from router.turn.legs import LegRunner, failure_kind
from router.version import version as router_version

log = logging.getLogger("router.api")

# POST endpoints passed to a worker: path -> whether the body must name its `model`
PASS_THROUGH: dict[str, bool] = {
    "/v1/embeddings": True,
    "/tokenize": False,
    "/detokenize": False,
    "/score": False,
    "/v1/score": False,
    "/rerank": False,
    "/v1/rerank": False,
    "/v2/rerank": False,
}
RESPONSES = "/v1/responses"
SESSIONS_PREFIX = "/v1/sessions/"
_VERSION_TIMEOUT_S = 2.0
_FINGERPRINT_ITEMS = 2
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp[_-][A-Za-z0-9_-]{1,200})"')
_INPUT_TOKENS = re.compile(rb'"input_tokens"\s*:\s*(\d+)')
_OUTPUT_TOKENS = re.compile(rb'"output_tokens"\s*:\s*(\d+)')
_SCAN_HEAD = 16 * 1024  # a stream's first bytes, where `response.created` names its id
_SCAN_TAIL = 16 * 1024  # its last bytes, where `response.completed` reports usage
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


class Api:
    """The endpoints above, over the turn path's worker pool, legs and shared state."""

    def __init__(
        self, config: RouterConfig, pool: WorkerPool, legs: LegRunner, state: SharedState
    ) -> None:
        self._config = config
        self._pool = pool
        self._legs = legs
        self._state = state
        self._session_header = config.session_header
        self._session_key = config.session_header.lower()

    # -- pass-through --------------------------------------------------------------------
    async def forward(self, request: Request, writer: StreamWriter) -> Response | None:
        """An embeddings, tokenize, score or rerank request, to the least loaded worker."""
        try:
            body = _json_object(request.body)
            model = _model_of(body, PASS_THROUGH[request.path])
            return await self._send(request, writer, model, None, _headers(request, self._config))
        except RouterError as exc:
            return exc.response()

    async def responses(self, request: Request, writer: StreamWriter) -> Response | None:
        """A Responses API request, on its session's resident worker where it can serve it."""
        try:
            body = _json_object(request.body)
            model = _model_of(body, True)
            session_id = self._responses_session(request, body)
            record = self._state.cached_session(session_id)
            if record is UNKNOWN:
                record = await self._state.load_session(session_id)
            headers = _headers(request, self._config)
            affinity = _Affinity(session_id, record, bool(body.get("stream")))
            return await self._send(request, writer, model, affinity, headers)
        except RouterError as exc:
            return exc.response()

    def _responses_session(self, request: Request, body: dict[str, Any]) -> str:
        previous = body.get("previous_response_id")
        if previous is not None:
            if not isinstance(previous, str):
                raise RouterError(400, "previous_response_id must be a string",
                                  "previous_response_id")  # fmt: skip
            return checked_header_id(previous, "previous_response_id")
        header = request.headers.get(self._session_key)
        if header:
            return checked_header_id(header, self._session_header)
        user = body.get("user")
        if isinstance(user, str) and user:
            return session_identity(None, RoutingFields(user=user))  # as a chat turn's
        digest = hashlib.blake2b(digest_size=12)
        given = body.get("input")
        if isinstance(given, list):
            given = given[:_FINGERPRINT_ITEMS]
        instructions = body.get("instructions")
        digest.update(_encode([instructions if isinstance(instructions, str) else None, given]))
        return "fp:" + digest.hexdigest()

    def _candidates(self, pool: ModelPool) -> list[str]:
        """The pool's workers that take turns now (not draining, not prefill-only), least
        loaded first (the fleet's in-flight counts, then running and waiting)."""
        inflight = self._state.fleet_inflight()
        found: list[tuple[int, int, str]] = []
        for state in pool.members:
            worker_id = state.spec.worker_id
            if not state.serving or state.draining or state.spec.role == "prefill":
                continue
            load = state.load
            queued = load.running + load.waiting if load is not None else 0
            found.append((max(state.inflight, inflight.get(worker_id, 0)), queued, worker_id))
        found.sort()
        return [worker_id for _, _, worker_id in found]

    async def _send(
        self, request: Request, writer: StreamWriter, model: str | None,
        affinity: _Affinity | None, headers: dict[str, str],
    ) -> Response | None:  # fmt: skip
        pool = self._pool.pool_for(model)
        if pool is None and model is None:  # tokenize and the like may name no model
            pool = self._pool.pool_for(self._pool.model_names()[0])
        if pool is None:
            raise RouterError(404, f"The model `{(model or '')[:256]}` does not exist.", "model")
        candidates = self._candidates(pool)
        if affinity is not None and affinity.record is not None:
            resident = affinity.record.worker_id
            if resident in candidates:
                candidates.remove(resident)
                candidates.insert(0, resident)
        if not candidates:
            raise RouterError(503, "no healthy worker is available", retry_after_s=1.0)
        path = request.path
        if request.query:
            path += "?" + urlencode(request.query)
        timeouts = self._legs.timeouts
        for attempt, worker_id in enumerate(candidates[:2]):
            with self._legs.inflight(worker_id):
                try:
                    upstream = await self._pool.upstream.request(
                        self._pool.url(worker_id), "POST", path, headers, request.body,
                        head_timeout_s=timeouts.whole_s, first_byte_timeout_s=timeouts.whole_s,
                        gap_timeout_s=timeouts.gap_s,
                    )  # fmt: skip
                except UpstreamError as exc:
                    self._legs.on_upstream_error(worker_id, failure_kind(exc, "connect"))
                    if isinstance(exc, UpstreamConnectError) and attempt == 0:
                        continue  # nothing was answered: once more, on the next worker
                    raise _failed(worker_id, exc) from exc
                try:
                    return await self._relay(writer, worker_id, upstream, affinity)
                except UpstreamError as exc:
                    self._legs.on_upstream_error(worker_id, failure_kind(exc, "body"))
                    if writer.started:
                        raise  # the status is out: the server ends the connection
                    raise _failed(worker_id, exc) from exc
                except BaseException:
                    upstream.close()  # a client that went away cancels the worker's request
                    raise
        raise RouterError(503, "no worker reachable", retry_after_s=1.0)

    async def _relay(
        self, writer: StreamWriter, worker_id: str, upstream: Any, affinity: _Affinity | None
    ) -> Response | None:
        status: int = upstream.status
        content_type: str = upstream.headers.get("content-type", "application/json")
        echo = {} if affinity is None else {"X-Session-Id": affinity.session_id}
        if status >= 500:
            self._legs.on_upstream_error(worker_id, f"http_{status}")
        else:
            self._legs.succeeded(worker_id)
        if content_type.startswith("text/event-stream"):
            await writer.start(status, {"Content-Type": content_type, "Cache-Control": "no-cache",
                                        **echo})  # fmt: skip
            head = bytearray()
            tail = b""
            async for chunk in upstream:
                await writer.write(chunk)
                if affinity is not None:
                    if len(head) < _SCAN_HEAD:
                        head += chunk[: _SCAN_HEAD - len(head)]
                    tail = (tail + chunk)[-_SCAN_TAIL:]
            await writer.end()
            if affinity is not None and status == 200:
                self._commit(affinity, worker_id, bytes(head), tail)
            return None
        body = await upstream.read()
        if affinity is not None and status == 200:
            self._commit(affinity, worker_id, body[:_SCAN_HEAD], body[-_SCAN_TAIL:])
        return Response(status, body, echo, content_type)

    def _commit(self, affinity: _Affinity, worker_id: str, head: bytes, tail: bytes) -> None:
        """Residency on `worker_id`, for the session and for the response's own id."""
        tokens = 0
        inputs, outputs = _INPUT_TOKENS.findall(tail), _OUTPUT_TOKENS.findall(tail)
        if inputs and outputs:
            tokens = int(inputs[-1]) + int(outputs[-1])
        nbytes = kv_bytes(tokens, self._config.kv_bytes_per_token)
        record = affinity.record
        expected = record.epoch if record is not None else 0
        self._state.commit_session_nowait(affinity.session_id, worker_id, tokens, nbytes, expected)
        match = _RESPONSE_ID.search(head)
        if match is not None:
            response_id = match[1].decode()
            if response_id != affinity.session_id:
                self._state.commit_session_nowait(response_id, worker_id, tokens, nbytes, 0)

    # -- sessions ------------------------------------------------------------------------
    async def end_session(self, session_id: str) -> Response:
        """DELETE /v1/sessions/{id}: its residency cleared (204), 404 where none is known."""
        try:
            checked_header_id(session_id, "session id")
        except RouterError as exc:
            return exc.response()
        state = self._state
        record = state.cached_session(session_id)
        if record is UNKNOWN:
            record = await state.load_session(session_id)
        if not isinstance(record, SessionRecord):
            return error_response(404, f"no session {session_id[:256]!r} is known")
        for _ in range(2):  # once more where a turn committed in between
            future = state.clear_session(session_id, record.epoch)
            try:
                async with asyncio.timeout(self._config.redis_timeout_s):
                    result = await future
            except TimeoutError:
                break  # the local view is cleared; the write is queued
            if result.ok or result.record is None:
                break
            record = result.record
        return Response(204, b"", None, None)

    # -- version -------------------------------------------------------------------------
    async def version(self) -> Response:
        """The router's version and each worker's (null where it did not say)."""

        async def ask(worker_id: str, url: str) -> tuple[str, Any]:
            try:
                async with self._pool.session.get(
                    url + "/version", timeout=aiohttp.ClientTimeout(total=_VERSION_TIMEOUT_S)
                ) as response:
                    if response.status != 200:
                        return worker_id, None
                    data = _decode(await response.read())
            except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError):
                return worker_id, None
            return worker_id, data.get("version") if isinstance(data, dict) else None

        answers = await asyncio.gather(
            *(
                ask(worker_id, state.spec.base_url)
                for worker_id, state in self._pool.workers.items()
            )
        )
        own = router_version()
        return Response(200, _encode({"version": own, "router": own, "workers": dict(answers)}))


class _Affinity:
    __slots__ = ("record", "session_id", "stream")

    def __init__(self, session_id: str, record: SessionRecord | None, stream: bool) -> None:
        self.session_id = session_id
        self.record = record
        self.stream = stream


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = _decode(raw)
    except RecursionError as exc:
        raise RouterError(400, f"request body nests JSON deeper than {MAX_JSON_DEPTH}") from exc
    except msgspec.DecodeError as exc:
        raise RouterError(400, f"Invalid JSON in request body: {exc}") from exc
    if not isinstance(body, dict):
        raise RouterError(400, "request body must be a JSON object")
    return body


def _model_of(body: dict[str, Any], required: bool) -> str | None:
    model = body.get("model")
    if model is None and not required:
        return None
    if not isinstance(model, str) or not model:
        raise RouterError(400, "model must be a non-empty string", "model")
    return model


def _headers(request: Request, config: RouterConfig) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    request_id = request.headers.get("x-request-id")
    if request_id is not None:
        headers["X-Request-Id"] = checked_header_id(request_id, "X-Request-Id")
    headers.update(trace_headers(request.headers.get("traceparent"),
                                 request.headers.get("tracestate")))  # fmt: skip
    authorization = request.headers.get("authorization")
    if config.forward_auth and authorization is not None:
        headers["Authorization"] = authorization
    return headers


def _failed(worker_id: str, exc: UpstreamError) -> RouterError:
    status = 504 if isinstance(exc, UpstreamTimeout) else 502
    return RouterError(status, f"worker {worker_id} failed: {exc}")
