"""router.http.client over real sockets, against aiohttp servers, router.http's own server and
scripted raw servers that misbehave on purpose."""

from __future__ import annotations

import asyncio
import gc
import json
import re
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Literal

import pytest
import uvloop
from aiohttp import web

from router.http import Handler, HttpServer, StreamWriter
from router.http.client import UpstreamBodyError, UpstreamConnectError, UpstreamError, UpstreamPool
from router.http.messages import Request, Response
from tests.conftest import free_port

CLOSE: Literal["close"] = "close"
Script = list[list[bytes | Literal["close"] | None]]
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class Upstreams:
    """Test upstreams on 127.0.0.1, all shut at teardown."""

    def __init__(self) -> None:
        self._shut: list[Callable[[], Awaitable[None]]] = []
        self._raw: list[asyncio.Server] = []

    async def aiohttp(self, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self._shut.append(runner.cleanup)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    async def either(self, kind: str) -> str:
        """aiohttp's server or router.http's, each answering /stream with five timed frames
        50 ms apart and anything else with an echo."""
        if kind == "aiohttp":
            return await self.aiohttp(_aiohttp_upstream)
        return (await self.own(_own_upstream))[0]

    async def own(self, handler: Handler, **options: Any) -> tuple[str, HttpServer]:
        server = HttpServer(handler, **options)
        await server.start("127.0.0.1", 0)
        self._shut.append(server.close)
        return f"http://127.0.0.1:{server.port}", server

    async def raw(self, script: Script) -> tuple[str, list[int]]:
        """Connection i takes its script[i]: bytes read a request and answer it, None reads
        one and closes unanswered, CLOSE closes; then it waits for the client to leave."""
        accepted = [0]

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted[0] += 1
            try:
                for step in script[min(accepted[0], len(script)) - 1]:
                    if step != CLOSE:
                        head = await reader.readuntil(b"\r\n\r\n")
                        length = re.search(rb"(?i)content-length: *(\d+)", head)
                        await reader.readexactly(int(length[1]) if length else 0)
                    if not isinstance(step, bytes):
                        break
                    writer.write(step)
                else:
                    await reader.read()
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        self._raw.append(await asyncio.start_server(serve, "127.0.0.1", 0))
        return f"http://127.0.0.1:{self._raw[-1].sockets[0].getsockname()[1]}", accepted

    def pool(self, **options: Any) -> UpstreamPool:
        pool = UpstreamPool(**options)
        self._shut.append(pool.close)
        return pool

    async def shut(self) -> None:
        for shut in reversed(self._shut):
            await shut()
        for server in self._raw:
            server.close()
        await asyncio.sleep(0.01)  # raw handlers see their clients gone and close


@pytest.fixture
async def upstreams() -> AsyncIterator[Upstreams]:
    started = Upstreams()
    yield started
    await started.shut()


@pytest.fixture
def pool(upstreams: Upstreams) -> UpstreamPool:
    return upstreams.pool()


def _echoed(method: str, path: str, headers: Mapping[str, str | None], body: bytes) -> bytes:
    names = ("host", "content-length", "x-session-id")
    fields = {"method": method, "path": path, **{name: headers.get(name) for name in names}}
    return json.dumps({**fields, "body": body.decode()}).encode()


async def _emit(write: Callable[[bytes], Awaitable[None]]) -> None:
    for _ in range(5):  # each frame carries the time it was written
        await write(b"data: %.6f\n\n" % time.perf_counter())
        await asyncio.sleep(0.05)


async def _aiohttp_upstream(request: web.Request) -> web.StreamResponse:
    if request.path != "/stream":
        body = _echoed(request.method, request.path_qs, request.headers, await request.read())
        return web.Response(body=body, content_type="application/json")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await _emit(response.write)
    await response.write_eof()
    return response


async def _own_upstream(request: Request, writer: StreamWriter) -> Response | None:
    """Also /hang: one frame, then nothing; /silent: nothing at all."""
    if request.path not in ("/stream", "/hang", "/silent"):
        query = "".join(f"?{key}={value}" for key, value in request.query.items())
        path, headers = request.path + query, request.headers
        return Response(200, _echoed(request.method, path, headers, request.body))
    if request.path == "/silent":
        await asyncio.sleep(30)
    await writer.start(200, {"Content-Type": "text/event-stream"})
    if request.path == "/hang":
        await writer.write(b"data: 0\n\n")
        await asyncio.sleep(30)
    await _emit(writer.write)
    await writer.end()
    return None


@pytest.mark.parametrize("upstream", ["aiohttp", "router.http"])
@pytest.mark.parametrize(
    ("method", "path", "body", "content_length"),
    [
        ("POST", "/v1/chat/completions", b'{"model":"m","stream":false}', "28"),
        ("POST", "/v1/completions", b"", "0"),
        ("GET", "/v1/models?x=1", b"", None),
    ],
)
async def test_json_then_a_stream_chunk_by_chunk(
    pool: UpstreamPool, upstreams: Upstreams, upstream: str, method: str, path: str,
    body: bytes, content_length: str | None,
) -> None:  # fmt: skip
    base = await upstreams.either(upstream)
    headers = {"X-Session-ID": "s-1", "Content-Length": "999", "Connection": "close"}
    response = await pool.request(base, method, path, headers, body)
    assert (response.status, response.headers.get("CONTENT-type")) == (200, "application/json")
    # Host is added, the caller's framing fields are replaced by the client's own
    sent = {"host": base.removeprefix("http://"), "content-length": content_length}
    assert await response.read() == _echoed(method, path, {**sent, "x-session-id": "s-1"}, body)
    response = await pool.request(base, "GET", "/stream", {})  # on the same connection
    assert response.headers["transfer-encoding"] == "chunked"
    arrived = [(time.perf_counter(), chunk) async for chunk in response.iter_chunks()]
    assert [(chunk[:6], chunk[-2:]) for _, chunk in arrived] == [(b"data: ", b"\n\n")] * 5
    written = [float(chunk[6:]) for _, chunk in arrived]
    for index, (at, _) in enumerate(arrived):
        assert at >= written[index]
        if index + 1 < len(written):
            assert at < written[index + 1]  # as written: before the next one (50 ms later) was
    assert len(pool.connections) == 1  # each read to the end: back in the pool


async def test_keep_alive_connections_are_reused_last_in_first_out(upstreams: Upstreams) -> None:
    peers: list[int] = []

    async def handler(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        await asyncio.sleep(float(request.query.get("sleep", "0")))
        return web.Response(body=b"ok")

    base, pool = await upstreams.aiohttp(handler), upstreams.pool(max_idle_per_host=2)

    async def get(path: str = "/") -> bytes:
        return await (await pool.request(base, "GET", path, {})).read()

    assert [await get() for _ in range(5)] == [b"ok"] * 5
    assert len(set(peers)) == 1
    assert await asyncio.gather(*(get("/?sleep=0.05") for _ in range(3))) == [b"ok"] * 3
    assert len(set(peers[5:])) == 3  # concurrent requests get their own connections
    await asyncio.sleep(0.01)
    assert len(pool.connections) == 2  # max_idle_per_host: the third one was closed
    await get()
    assert peers[-1] == peers[-2]  # the last one returned is the first one reused


async def test_connect_failures() -> None:
    # a listener that never accepts, its accept queue full: further handshakes go unanswered
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    fillers = [socket.socket() for _ in range(8)]
    for filler in fillers:
        filler.setblocking(False)
        filler.connect_ex(listener.getsockname())
    pool = UpstreamPool(connect_timeout_s=0.2)
    try:
        for port, reason in ((free_port(), "failed"), (listener.getsockname()[1], "timed out")):
            started = time.perf_counter()
            with pytest.raises(UpstreamConnectError, match=reason):
                await pool.request(f"http://127.0.0.1:{port}", "GET", "/", {})
            assert time.perf_counter() - started < 1.0
    finally:
        await pool.close()
        for sock in (*fillers, listener):
            sock.close()


MID_BODY = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789"
MID_CHUNKS = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\na\r\n0123456789\r\n"


@pytest.mark.parametrize(
    ("method", "script", "requests", "received", "error", "accepted", "pooled"),
    [
        ("GET", [[b"HTTP/1.1 200 OK\r\n\r\nto the end", CLOSE]], 1, b"to the end", None, 1, 0),
        ("GET", [[b"HTTP/1.1 100 Continue\r\n\r\n" + OK]], 1, b"ok", None, 1, 1),
        ("GET", [[OK + b"JUNK"]], 1, b"ok", None, 1, 0),
        ("GET", [[b"HTTP/1.1 204 No Content\r\n\r\n"]], 1, b"", None, 1, 1),
        ("GET", [[OK.replace(b"\r\n\r", b"\r\nConnection: close\r\n\r")]], 1, b"ok", None, 1, 0),
        ("HEAD", [[b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"]], 1, b"", None, 1, 0),
        ("GET", [[MID_BODY, CLOSE]], 1, b"0123456789", UpstreamBodyError, 1, 0),
        ("GET", [[MID_CHUNKS, CLOSE]], 1, b"0123456789", UpstreamBodyError, 1, 0),
        ("POST", [[None]], 1, b"", UpstreamConnectError, 1, 0),
        ("POST", [[b"HTTP/1.1 200 OK\r\nContent-", CLOSE]], 1, b"", UpstreamBodyError, 1, 0),
        ("POST", [[b"SSH-2.0-OpenSSH\r\n\r\n"]], 1, b"", UpstreamBodyError, 1, 0),
        ("POST", [[OK, None], [OK]], 2, b"ok", None, 2, 1),
        ("POST", [[OK, None], [None]], 2, b"", UpstreamConnectError, 2, 0),
    ],
    ids=["close-delimited", "interim-100", "junk-after", "no-content", "connection-close",
         "head", "died-mid-body", "died-mid-chunks", "closed-unanswered", "half-a-head",
         "not-http", "stale-keep-alive-retried", "stale-retried-only-once"],
)  # fmt: skip
@pytest.mark.parametrize("consume", ["iter_chunks", "read"])
async def test_scripted_upstreams(
    pool: UpstreamPool, upstreams: Upstreams, method: str, script: Script, requests: int,
    received: bytes, error: type[UpstreamError] | None, accepted: int, pooled: int, consume: str,
) -> None:  # fmt: skip
    base, connections = await upstreams.raw(script)
    for _ in range(requests - 1):
        assert await (await pool.request(base, "GET", "/", {})).read() == b"ok"
    chunks: list[bytes] = []
    try:
        response = await pool.request(base, method, "/", {}, b"{}" if method == "POST" else b"")
        if consume == "read":
            chunks.append(await response.read())
        async for chunk in response.iter_chunks():  # after read(): at the end already
            chunks.append(chunk)
    except UpstreamError as exc:
        assert type(exc) is error
        received = b"" if consume == "read" else received  # read() has nothing to return
    else:
        assert error is None
    assert (b"".join(chunks), connections[0]) == (received, accepted)
    await asyncio.sleep(0.05)
    assert len(pool.connections) == pooled


@pytest.mark.parametrize(
    "leave", ["close", "garbage", "cancel-request", "cancel-iter_chunks", "cancel-read"]
)
async def test_leaving_a_response_early_closes_its_connection(
    pool: UpstreamPool, upstreams: Upstreams, leave: str
) -> None:
    base, server = await upstreams.own(_own_upstream)

    async def consume() -> None:
        response = await pool.request(base, "GET", "/silent" if "request" in leave else "/hang", {})
        chunks = response.iter_chunks()
        assert await anext(chunks) == b"data: 0\n\n"
        if leave == "close":
            response.close()
            response.close()  # idempotent
        elif leave == "cancel-read":
            await response.read()
        elif leave == "cancel-iter_chunks":
            await anext(chunks)
        # "garbage": dropped here, unread

    task = asyncio.create_task(consume())
    if leave.startswith("cancel"):
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        await task
        gc.collect()
    await asyncio.sleep(0.05)
    assert (len(pool.connections), len(server.connections)) == (0, 0)  # the upstream saw it


async def test_slow_consumer_keeps_memory_bounded(pool: UpstreamPool, upstreams: Upstreams) -> None:
    piece = b"x" * 65536
    total = 1024 * len(piece)  # 64 MiB
    written = [0]

    async def huge(request: Request, writer: StreamWriter) -> None:
        await writer.start(200, {"Content-Type": "application/octet-stream"})
        while written[0] < total:
            await writer.write(piece)
            written[0] += len(piece)
        await writer.end()
        return None

    base, _ = await upstreams.own(huge)
    response = await pool.request(base, "GET", "/", {})
    await asyncio.sleep(1.0)  # a consumer that does not read at all for a while
    assert written[0] < 24 * 2**20  # the upstream was held back, not drained into memory
    sizes = [len(chunk) async for chunk in response.iter_chunks()]
    assert sum(sizes) == total
    assert max(sizes) <= 64 * 1024 + 256 * 1024  # high water plus one socket read


@pytest.mark.parametrize(
    ("server_idle_s", "max_idle", "pool_idle_s", "kept"),
    [(75.0, 0, 60.0, 0), (75.0, 8, 0.2, 1), (0.1, 8, 60.0, 1)],
    ids=["pool-keeps-none", "pool-idle-timeout", "server-closes-idle"],
)
async def test_idle_connections_do_not_outlive_the_limits(
    upstreams: Upstreams, server_idle_s: float, max_idle: int, pool_idle_s: float, kept: int
) -> None:
    base, server = await upstreams.own(_own_upstream, keepalive_timeout_s=server_idle_s)
    pool = upstreams.pool(max_idle_per_host=max_idle, idle_timeout_s=pool_idle_s)
    for path in ("/a", "/b"):
        response = await pool.request(base, "GET", path, {})
        assert json.loads(await response.read())["path"] == path
        await asyncio.sleep(0.01)
        assert len(pool.connections) == kept
        await asyncio.sleep(0.5)  # past the pool's or the server's idle timeout
        assert (len(pool.connections), len(server.connections)) == (0, 0)


@pytest.mark.parametrize(
    ("base", "path", "headers"),
    [
        ("ftp://127.0.0.1:1", "/", {}),  # https:// is served: test_client_tls
        ("http://127.0.0.1:1", "no-slash", {}),
        ("http://127.0.0.1:1", "/a b", {}),
        ("http://127.0.0.1:1", "/", {"X-Evil": "a\r\nInjected: 1"}),
    ],
    ids=["other-scheme", "relative-path", "space-in-path", "header-injection"],
)
async def test_invalid_requests_are_refused_before_sending(
    pool: UpstreamPool, base: str, path: str, headers: dict[str, str]
) -> None:
    with pytest.raises(ValueError):
        await pool.request(base, "GET", path, headers)
    assert len(pool.connections) == 0
    await pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        await pool.request("http://127.0.0.1:1", "GET", "/", {})


async def _smoke() -> tuple[bytes, bytes, int]:  # a JSON round trip, then a stream left early
    server, pool = HttpServer(_own_upstream), UpstreamPool()
    try:
        async with asyncio.timeout(10):
            await server.start("127.0.0.1", 0)
            base = f"http://127.0.0.1:{server.port}"
            body = await (await pool.request(base, "POST", "/json", {}, b"{}")).read()
            reply = await pool.request(base, "GET", "/hang", {})
            first = await anext(reply.iter_chunks())
            reply.close()
            await asyncio.sleep(0.05)
            return body, first, len(server.connections) + len(pool.connections)
    finally:
        await pool.close()
        await server.close()


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_server_and_client_smoke_on_both_event_loops(loop_name: str) -> None:
    factory = uvloop.new_event_loop if loop_name == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        body, first, connections = runner.run(_smoke())
    assert (json.loads(body)["body"], first, connections) == ("{}", b"data: 0\n\n", 0)
