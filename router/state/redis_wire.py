"""A lean Redis connection for the shared state's two hot paths: the batch writer's pipeline and
the invalidation subscription.

redis-py spends ~150-180 us of CPU on one pipeline round trip on our 2-core test machines (its
connection pool, retry wrapper, command stack and push-message handling) and tens of us on each
pub/sub message; the writer pays the first every `batch_interval_s`, and every replica the
second for every batch any replica writes. This connection speaks RESP2 over one
asyncio.Protocol and lets hiredis parse the replies. It serves `redis://` and `unix://` URLs
(username, password and db as redis-py reads them); TLS and Sentinel URLs stay on redis-py
(`lean_target` answers None for them).

Errors are redis-py's, so callers handle both paths alike: a refused, lost or silent
connection raises its ConnectionError or TimeoutError, and error replies come back in place
as the exception instances its parser makes of them (ResponseError, NoScriptError,
ReadOnlyError, ...), as its pipelines return them. Commands are packed by hiredis.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

import hiredis
import msgspec
from redis._parsers.base import BaseParser
from redis.asyncio.connection import parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from router.http.headers import set_nodelay

Arg = bytes | str | int | float
Command = tuple[Arg, ...]


def _pack(command: Command) -> bytes:
    return hiredis.pack_command(command)  # type: ignore[arg-type,no-any-return]  # stub: a 1-tuple


class LeanTarget(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a lean connection goes: a TCP address or a unix socket path, and how to log in."""

    host: str = ""
    port: int = 6379
    path: str = ""
    username: str | None = None
    password: str | None = None
    db: int = 0


def lean_target(url: str) -> LeanTarget | None:
    """The target of a plain `redis://` or `unix://` URL; None for any other scheme or for
    options only redis-py's connections implement."""
    scheme = url.split("://", 1)[0].lower()
    if scheme not in ("redis", "unix"):
        return None
    options = parse_url(url)
    options.pop("connection_class", None)
    known = {"host", "port", "path", "username", "password", "db"}
    if set(options) - known:
        return None
    return msgspec.convert(options, LeanTarget)


class RespConnection(asyncio.Protocol):
    """One connection carrying pipelined commands, or, once `subscribe`d, pushed messages."""

    def __init__(self) -> None:
        # error replies become redis-py's own classes (NoScriptError, ReadOnlyError, ...)
        self._reader = hiredis.Reader(replyError=BaseParser.parse_error)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        # each pending pipeline: how many replies it waits for, what came so far, its future
        self._pending: deque[tuple[int, list[Any], asyncio.Future[list[Any]]]] = deque()
        self._on_message: Callable[[bytes], None] | None = None
        self._on_lost: Callable[[BaseException], None] | None = None
        self._subscribed: asyncio.Future[None] | None = None

    @classmethod
    async def open(cls, target: LeanTarget, timeout_s: float) -> RespConnection:
        """Connect, log in and select the db, all within `timeout_s`."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                if target.path:
                    _, conn = await loop.create_unix_connection(cls, target.path)
                else:
                    _, conn = await loop.create_connection(cls, target.host, target.port)
                hello: list[Command] = []
                if target.password is not None:
                    login = [target.username] if target.username else []
                    hello.append(("AUTH", *login, target.password))
                if target.db:
                    hello.append(("SELECT", target.db))
                if hello:
                    for reply in await conn.execute(hello, timeout_s):
                        if isinstance(reply, Exception):
                            conn.close()
                            raise RedisConnectionError(f"Redis refused the login: {reply}")
        except TimeoutError as exc:
            raise RedisTimeoutError(f"connecting to Redis timed out after {timeout_s} s") from exc
        except OSError as exc:
            raise RedisConnectionError(f"cannot connect to Redis: {exc}") from exc
        return conn

    async def execute(self, commands: Sequence[Command], timeout_s: float) -> list[Any]:
        """Send `commands` in one write; their replies in order, error replies in place. A
        connection that fails or stays silent past `timeout_s` is closed (replies on it could
        no longer be matched to their commands) and the error raised."""
        if self.closed or self.transport is None:
            raise RedisConnectionError("the Redis connection is closed")
        if self._on_message is not None:
            raise RuntimeError("a subscribed connection carries no commands")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Any]] = loop.create_future()
        self._pending.append((len(commands), [], future))
        self.transport.write(b"".join([_pack(c) for c in commands]))
        timer = loop.call_later(timeout_s, self._time_out, future, timeout_s)
        try:
            return await future
        finally:
            timer.cancel()

    async def subscribe(
        self,
        channel: str,
        on_message: Callable[[bytes], None],
        on_lost: Callable[[BaseException], None],
        timeout_s: float,
    ) -> None:
        """Subscribe to `channel` (confirmed by the server within `timeout_s`); from then on
        every message's payload goes to `on_message`, and a lost connection to `on_lost`."""
        if self.transport is None or self.closed:
            raise RedisConnectionError("the Redis connection is closed")
        loop = asyncio.get_running_loop()
        self._subscribed = loop.create_future()
        self._on_message, self._on_lost = on_message, on_lost
        self.transport.write(_pack(("SUBSCRIBE", channel)))
        try:
            async with asyncio.timeout(timeout_s):
                await self._subscribed
        except TimeoutError as exc:
            self.close()
            raise RedisTimeoutError("no SUBSCRIBE confirmation from Redis") from exc

    def close(self) -> None:
        self._on_lost = None  # closed on purpose: nothing was lost
        if self.transport is not None and not self.closed:
            self.transport.abort()
        self._fail(RedisConnectionError("the Redis connection was closed"))

    # -- transport callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        set_nodelay(transport)

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        try:
            while (reply := reader.gets()) is not False:
                self._deliver(reply)
        except hiredis.ProtocolError as exc:
            self._lose(RedisConnectionError(f"malformed reply from Redis: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._lose(RedisConnectionError(f"Redis closed the connection ({exc or 'EOF'})"))

    # -- internals
    def _deliver(self, reply: Any) -> None:
        if self._on_message is not None:
            if isinstance(reply, list) and len(reply) == 3:
                if reply[0] == b"message":
                    self._on_message(reply[2])
                elif reply[0] == b"subscribe" and self._subscribed is not None:
                    if not self._subscribed.done():
                        self._subscribed.set_result(None)
            return
        if not self._pending:
            self._lose(RedisConnectionError("Redis sent a reply nobody asked for"))
            return
        wanted, replies, future = self._pending[0]
        replies.append(reply)
        if len(replies) == wanted:
            self._pending.popleft()
            if not future.done():
                future.set_result(replies)

    def _time_out(self, future: asyncio.Future[list[Any]], timeout_s: float) -> None:
        if not future.done():
            self._lose(RedisTimeoutError(f"Redis did not answer within {timeout_s} s"))

    def _lose(self, error: BaseException) -> None:
        on_lost, self._on_lost = self._on_lost, None
        if self.transport is not None and not self.closed:
            self.transport.abort()
        self._fail(error)
        if on_lost is not None:
            on_lost(error)

    def _fail(self, error: BaseException) -> None:
        self.closed = True
        pending, self._pending = self._pending, deque()
        for _, _, future in pending:
            if not future.done():
                future.set_exception(error)
        if self._subscribed is not None and not self._subscribed.done():
            self._subscribed.set_exception(error)
