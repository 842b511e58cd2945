"""router.http.server over real sockets: framing, keep-alive, pipelining, limits, streaming,
disconnects, failures and graceful close."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import httptools
import pytest

from router.http import Handler, HttpServer, Request, Response, StreamWriter

GET = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


class Reply:
    def __init__(self) -> None:
        self.status, self.headers, self.body = 0, dict[str, str](), b""
        self.chunks, self.complete = 0, False


class RawClient:
    """A raw TCP client parsing replies with httptools: the bytes on the wire are checked
    without a client library smoothing them over."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.replies: list[Reply] = []
        self._parser = httptools.HttpResponseParser(self)

    @classmethod
    async def connect(cls, port: int) -> RawClient:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    def on_message_begin(self) -> None:
        self.replies.append(Reply())

    def on_header(self, name: bytes, value: bytes) -> None:
        self.replies[-1].headers[name.decode().lower()] = value.decode()

    def on_headers_complete(self) -> None:
        self.replies[-1].status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.replies[-1].body += body

    def on_chunk_header(self) -> None:
        self.replies[-1].chunks += 1

    def on_message_complete(self) -> None:
        self.replies[-1].complete = True

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def replies_done(self, count: int, within_s: float = 5.0) -> list[Reply]:
        async with asyncio.timeout(within_s):
            while sum(reply.complete for reply in self.replies) < count:
                if not (data := await self.reader.read(65536)):
                    break
                self._parser.feed_data(data)
        return self.replies

    async def at_eof(self, within_s: float = 2.0) -> bool:
        async with asyncio.timeout(within_s):
            while data := await self.reader.read(65536):
                self._parser.feed_data(data)
        return True


async def echo(request: Request, writer: StreamWriter) -> Response:
    payload = {
        "method": request.method,
        "path": request.path,
        "query": request.query,
        "body": request.body.decode(),
        "version": request.http_version,
        "remote": request.remote,
        "multi": [request.headers.get("X-Multi"), "x-MULTI" in request.headers],
    }
    return Response(200, json.dumps(payload).encode(), headers={"X-Served": "1"})


Serve = Callable[..., Awaitable[tuple[HttpServer, RawClient]]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """Starts a server and connects one raw client to it; both are closed afterwards."""
    started: list[tuple[HttpServer, RawClient]] = []

    async def start(handler: Handler = echo, **options: Any) -> tuple[HttpServer, RawClient]:
        server = HttpServer(handler, **options)
        await server.start("127.0.0.1", 0)
        started.append((server, await RawClient.connect(server.port)))
        return started[-1]

    yield start
    for server, client in started:
        client.writer.close()
        await server.close(grace_s=1.0)


@pytest.mark.parametrize(
    ("request_bytes", "expected"),
    [
        (
            b"GET /v1/models?a=1&b=2&a=3 HTTP/1.1\r\nHost: x\r\nX-MULTI: a\r\nx-multi: b\r\n\r\n",
            {"method": "GET", "path": "/v1/models", "query": {"a": "3", "b": "2"}, "body": "",
             "multi": ["a, b", True]},
        ),
        (
            b"POST /v1/chat%20completions HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n\r\n"
            b'{"a": true}',
            {"method": "POST", "path": "/v1/chat completions", "query": {}, "body": '{"a": true}',
             "multi": [None, False]},
        ),
        (
            b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
            {"method": "POST", "path": "/c", "query": {}, "body": "hello world",
             "multi": [None, False]},
        ),
        (
            b"POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\nping",
            {"method": "POST", "path": "/e", "query": {}, "body": "ping", "multi": [None, False]},
        ),
    ],
    ids=["get-query-headers", "post-content-length", "post-chunked", "expect-100-continue"],
)  # fmt: skip
async def test_request_is_parsed_whole(
    serve: Serve, request_bytes: bytes, expected: dict[str, Any]
) -> None:
    _, client = await serve()
    for start in range(0, len(request_bytes), 7):  # dribbled: the parser must reassemble it
        client.send(request_bytes[start : start + 7])
        await asyncio.sleep(0)
    expect = b"Expect" in request_bytes  # answered "100 Continue" once the head is in
    *interim, reply = await client.replies_done(2 if expect else 1)
    assert [early.status for early in interim] == ([100] if expect else [])
    assert json.loads(reply.body) == {**expected, "version": "1.1", "remote": "127.0.0.1"}
    assert reply.headers == {
        "x-served": "1",
        "content-type": "application/json",
        "content-length": str(len(reply.body)),
    }


@pytest.mark.parametrize(
    ("request_bytes", "connection", "persists"),
    [
        (GET, None, True),
        (b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", "close", False),
        (b"GET / HTTP/1.0\r\n\r\n", "close", False),
        (b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", "keep-alive", True),
    ],
    ids=["http-1.1", "connection-close", "http-1.0", "http-1.0-keep-alive"],
)
async def test_keep_alive_until_idle_unless_asked_to_close(
    serve: Serve, request_bytes: bytes, connection: str | None, persists: bool
) -> None:
    _, client = await serve(keepalive_timeout_s=0.3)
    rounds = 5 if persists else 1
    for index in range(rounds):
        client.send(request_bytes)
        reply = (await client.replies_done(index + 1))[index]
        assert (reply.status, reply.headers.get("connection")) == (200, connection)
    assert len(client.replies) == rounds  # all on this one connection
    started = time.perf_counter()
    assert await client.at_eof()  # closed at once, or once idle for keepalive_timeout_s
    assert time.perf_counter() - started == pytest.approx(0.3 if persists else 0, abs=0.15)


async def test_pipelined_requests_are_answered_in_order_and_not_buffered_without_bound(
    serve: Serve,
) -> None:
    gate = asyncio.Event()

    async def gated(request: Request, writer: StreamWriter) -> Response:
        if request.path == "/first":
            await gate.wait()
        return Response(200, b"%s %d" % (request.path.encode(), len(request.body)))

    _, client = await serve(gated)
    count = 400  # 26 MB: more than the loopback socket buffers hold
    client.send(GET.replace(b"/", b"/first", 1))
    client.send(b"".join(b"POST /%d HTTP/1.1\r\nContent-Length: 65536\r\n\r\n" % index
                         + b"x" * 65536 for index in range(count)))  # fmt: skip
    with pytest.raises(TimeoutError):  # the server stopped reading while /first is in flight
        await asyncio.wait_for(client.writer.drain(), timeout=1.0)
    gate.set()
    replies = await client.replies_done(count + 1, within_s=60)
    expected = [b"/first 0"] + [b"/%d 65536" % index for index in range(count)]
    assert [reply.body for reply in replies] == expected


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1025\r\n\r\n", 413),
        (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1025\r\nExpect: 100-continue\r\n\r\n",
         413),
        (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n401\r\n"
         + b"a" * 1025 + b"\r\n", 413),
        (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4194304\r\n\r\n" + b"x" * 4194304, 413),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 garbage\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", 400),
        (b"GET / HTTP/1.1\r\nX-Pad: " + b"a" * 70000 + b"\r\n\r\n", 431),
    ],
    ids=["content-length", "expect", "chunked", "body-in-flight", "garbage", "two-lengths",
         "huge-head"],
)  # fmt: skip
async def test_refused_requests_get_an_openai_error_and_close(
    serve: Serve, request_bytes: bytes, status: int
) -> None:
    _, client = await serve(max_body_bytes=1024)
    client.send(request_bytes)  # "body-in-flight": still arriving when the server refuses
    [reply] = await client.replies_done(1)
    assert (reply.status, reply.headers["connection"]) == (status, "close")
    error = json.loads(reply.body)["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, status)
    assert isinstance(error["message"], str) and error["message"]
    assert await client.at_eof()  # and nothing else: no handler ran
    assert len(client.replies) == 1


async def test_head_and_no_content_responses_carry_no_body(serve: Serve) -> None:
    async def handler(request: Request, writer: StreamWriter) -> Response:
        return Response(204 if request.path == "/empty" else 200, b"twelve bytes")

    _, client = await serve(handler)
    client.send(b"HEAD /h HTTP/1.1\r\nHost: x\r\n\r\n")
    raw = await asyncio.wait_for(client.reader.read(65536), timeout=2)
    assert raw.endswith(b"Content-Length: 12\r\n\r\n")  # the length a GET would get, no body
    client.send(b"GET /empty HTTP/1.1\r\nHost: x\r\n\r\n")
    raw = await asyncio.wait_for(client.reader.read(65536), timeout=2)
    assert raw.startswith(b"HTTP/1.1 204 No Content\r\n")
    assert raw.endswith(b"\r\n\r\n") and b"content-length" not in raw.lower()


async def test_aiohttp_client_keeps_alive_and_gets_chunks_as_written(serve: Serve) -> None:
    written: list[float] = []

    async def handler(request: Request, writer: StreamWriter) -> Response | None:
        if request.path != "/stream":
            return await echo(request, writer)
        await writer.start(200, {"Content-Type": "text/event-stream"})
        for index in range(5):
            written.append(time.perf_counter())
            await writer.write(b"data: %d\n\n" % index)
            await asyncio.sleep(0.05)
        await writer.end()
        return None

    server, _ = await serve(handler)
    base, seen = f"http://127.0.0.1:{server.port}", set[int]()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        for index in range(3):
            async with session.post(base + "/k", data=b"x" * index) as response:
                assert (await response.json())["body"] == "x" * index
            seen.update(map(id, server.connections))
        async with session.get(base + "/stream") as response:
            assert response.headers["Content-Type"] == "text/event-stream"
            assert response.headers["Transfer-Encoding"] == "chunked"
            arrived = [(time.perf_counter(), data) async for data in response.content.iter_any()]
        seen.update(map(id, server.connections))
    assert len(seen) == 2  # the fixture's raw client, and one for all of aiohttp's requests
    assert [data for _, data in arrived] == [b"data: %d\n\n" % index for index in range(5)]
    for index, (at, _) in enumerate(arrived):
        assert at >= written[index]
        if index + 1 < len(written):
            assert at < written[index + 1]  # as written: before the next one (50 ms later) was


@pytest.mark.parametrize("version", ["1.1", "1.0"])
async def test_streams_are_framed_for_the_client_version(serve: Serve, version: str) -> None:
    async def stream(request: Request, writer: StreamWriter) -> None:
        await writer.start(200, {"Content-Type": "text/plain", "Content-Length": "99"})
        await writer.write(b"one")
        await writer.write(b"")  # ignored: an empty chunk would end the stream early
        await writer.write(b"two")
        await writer.end()
        return None

    _, client = await serve(stream)
    request = b"GET / HTTP/%s\r\nHost: x\r\nConnection: keep-alive\r\n\r\n" % version.encode()
    rounds = 2 if version == "1.1" else 1
    for index in range(rounds):
        client.send(request)
        reply = (await client.replies_done(index + 1))[index]
        assert reply.body == b"onetwo"
        assert "content-length" not in reply.headers  # the caller's framing is dropped
    if version == "1.1":  # chunked, two chunks and the terminator; the connection stays
        assert (reply.chunks, reply.headers["transfer-encoding"]) == (3, "chunked")
    else:  # no chunked encoding in HTTP/1.0: the end of the stream is the end of the connection
        assert await client.at_eof()
        assert (reply.chunks, reply.headers["connection"]) == (0, "close")


@pytest.mark.parametrize(
    ("hold_s", "first_chunk_after_s", "head_alone_first"),
    [(5.0, 0.1, False), (0.05, 0.5, True)], ids=["first-chunk-within-hold", "first-chunk-late"],
)  # fmt: skip
async def test_stream_head_waits_briefly_for_the_first_chunk(
    serve: Serve, hold_s: float, first_chunk_after_s: float, head_alone_first: bool
) -> None:
    """A first chunk ready within the hold leaves in the head's send; a late one does not hold
    the head back. The last chunk and the terminator leave in one send."""
    finish = asyncio.Event()

    async def stream(request: Request, writer: StreamWriter) -> None:
        await writer.start(200, {"Content-Type": "text/event-stream"})
        await asyncio.sleep(first_chunk_after_s)
        await writer.write(b"data: 1\n\n")
        await finish.wait()
        await writer.end(b"data: [DONE]\n\n")
        return None

    _, client = await serve(stream, head_hold_s=hold_s)
    client.send(GET)
    first = await asyncio.wait_for(client.reader.read(65536), 5.0)
    assert first.startswith(b"HTTP/1.1 200 ")
    assert (b"data: 1" not in first) is head_alone_first
    if head_alone_first:
        first += await asyncio.wait_for(client.reader.read(65536), 5.0)
    assert first.endswith(b"\r\n\r\n9\r\ndata: 1\n\n\r\n")
    finish.set()
    last = await asyncio.wait_for(client.reader.read(65536), 5.0)
    assert last == b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"


@pytest.mark.parametrize("streaming", [True, False], ids=["mid-stream", "before-response"])
async def test_client_disconnect_cancels_the_handler_at_once(serve: Serve, streaming: bool) -> None:
    started, cancelled_at = asyncio.Event(), asyncio.get_running_loop().create_future()

    async def long_running(request: Request, writer: StreamWriter) -> None:
        if streaming:
            await writer.start(200, {"Content-Type": "text/event-stream"})
            await writer.write(b"data: 1\n\n")
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled_at.set_result(time.perf_counter())
            raise
        return None

    server, client = await serve(long_running)
    client.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    await asyncio.wait_for(started.wait(), timeout=2)
    if streaming:
        assert (await asyncio.wait_for(client.reader.read(65536), 2)).startswith(b"HTTP/1.1 200")
    gone_at = time.perf_counter()
    client.writer.transport.abort()
    assert await asyncio.wait_for(cancelled_at, timeout=1) - gone_at < 0.1
    await asyncio.sleep(0.01)
    assert len(server.connections) == 0


async def test_a_client_leaving_after_its_stream_ended_lets_the_handler_finish(
    serve: Serve,
) -> None:
    # A relay ends the client's stream at the worker's [DONE], then reads the worker's stream
    # to its close: a client gone meanwhile had its whole answer and cancels nothing.
    ended, finish = asyncio.Event(), asyncio.Event()
    finished: list[str] = []

    async def ends_then_works(request: Request, writer: StreamWriter) -> None:
        await writer.start(200, {"Content-Type": "text/event-stream"})
        await writer.end(b"data: [DONE]\n\n")
        ended.set()
        await finish.wait()
        await writer.end()  # a second end is a no-op, with or without the client
        finished.append("done")
        return None

    server, client = await serve(ends_then_works)
    client.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    await asyncio.wait_for(ended.wait(), timeout=2)
    answer = b""
    while not answer.endswith(b"0\r\n\r\n"):
        answer += await asyncio.wait_for(client.reader.read(65536), 2)
    client.writer.transport.abort()
    await asyncio.sleep(0.05)  # the server has seen the connection go
    (conn,) = server.connections  # counted until its handler is done
    assert conn.closed and conn.task is not None and not conn.task.done()
    finish.set()
    await asyncio.sleep(0.01)
    assert finished == ["done"] and len(server.connections) == 0


async def test_close_waits_for_a_handler_finishing_after_its_client_left(serve: Serve) -> None:
    ended, finished = asyncio.Event(), asyncio.Event()

    async def ends_then_works(request: Request, writer: StreamWriter) -> None:
        await writer.start(200, {"Content-Type": "text/event-stream"})
        await writer.end(b"data: [DONE]\n\n")
        ended.set()
        await asyncio.sleep(0.2)
        finished.set()
        return None

    server, client = await serve(ends_then_works)
    client.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    await asyncio.wait_for(ended.wait(), timeout=2)
    client.writer.transport.abort()
    await asyncio.sleep(0.05)
    await server.close(grace_s=5.0)
    assert finished.is_set() and len(server.connections) == 0


@pytest.mark.parametrize("streaming", [False, True], ids=["plain", "stream"])
async def test_after_sent_runs_once_the_client_has_its_reply(serve: Serve, streaming: bool) -> None:
    # The callback blocks the server's loop until a client in another thread holds the whole
    # reply: were it run before the reply is written, the client could never get it.
    received, outcome = threading.Event(), list[bool]()

    async def handler(request: Request, writer: StreamWriter) -> Response | None:
        writer.after_sent(lambda: outcome.append(received.wait(timeout=5)))
        if not streaming:
            return Response(200, b"answer", content_type="text/plain")
        await writer.start(200, {"Content-Type": "text/plain"})
        await writer.end(b"answer")
        return None

    server, _ = await serve(handler)

    def fetch() -> bytes:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        connection.request("GET", "/")
        body = connection.getresponse().read()
        received.set()
        connection.close()
        return body

    assert await asyncio.to_thread(fetch) == b"answer"
    assert outcome == [True]


@pytest.mark.parametrize("ending", ["raise", "client-gone", "callback-raises"])
async def test_after_sent_runs_exactly_once_however_the_request_ends(
    serve: Serve, caplog: pytest.LogCaptureFixture, ending: str
) -> None:
    calls, started, called = list[str](), asyncio.Event(), asyncio.Event()

    def record(outcome: str) -> None:
        calls.append(outcome)
        called.set()

    async def handler(request: Request, writer: StreamWriter) -> Response:
        if request.path == "/next":
            return Response(200, b"next", content_type="text/plain")
        if ending == "callback-raises":
            writer.after_sent(lambda: calls.append(str(1 / 0)))
            return Response(200, b"fine", content_type="text/plain")
        writer.after_sent(lambda: record(ending))
        if ending == "raise":
            raise ValueError("boom")
        started.set()
        await asyncio.sleep(30)
        raise AssertionError("the client left: never reached")

    _, client = await serve(handler)
    client.send(GET)
    if ending == "client-gone":
        await asyncio.wait_for(started.wait(), timeout=2)
        client.writer.transport.abort()
        await asyncio.wait_for(called.wait(), timeout=2)
        assert calls == ["client-gone"]
        return
    client.send(b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
    first, second = await client.replies_done(2)
    assert (first.status, second.body) == (500 if ending == "raise" else 200, b"next")
    if ending == "raise":
        assert calls == ["raise"]
    else:  # a failing callback is logged; the connection serves on
        assert calls == [] and "after-sent callback failed" in caplog.text


@pytest.mark.parametrize(
    "failure", ["raise", "none-without-start", "raise-after-start", "response-after-start"]
)
async def test_failing_handlers(
    serve: Serve, caplog: pytest.LogCaptureFixture, failure: str
) -> None:
    async def broken(request: Request, writer: StreamWriter) -> Response | None:
        if request.path == "/ok":
            return Response(200, b"fine", content_type="text/plain")
        if failure == "raise":
            raise ValueError("boom")
        if failure == "none-without-start":
            return None
        await writer.start(200, {"Content-Type": "text/plain"})
        await writer.write(b"partial")
        if failure == "raise-after-start":
            raise RuntimeError("upstream failed mid-stream")
        return Response()

    _, client = await serve(broken)
    client.send(GET + b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
    if failure in ("raise", "none-without-start"):  # nothing was sent yet: a 500, and go on
        failed, ok = await client.replies_done(2)
        assert (failed.status, json.loads(failed.body)) == (500, {
            "error": {"message": "internal server error", "type": "internal_error",
                      "param": None, "code": 500}
        })  # fmt: skip
        assert (ok.status, ok.body) == (200, b"fine")
    else:  # the status went out already: the stream is cut, never completed
        assert await client.at_eof()
        [reply] = client.replies
        assert (reply.status, reply.body, reply.complete) == (200, b"partial", False)
    assert "handler failed for GET /" in caplog.text


@pytest.mark.parametrize("grace_s", [5.0, 0.1])
async def test_close_waits_for_the_handler_in_flight_up_to_the_grace(
    serve: Serve, grace_s: float
) -> None:
    entered, cancelled = asyncio.Event(), asyncio.Event()

    async def slow(request: Request, writer: StreamWriter) -> Response:
        entered.set()
        try:
            await asyncio.sleep(0.3)
            return Response(200, b"done", content_type="text/plain")
        except asyncio.CancelledError:
            cancelled.set()
            raise

    server, busy = await serve(slow)
    port, idle = server.port, await RawClient.connect(server.port)
    busy.send(GET)
    await entered.wait()
    started = time.perf_counter()
    await server.close(grace_s=grace_s)
    assert time.perf_counter() - started == pytest.approx(min(grace_s, 0.3), abs=0.15)
    assert await busy.at_eof() and await idle.at_eof()
    if grace_s > 0.3:
        [reply] = busy.replies
        assert (reply.status, reply.body, reply.headers["connection"]) == (200, b"done", "close")
        assert not cancelled.is_set()
    else:
        assert busy.replies == [] and cancelled.is_set()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)
    idle.writer.close()
