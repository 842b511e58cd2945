"""router.http.server against slow, greedy and half-closing clients, over raw sockets: a request
has one deadline from its first byte, connections are limited, keep-alive is bounded, and a
half-closed client still gets its answer. Outcomes are asserted (status, closed), never times."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from router.config import add_serve_options, load_config
from router.http import Handler, HttpServer, Request, Response, StreamWriter
from tests.router.http.test_server import GET, RawClient, Reply

DEADLINE_S = 0.3  # the configured read deadline: far below how long the clients trickle


async def ok(request: Request, writer: StreamWriter) -> Response:
    return Response(200, b"%s %d" % (request.path.encode(), len(request.body)))


Start = Callable[..., Awaitable[HttpServer]]


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    servers: list[HttpServer] = []

    async def start_server(handler: Handler = ok, **options: Any) -> HttpServer:
        server = HttpServer(handler, **{"read_timeout_s": DEADLINE_S, **options})
        await server.start("127.0.0.1", 0)
        servers.append(server)
        return server

    yield start_server
    for server in servers:
        await server.close(grace_s=1.0)


async def trickle(client: RawClient, data: bytes, pause_s: float = 0.02) -> None:
    """Send `data` a byte at a time, then keep sending blanks, until the server stops reading
    (cancelled by the test once it has its answer; 10 s at most)."""
    with contextlib.suppress(ConnectionError):
        async with asyncio.timeout(10):
            for byte in data:
                client.send(bytes([byte]))
                await client.writer.drain()
                await asyncio.sleep(pause_s)
            while True:
                client.send(b"a")
                await client.writer.drain()
                await asyncio.sleep(pause_s)


def assert_openai_error(reply: Reply, status: int, kind: str) -> None:
    assert (reply.status, reply.headers["connection"]) == (status, "close")
    error = json.loads(reply.body)["error"]
    assert (error["type"], error["param"], error["code"]) == (kind, None, status)
    assert isinstance(error["message"], str) and error["message"]


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /slowloris HTTP/1.1\r\nHost: x\r\nX-Pad: ",  # a head that never ends
        b"POST /slow-body HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n",  # a body
    ],
    ids=["head", "body"],
)
async def test_trickling_clients_get_408_and_are_closed(start: Start, request_bytes: bytes) -> None:
    # every byte arrives well within the 75 s idle time, the whole request never does
    server = await start(keepalive_timeout_s=75.0)
    clients = [await RawClient.connect(server.port) for _ in range(5)]
    senders = [asyncio.create_task(trickle(client, request_bytes)) for client in clients]
    try:
        for client in clients:
            [reply] = await client.replies_done(1, within_s=8)
            assert_openai_error(reply, 408, "invalid_request_error")
            assert await client.at_eof(within_s=5)
            assert len(client.replies) == 1
    finally:
        for sender in senders:
            sender.cancel()
        await asyncio.gather(*senders, return_exceptions=True)
        for client in clients:
            client.writer.close()


async def test_the_deadline_is_per_request_not_per_connection(start: Start) -> None:
    server = await start(keepalive_timeout_s=30.0)
    client = await RawClient.connect(server.port)
    for index in range(4):  # the connection outlives several deadlines; no request takes one
        client.send(b"POST /%d HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi" % index)
        reply = (await client.replies_done(index + 1))[index]
        assert (reply.status, reply.body) == (200, b"/%d 2" % index)
        await asyncio.sleep(DEADLINE_S / 2)
    client.writer.close()


async def test_a_pipelined_request_the_server_does_not_read_yet_is_not_timed_out(
    start: Start,
) -> None:
    gate = asyncio.Event()

    async def gated(request: Request, writer: StreamWriter) -> Response:
        if request.path == "/first":
            await gate.wait()
        return await ok(request, writer)

    server = await start(gated)
    client = await RawClient.connect(server.port)
    # the second request's head is in, its body waits: the server is busy with the first
    client.send(GET.replace(b"/", b"/first", 1))
    client.send(b"POST /second HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n")
    await asyncio.sleep(3 * DEADLINE_S)  # the server held it, not the client: no 408
    gate.set()
    assert (await client.replies_done(1))[0].status == 200
    client.send(b"hi")
    _, second = await client.replies_done(2)
    assert (second.status, second.body) == (200, b"/second 2")
    client.writer.close()


async def test_connections_over_the_limit_get_503_and_are_closed(start: Start) -> None:
    server = await start(max_connections=2)
    held = [await RawClient.connect(server.port) for _ in range(2)]
    for client in held:  # both accepted and served
        client.send(GET)
        assert (await client.replies_done(1))[0].status == 200
    over = await RawClient.connect(server.port)
    over.send(GET)
    [reply] = await over.replies_done(1)
    assert_openai_error(reply, 503, "service_unavailable")
    assert reply.headers["retry-after"] == "1"
    assert await over.at_eof(within_s=5)
    over.writer.close()
    for client in held:  # the ones within the limit are untouched
        client.send(GET)
        assert (await client.replies_done(2))[1].status == 200

    held[0].writer.close()  # a slot frees once the server has seen the close
    async with asyncio.timeout(5):
        while True:
            late = await RawClient.connect(server.port)
            late.send(GET)
            [reply] = await late.replies_done(1)
            late.writer.close()
            if reply.status == 200:
                break
            await asyncio.sleep(0.02)
    held[1].writer.close()


@pytest.mark.parametrize("pipelined", [False, True], ids=["one-by-one", "pipelined"])
async def test_a_connection_closes_after_its_request_limit(start: Start, pipelined: bool) -> None:
    server = await start(max_requests_per_connection=3)
    client = await RawClient.connect(server.port)
    if pipelined:
        client.send(b"".join(GET.replace(b"/", b"/%d" % i, 1) for i in range(5)))
    else:
        for index in range(3):
            client.send(GET.replace(b"/", b"/%d" % index, 1))
            await client.replies_done(index + 1)
    replies = await client.replies_done(3)
    assert await client.at_eof()
    assert [reply.body for reply in replies] == [b"/0 0", b"/1 0", b"/2 0"]  # and no more
    assert [reply.headers.get("connection") for reply in replies] == [None, None, "close"]
    client.writer.close()


async def test_an_idle_connection_closes_after_the_keepalive_timeout(start: Start) -> None:
    server = await start(keepalive_timeout_s=0.2)
    client = await RawClient.connect(server.port)
    client.send(GET)
    assert (await client.replies_done(1))[0].status == 200
    assert await client.at_eof(within_s=5)
    client.writer.close()


async def slow_answer(request: Request, writer: StreamWriter) -> Response | None:
    await asyncio.sleep(0.1)  # the client's FIN arrives while the answer is being prepared
    if request.path == "/stream":
        await writer.start(200, {"Content-Type": "text/event-stream"})
        await writer.write(b"data: 1\n\n")
        await writer.end(b"data: [DONE]\n\n")
        return None
    return await ok(request, writer)


@pytest.mark.parametrize(
    ("request_bytes", "bodies"),
    [
        (b"POST /post HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", [b"/post 2"]),
        (b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n", [b"data: 1\n\ndata: [DONE]\n\n"]),
        (b"POST /a HTTP/1.1\r\nContent-Length: 1\r\n\r\nx" + GET.replace(b"/", b"/b", 1),
         [b"/a 1", b"/b 0"]),
        (b"POST /old HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}", [b"/old 2"]),
    ],
    ids=["post", "stream", "pipelined", "http-1.0"],
)  # fmt: skip
async def test_a_half_closed_client_still_gets_its_answers(
    start: Start, request_bytes: bytes, bodies: list[bytes]
) -> None:
    server = await start(slow_answer)
    client = await RawClient.connect(server.port)
    client.send(request_bytes)
    client.writer.write_eof()  # shutdown(SHUT_WR): nothing more to send, still reading
    assert await client.at_eof(within_s=5)
    final = [reply for reply in client.replies if reply.status >= 200]
    assert [(reply.status, reply.body, reply.complete) for reply in final] == [
        (200, body, True) for body in bodies
    ]
    client.writer.close()


async def test_a_half_close_with_nothing_to_answer_closes(start: Start) -> None:
    server = await start()
    client = await RawClient.connect(server.port)
    client.send(GET)
    assert (await client.replies_done(1))[0].status == 200
    client.writer.write_eof()
    assert await client.at_eof()
    assert len(client.replies) == 1
    client.writer.close()


async def test_a_client_that_closes_before_its_answer_still_cancels_the_handler(
    start: Start,
) -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def forever(request: Request, writer: StreamWriter) -> Response:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        raise AssertionError("never answered")

    server = await start(forever)
    client = await RawClient.connect(server.port)
    client.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    await asyncio.wait_for(started.wait(), timeout=5)
    client.writer.close()  # a FIN, as for a half-close: the server must tell the two apart
    await asyncio.wait_for(cancelled.wait(), timeout=5)
    for _ in range(500):  # and the connection is gone (5 s at most)
        if not server.connections:
            break
        await asyncio.sleep(0.01)
    assert not server.connections


def test_the_limits_are_configurable() -> None:
    parser = argparse.ArgumentParser()
    add_serve_options(parser)
    args = parser.parse_args(
        ["--mixed", "http://w:8000", "--client-read-timeout-s", "12.5", "--max-connections", "9"]
    )
    environ = {"SESSION_ROUTER_KEEPALIVE_TIMEOUT_S": "5", "SESSION_ROUTER_KEEPALIVE_REQUESTS": "7"}
    config = load_config(args, environ)
    assert (config.client_read_timeout_s, config.max_connections) == (12.5, 9)
    assert (config.keepalive_timeout_s, config.keepalive_requests) == (5.0, 7)
    defaults = load_config(parser.parse_args(["--mixed", "http://w:8000"]), {})
    assert (defaults.client_read_timeout_s, defaults.max_connections) == (30.0, 4096)
    assert (defaults.keepalive_timeout_s, defaults.keepalive_requests) == (75.0, 10_000)
    with pytest.raises(ValueError, match="max_connections"):
        HttpServer(ok, max_connections=0)
