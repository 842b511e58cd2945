"""router.http.client's deadlines against raw servers on 127.0.0.1 that keep the client waiting:
no head, a head and no body, a body that stops. A missed deadline is an `UpstreamTimeout`
naming its stage, and the connection is closed (the server sees its end)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from router.http.client import UpstreamPool, UpstreamTimeout
from tests.raw_server import RawServer, chunk

WAIT_S = 5.0  # the longest any test waits for something to happen
STREAM_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip


class Stalling(RawServer):
    """Answers each request with `sent` (bytes, then a pause of `pause_s`, then more bytes...)
    and then says nothing until the client closes the connection."""

    def __init__(self, *sent: bytes | float) -> None:
        super().__init__()
        self.sent = sent
        self.closed = asyncio.Event()  # a client closed its connection
        self.requests = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            self.requests += 1
            for part in self.sent:
                if isinstance(part, float):
                    await asyncio.sleep(part)
                else:
                    writer.write(part)
            while await reader.read(4096):
                pass  # until the client closes
            self.closed.set()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed.set()
        finally:
            writer.close()


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    upstream = UpstreamPool(connect_timeout_s=1.0)
    yield upstream
    await upstream.close()


async def serve(*sent: bytes | float) -> Stalling:
    server = Stalling(*sent)
    await server.start()
    return server


async def test_a_missing_head_times_out_and_closes_the_connection(pool: UpstreamPool) -> None:
    server = await serve()
    try:
        with pytest.raises(UpstreamTimeout) as caught:
            async with asyncio.timeout(WAIT_S):
                await pool.request(server.url, "POST", "/x", {}, b"{}", head_timeout_s=0.1,
                                   first_byte_timeout_s=1.0, gap_timeout_s=1.0)  # fmt: skip
        assert caught.value.stage == "head"
        async with asyncio.timeout(WAIT_S):
            await server.closed.wait()
    finally:
        await server.stop()


async def test_a_head_without_a_body_misses_the_first_byte_deadline(pool: UpstreamPool) -> None:
    server = await serve(STREAM_HEAD)
    try:
        async with asyncio.timeout(WAIT_S):
            response = await pool.request(server.url, "POST", "/x", {}, b"{}", head_timeout_s=1.0,
                                          first_byte_timeout_s=0.2)  # fmt: skip
            assert response.status == 200
            with pytest.raises(UpstreamTimeout) as caught:
                await response.read()
        assert caught.value.stage == "first_byte"
        async with asyncio.timeout(WAIT_S):
            await server.closed.wait()
    finally:
        await server.stop()


async def test_a_whole_answer_is_bounded_by_its_first_byte_deadline(pool: UpstreamPool) -> None:
    """A head-less wait is the first byte's when that comes sooner (a non-streamed answer)."""
    server = await serve()
    try:
        with pytest.raises(UpstreamTimeout) as caught:
            async with asyncio.timeout(WAIT_S):
                await pool.request(server.url, "POST", "/x", {}, b"{}", head_timeout_s=0.2,
                                   first_byte_timeout_s=0.2)  # fmt: skip
        assert caught.value.stage == "first_byte"
    finally:
        await server.stop()


async def test_a_stream_that_goes_quiet_misses_the_gap_deadline(pool: UpstreamPool) -> None:
    server = await serve(STREAM_HEAD + chunk(b"data: 1\n\n"))
    try:
        async with asyncio.timeout(WAIT_S):
            response = await pool.request(server.url, "POST", "/x", {}, b"{}", head_timeout_s=1.0,
                                          first_byte_timeout_s=1.0, gap_timeout_s=0.2)  # fmt: skip
            chunks = response.iter_chunks()
            assert await chunks.__anext__() == b"data: 1\n\n"
            with pytest.raises(UpstreamTimeout) as caught:
                await chunks.__anext__()
        assert caught.value.stage == "gap"
        assert "0.2 s" in str(caught.value)
        async with asyncio.timeout(WAIT_S):
            await server.closed.wait()
    finally:
        await server.stop()


async def test_the_gap_counts_only_while_the_reader_waits(pool: UpstreamPool) -> None:
    """A reader busy elsewhere (a slow client) is not kept waiting by the worker: the worker's
    long pause falls mostly within the reader's own, and the wait left is within the gap."""
    end = chunk(b"data: 2\n\n") + b"0\r\n\r\n"
    server = await serve(STREAM_HEAD + chunk(b"data: 1\n\n"), 1.5, end)
    try:
        async with asyncio.timeout(WAIT_S):
            response = await pool.request(server.url, "POST", "/x", {}, b"{}", head_timeout_s=1.0,
                                          first_byte_timeout_s=1.0, gap_timeout_s=1.0)  # fmt: skip
            chunks = response.iter_chunks()
            assert await chunks.__anext__() == b"data: 1\n\n"
            await asyncio.sleep(1.2)  # busy: the worker's silence goes on past the gap
            assert [data async for data in chunks] == [b"data: 2\n\n"]
    finally:
        await server.stop()


async def test_an_answer_in_time_keeps_its_connection_and_no_timer(pool: UpstreamPool) -> None:
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    server = await serve(ok)
    try:
        async with asyncio.timeout(WAIT_S):
            response = await pool.request(server.url, "POST", "/x", {}, b"{}", head_timeout_s=0.5,
                                          first_byte_timeout_s=0.5, gap_timeout_s=0.5)  # fmt: skip
            assert await response.read() == b"ok"
        (conn,) = pool.connections
        assert conn.timer is None and not conn.closed  # back in the pool, nothing armed
    finally:
        await server.stop()
