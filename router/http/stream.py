"""One streamed response on a client connection: HTTP chunks, its head held for the first."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from router.http import headers as wire
from router.http.messages import Request

if TYPE_CHECKING:
    from router.http.server import _Connection

_log = logging.getLogger("router.http.server")  # one logger for the server side
CHUNKED = b"Transfer-Encoding: chunked\r\n"
CLOSE = b"Connection: close\r\n"


class StreamWriter:
    """Streams one response as HTTP chunks (close-delimited for HTTP/1.0 clients).

    The status line and headers wait for the first chunk, up to the server's `head_hold_s`, so
    that a stream whose first token is ready at once costs the client one wake-up (and the
    router one send) instead of two; a stream whose first token is late shows its head early.
    """

    __slots__ = ("_after_sent", "_conn", "_head_only", "_held", "_hold_timer", "chunked", "ended",
                 "keep_alive", "started")  # fmt: skip

    def __init__(self, conn: _Connection, request: Request) -> None:
        self._conn = conn
        self._head_only = request.method == "HEAD"
        self.chunked = request.http_version != "1.0"
        self.keep_alive = request.keep_alive and self.chunked
        self.started = False
        self.ended = False
        self._held = b""
        self._hold_timer: asyncio.TimerHandle | None = None
        self._after_sent: Callable[[], None] | None = None

    def after_sent(self, callback: Callable[[], None]) -> None:
        """Run `callback` once this request's response is out (or can no longer be sent),
        before the connection reads on: work that must not delay the answer, done while the
        client reads it."""
        self._after_sent = callback

    def _run_after_sent(self) -> None:
        callback, self._after_sent = self._after_sent, None
        if callback is not None:
            try:
                callback()
            except Exception:
                _log.exception("after-sent callback failed")

    async def start(self, status: int, headers: Mapping[str, str]) -> None:
        if self.started:
            raise RuntimeError("response already started")
        conn = self._conn
        if conn.closed:
            raise ConnectionResetError("client disconnected")
        self.keep_alive &= not conn.shutting_down and not conn.last_answer
        tail = (CHUNKED if self.chunked else b"") + (b"" if self.keep_alive else CLOSE)
        self._held = wire.response_head(status, headers, None, tail)
        self.started = True
        self._hold_timer = conn._loop.call_later(conn._server.head_hold_s, self._release_head)

    async def write(self, data: bytes) -> None:
        """Send one chunk; waits while the client reads slower than the handler writes."""
        if not self.started or self.ended:
            raise RuntimeError("write() outside start() .. end()")
        conn = self._conn
        if conn.closed:
            raise ConnectionResetError("client disconnected")
        if data and not self._head_only:  # an empty chunk would end the stream
            self._send(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)
        elif self._held:
            self._send(b"")
        if conn.write_paused:
            await conn.drain()

    async def end(self, last: bytes = b"") -> None:
        """End the stream, with `last` as its final chunk (one send for both)."""
        if not self.started:
            raise RuntimeError("end() before start()")
        if self.ended:
            return  # the client has it all, whether or not it is still connected
        self.ended = True
        if not self._conn.closed:
            out = b""
            if last and not self._head_only:
                out = b"%x\r\n%b\r\n" % (len(last), last) if self.chunked else last
            if self.chunked and not self._head_only:
                out += b"0\r\n\r\n"
            self._send(out)
        await self._conn.drain()  # raises ConnectionResetError once the client is gone

    def _send(self, data: bytes) -> None:
        if self._held:
            data, self._held = self._held + data, b""
            if self._hold_timer is not None:
                self._hold_timer.cancel()
                self._hold_timer = None
        if data:
            self._conn.transport.write(data)

    def _release_head(self) -> None:
        self._hold_timer = None
        if self._held and not self._conn.closed:
            self._send(b"")
