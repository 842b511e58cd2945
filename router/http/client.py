"""Upstream HTTP/1.1 client for the router's data path: a keep-alive pool over httptools.

Each `_Upstream` protocol is one TCP connection carrying one exchange at a time: it parses the
response with httptools and buffers body bytes for the `UpstreamResponse` reading them. Past
`_HIGH_WATER` buffered bytes it stops reading the socket, so a slow consumer slows the worker's
socket instead of growing memory. A connection goes back to the pool only once its response
body was read to the end; a response abandoned, failed or cancelled earlier closes it.

A request may carry deadlines (head, first body byte, the gap between body reads): one timer
per exchange watches them, re-armed only when it fires, and a missed one fails the exchange
with `UpstreamTimeout` and closes the connection (the worker's request is cancelled with it).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import cast
from urllib.parse import urlsplit

import httptools

from router.http.headers import Headers, is_bodiless, request_head, set_nodelay

_HIGH_WATER = 64 * 1024  # buffered body bytes per response before the socket is paused
_NEVER = float("inf")


class UpstreamError(Exception):
    """The upstream request failed."""


class UpstreamConnectError(UpstreamError):
    """Refused, timed out, reset or closed before any response byte: safe to retry elsewhere."""


class UpstreamBodyError(UpstreamError):
    """The connection failed after the response started."""


class UpstreamTimeout(UpstreamError):
    """The worker kept the caller waiting past a deadline; the connection was closed, which
    cancels the worker's request. `stage`: "head" (status line and headers), "first_byte" (the
    body's first bytes) or "gap" (the body's next bytes, while the caller waited for them)."""

    def __init__(self, message: str, stage: str) -> None:
        super().__init__(message)
        self.stage = stage


class _StaleConnection(Exception):
    """A reused keep-alive connection closed before any response byte."""


class _Upstream(asyncio.Protocol):
    """One connection to a worker and the state of the exchange it is carrying."""

    def __init__(self, pool: UpstreamPool, key: tuple[str, int, bool]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set at once
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.reusable = True
        self.reused = False
        self.idle_since = 0.0
        self._reading_paused = False
        self.busy = False  # an exchange is in progress; the fields below describe it
        self.head: asyncio.Future[None] | None = None
        self.head_only = self.got_bytes = self.informational = self.close_delimited = False
        self.complete = self.keep_alive = False
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.headers = Headers()
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.error: UpstreamError | None = None
        self.waiter: asyncio.Future[None] | None = None
        # the exchange's deadlines (loop time; `_NEVER`: none), watched by one timer at a time
        self.head_s = self.first_byte_s = self.gap_s = self.tick_s = _NEVER
        self.head_by = self.first_byte_by = _NEVER
        self.got_body = False
        self.wait_since = -1.0  # when the reader began waiting for body bytes; -1: not waiting
        self.timer: asyncio.TimerHandle | None = None

    async def exchange(
        self, payload: bytes, body: bytes, head_only: bool, head_s: float | None = None,
        first_byte_s: float | None = None, gap_s: float | None = None,
    ) -> UpstreamResponse:  # fmt: skip
        """Send a request and wait for its status line and headers (see `UpstreamPool.request`
        for the deadlines)."""
        self.busy = True
        head = self.head = self.pool.loop.create_future()
        self.head_only = head_only
        self.got_bytes = self.informational = self.close_delimited = False
        self.complete = self.keep_alive = self.got_body = False
        self.error = None
        self.chunks = []
        self.buffered = 0
        self.unwatch()
        if head_s is not None or first_byte_s is not None or gap_s is not None:
            self.watch(head_s, first_byte_s, gap_s)
        if body:
            self.transport.writelines((payload, body))  # one send; uvloop copies nothing
        else:
            self.transport.write(payload)
        try:
            await head
        except BaseException:
            self.abort()  # failed, or the caller was cancelled: nobody will read this connection
            raise
        return UpstreamResponse(self)

    def take(self) -> bytes:
        """All buffered body bytes; reading resumes as the buffer is empty again."""
        chunks, self.chunks, self.buffered = self.chunks, [], 0
        if self._reading_paused and not self.closed:
            self._reading_paused = False
            self.transport.resume_reading()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def fail(self, error: Exception) -> None:
        if self.head is not None and not self.head.done():
            self.head.set_exception(error)
        elif isinstance(error, UpstreamError) and self.error is None:
            self.error = error
            self.wake()

    def abort(self) -> None:
        self.reusable = False
        if not self.closed:
            self.transport.abort()

    # -- deadlines: one timer per exchange, re-armed only when it fires
    def watch(self, head_s: float | None, first_byte_s: float | None, gap_s: float | None) -> None:
        now = self.pool.loop.time()
        self.head_s = _NEVER if head_s is None else head_s
        self.first_byte_s = _NEVER if first_byte_s is None else first_byte_s
        self.gap_s = _NEVER if gap_s is None else gap_s
        self.head_by = now + self.head_s
        self.first_byte_by = now + self.first_byte_s
        self.tick_s = min(self.head_s, self.first_byte_s, self.gap_s)
        self.wait_since = -1.0
        if self.tick_s < _NEVER:
            at = min(self.head_by, self.first_byte_by, now + self.tick_s)
            self.timer = self.pool.loop.call_at(at, self._check)

    def unwatch(self) -> None:
        timer, self.timer = self.timer, None
        if timer is not None:
            timer.cancel()
        self.head_s = self.first_byte_s = self.gap_s = self.tick_s = _NEVER

    def _check(self) -> None:
        """The timer: time the exchange out if its current stage is overdue, else re-arm."""
        self.timer = None
        if not self.busy or self.complete or self.closed:
            return
        loop = self.pool.loop
        now = loop.time()
        if self.head is not None and not self.head.done() and self.head_by < self.first_byte_by:
            due, stage, limit = self.head_by, "head", self.head_s
        elif not self.got_body:
            due, stage, limit = self.first_byte_by, "first_byte", self.first_byte_s
        elif self.wait_since >= 0.0:  # the gap counts only while the reader waits on the worker
            due, stage, limit = self.wait_since + self.gap_s, "gap", self.gap_s
        else:  # the reader is busy (a slow client, say): not the worker's delay
            due, stage, limit = _NEVER, "gap", self.gap_s
        if now >= due:
            what = {"head": "response head", "first_byte": "first body byte"}.get(stage, "bytes")
            error = UpstreamTimeout(f"upstream sent no {what} within {limit:g} s", stage)
            self.fail(error)
            self.abort()  # the worker sees its request cancelled
            return
        if due == _NEVER:  # nothing due in this stage: look again a deadline's length later
            due = now + (self.gap_s if stage == "gap" and self.gap_s < _NEVER else self.tick_s)
        self.timer = loop.call_at(due, self._check)

    # -- transport callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass of it
        set_nodelay(transport)
        self.pool.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if not self.busy or self.complete:
            self.abort()  # bytes nobody asked for: the connection cannot be trusted any more
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.reusable = False  # a protocol switch: what follows is not HTTP/1.1
        except httptools.HttpParserError as exc:
            if not self.complete:  # else: junk after a complete response, which stands
                self.fail(UpstreamBodyError(f"malformed response from upstream: {exc}"))
            self.abort()
            return
        if self.buffered > _HIGH_WATER and not self._reading_paused and not self.closed:
            self._reading_paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool | None:
        return None  # close; connection_lost settles the exchange

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if self.timer is not None:
            self.unwatch()
        if not self.busy or self.complete:
            return
        if self.close_delimited and exc is None and self.status:
            self.complete = True  # EOF is how this body ends
            self.wake()
        elif not self.got_bytes:
            reason = f"upstream closed the connection before responding ({exc or 'EOF'})"
            self.fail(_StaleConnection(reason) if self.reused else UpstreamConnectError(reason))
        else:
            how = "closed by the worker" if exc is None else str(exc)
            self.fail(UpstreamBodyError(f"upstream connection lost mid-response ({how})"))

    # -- parser callbacks
    def on_message_begin(self) -> None:
        if self.complete:
            raise UpstreamBodyError("upstream sent a second response")
        self.raw_headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self.informational = True  # e.g. 100 Continue; the real response follows
            return
        self.status = status
        headers = self.headers = Headers.from_raw(self.raw_headers)
        if self.head_only:
            self.complete = True  # the parser would wait for the body HEAD never gets
            self.reusable = False
        elif (
            "content-length" not in headers
            and "chunked" not in headers.get("transfer-encoding", "").lower()
            and not is_bodiless(status)
        ):
            self.close_delimited = True
        if self.head is not None and not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.got_body = True
        self.chunks.append(body)
        self.buffered += len(body)
        if self.waiter is not None:
            self.wake()

    def on_message_complete(self) -> None:
        if self.informational:
            self.informational = False
            return
        self.keep_alive = self.parser.should_keep_alive()
        self.complete = True
        if self.timer is not None:
            self.unwatch()
        self.wake()


class UpstreamResponse:
    """Status and headers of an upstream response; the body is read with read() or
    iter_chunks(). Dropped before its body was read to the end, it closes the connection."""

    __slots__ = ("_conn", "_finished", "headers", "status")

    def __init__(self, conn: _Upstream) -> None:
        self._conn = conn
        self._finished = False
        self.status = conn.status
        self.headers = conn.headers

    async def read(self) -> bytes:
        """The whole body, de-chunked."""
        conn = self._conn
        if conn.complete and conn.error is None and not self._finished:
            # the usual small answer arrived with its head: no step through the iterator
            data = conn.take()
            self._release()
            return data
        parts = [chunk async for chunk in self]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def iter_chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (all that is buffered, per step) until the body ends."""
        return self

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    def close(self) -> None:
        """Abandon the response: unless its body was read to the end, close the connection."""
        if not self._finished:
            self._finished = True
            self._conn.abort()

    def __del__(self) -> None:
        if not self._finished:
            self._finished = True
            try:
                self._conn.abort()
            except RuntimeError:
                pass  # the event loop is already closed, and the socket with it

    async def __anext__(self) -> bytes:
        """The bytes buffered now (waiting for some); one coroutine per step of a stream."""
        conn = self._conn
        while not self._finished:
            if conn.chunks:
                data = conn.take()
                if conn.complete:
                    self._release()
                return data
            if conn.error is not None:
                self.close()
                raise conn.error
            if conn.complete:
                self._release()
                break
            loop = conn.pool.loop
            waiter = conn.waiter = loop.create_future()
            if conn.timer is not None:
                conn.wait_since = loop.time()  # the gap deadline runs while this waits
            try:
                await waiter
            except asyncio.CancelledError:
                self.close()
                raise
            finally:
                conn.wait_since = -1.0
        raise StopAsyncIteration

    def _release(self) -> None:
        self._finished = True
        conn = self._conn
        if conn.keep_alive and conn.reusable and not conn.closed:
            conn.busy = False
            conn.pool.release(conn)
        else:
            conn.abort()


class UpstreamPool:
    """Keep-alive connections per (host, port, TLS), reused last-in first-out. An https://
    URL connects with TLS by `ssl_context` (default: the system's CAs, names checked)."""

    def __init__(
        self,
        *,
        connect_timeout_s: float = 2.0,
        max_idle_per_host: int = 256,
        idle_timeout_s: float = 60.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.ssl_context = ssl_context
        self.max_idle_per_host = max_idle_per_host
        self.idle_timeout_s = idle_timeout_s
        self.connections: set[_Upstream] = set()
        self._idle: dict[tuple[str, int, bool], deque[_Upstream]] = {}  # oldest first
        self._targets: dict[str, tuple[str, int, str, bool]] = {}
        self._sweep_timer: asyncio.TimerHandle | None = None
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        self._loop = self._loop or asyncio.get_running_loop()
        return self._loop

    async def request(
        self, base_url: str, method: str, path: str, headers: Mapping[str, str],
        body: bytes = b"", *, head_timeout_s: float | None = None,
        first_byte_timeout_s: float | None = None, gap_timeout_s: float | None = None,
    ) -> UpstreamResponse:  # fmt: skip
        """Send one request and wait for its status line and headers. Connecting is bounded by
        `connect_timeout_s`; from the send on, the response head must come within
        `head_timeout_s`, the body's first bytes within `first_byte_timeout_s`, and once the
        body began, a read waits at most `gap_timeout_s` for more (None: no such deadline).
        A missed deadline fails the exchange with `UpstreamTimeout` and closes the connection,
        as does cancelling. A reused connection found closed before any response byte is
        retried once on a fresh one."""
        if self._closed:
            raise RuntimeError("UpstreamPool is closed")
        host, port, host_header, tls = self._target(base_url)
        payload = request_head(method, path, host_header, headers, len(body))
        head_only = method == "HEAD"
        conn = self._acquire((host, port, tls))
        if conn is not None:
            try:
                return await conn.exchange(payload, body, head_only, head_timeout_s,
                                           first_byte_timeout_s, gap_timeout_s)  # fmt: skip
            except _StaleConnection:
                pass  # a stale keep-alive connection is no worker failure: once more, fresh
        conn = await self._connect(host, port, tls)
        return await conn.exchange(payload, body, head_only, head_timeout_s, first_byte_timeout_s,
                                   gap_timeout_s)  # fmt: skip

    async def close(self) -> None:
        """Close every connection, idle or in use."""
        self._closed = True
        if self._sweep_timer is not None:
            self._sweep_timer.cancel()
            self._sweep_timer = None
        for conn in list(self.connections):
            conn.abort()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports run connection_lost

    def _target(self, base_url: str) -> tuple[str, int, str, bool]:
        target = self._targets.get(base_url)
        if target is None:
            parts = urlsplit(base_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(
                    f"unsupported upstream URL {base_url!r} (want http(s)://host:port)"
                )
            tls = parts.scheme == "https"
            port = parts.port or (443 if tls else 80)
            name = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
            target = (parts.hostname, port, f"{name}:{port}", tls)
            self._targets[base_url] = target
        return target

    async def _connect(self, host: str, port: int, tls: bool) -> _Upstream:
        context: ssl.SSLContext | None = None
        if tls:
            if self.ssl_context is None:
                self.ssl_context = ssl.create_default_context()
            context = self.ssl_context
        key = (host, port, tls)
        try:
            async with asyncio.timeout(self.connect_timeout_s):  # the TLS handshake included
                _, conn = await self.loop.create_connection(
                    lambda: _Upstream(self, key),
                    host,
                    port,
                    ssl=context,
                    server_hostname=host if tls else None,
                )
        except TimeoutError as exc:
            raise UpstreamConnectError(f"connect to {host}:{port} timed out") from exc
        except OSError as exc:  # ssl.SSLError (a refused certificate) is an OSError
            raise UpstreamConnectError(f"connect to {host}:{port} failed: {exc}") from exc
        return conn

    def _acquire(self, key: tuple[str, int, bool]) -> _Upstream | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        expired = self.loop.time() - self.idle_timeout_s
        while idle:
            conn = idle.pop()
            if conn.closed or conn.transport.is_closing():
                continue
            if conn.idle_since < expired:
                conn.abort()
                continue
            conn.reused = True
            return conn
        return None

    def release(self, conn: _Upstream) -> None:
        if self._closed or self.max_idle_per_host < 1:
            conn.abort()
            return
        idle = self._idle.get(conn.key)
        if idle is None:
            idle = self._idle[conn.key] = deque()
        if len(idle) >= self.max_idle_per_host:
            idle.popleft().abort()
        conn.idle_since = self.loop.time()
        idle.append(conn)
        if self._sweep_timer is None:
            self._sweep_timer = self.loop.call_later(self.idle_timeout_s / 2, self._sweep)

    def forget(self, conn: _Upstream) -> None:
        self.connections.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def _sweep(self) -> None:
        self._sweep_timer = None
        expired = self.loop.time() - self.idle_timeout_s
        remaining = 0
        for idle in self._idle.values():
            while idle and idle[0].idle_since < expired:
                idle.popleft().abort()
            remaining += len(idle)
        if remaining:
            self._sweep_timer = self.loop.call_later(self.idle_timeout_s / 2, self._sweep)
