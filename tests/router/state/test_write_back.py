"""After an outage each replica writes back what its local view holds, epochs included, by
compare-and-set: a Redis that came back empty gets the sessions again (same turns, epoch and
worker), and a write-back never overwrites a newer commit of another replica."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import redis

from router.state.codec import invalidation_decoder
from router.state.keys import Keys
from router.state.scripts import Scripts
from router.state.shared import SharedState
from tests.router.state.test_degraded import launch_redis, socket_path, stop_redis
from tests.router.state.test_shared import eventually, running

__all__ = ["socket_path"]  # the fixture, used by name

TTL_MS = 3_600_000
_stored = msgspec.msgpack.Decoder(list[tuple[int, str, int, int, int, int, str]])


Stored = tuple[int, str, int, int, int, int, str]


def restore(client: redis.Redis, keys: Keys, rows: list[tuple[object, ...]]) -> list[Stored]:
    scripts = Scripts()
    for source in scripts.sources.values():
        client.script_load(source)
    reply = client.evalsha(
        scripts.session_restore_batch, 0, keys.session_prefix, TTL_MS, keys.channel, "me",
        msgspec.msgpack.encode(rows),
    )  # fmt: skip
    return list(_stored.decode(reply))


def test_a_write_back_sets_only_sessions_redis_lacks_or_holds_older(redis_url: str) -> None:
    keys = Keys(f"wb-{uuid.uuid4().hex[:8]}")
    now = time.time()
    with redis.Redis.from_url(redis_url) as client:
        current = {"newer": (7, "wX"), "equal": (3, "wY"), "older": (1, "wZ")}
        for sid, (epoch, owner) in current.items():
            client.hset(keys.session(sid), mapping={
                "owner": owner, "tokens": 5, "bytes": 50, "turns": epoch, "epoch": epoch,
                "last_seen": repr(now - 1), "write_id": "x",
            })  # fmt: skip
        pubsub = client.pubsub()
        pubsub.subscribe(keys.channel)
        assert pubsub.get_message(timeout=5)["type"] == "subscribe"  # type: ignore[index]
        seen = repr(now)
        rows: list[tuple[object, ...]] = [
            (sid, 3, "mine", 10, 100, 3, seen) for sid in ("newer", "equal", "older", "absent")
        ]
        rows.append(("expired", 3, "mine", 10, 100, 3, repr(now - 2 * TTL_MS / 1000)))
        replies = dict(zip([row[0] for row in rows], restore(client, keys, rows), strict=True))
        assert replies == {
            "newer": (0, "wX", 5, 50, 7, 7, repr(now - 1)),
            "equal": (0, "wY", 5, 50, 3, 3, repr(now - 1)),
            "older": (1, "mine", 10, 100, 3, 3, seen),
            "absent": (1, "mine", 10, 100, 3, 3, seen),
            "expired": (0, "", 0, 0, 0, 0, "0"),
        }
        for sid in ("older", "absent"):
            stored = client.hgetall(keys.session(sid))
            assert (stored[b"owner"], stored[b"epoch"], stored[b"turns"]) == (b"mine", b"3", b"3")
            assert 0 < client.pttl(keys.session(sid)) <= TTL_MS
        assert client.hget(keys.session("newer"), "owner") == b"wX"
        assert client.hget(keys.session("equal"), "owner") == b"wY"
        assert not client.exists(keys.session("expired"))
        # what changed is published like a commit, so other replicas' views follow
        message = pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
        assert message is not None
        published = invalidation_decoder.decode(message["data"])
        assert published.replica == "me"
        assert [(c.session_id, c.epoch, c.owner) for c in published.changes] == [
            ("older", 3, "mine"), ("absent", 3, "mine"),
        ]  # fmt: skip
        pubsub.close()


async def commit_turns(state: SharedState, session_id: str, workers: list[str]) -> int:
    """One committed turn per worker in `workers`; returns the last epoch."""
    epoch = 0
    for turn, worker_id in enumerate(workers, start=1):
        result = await state.commit_session(session_id, worker_id, 10 * turn, 100 * turn, epoch)
        assert result.ok and result.record is not None
        epoch = result.record.epoch
    return epoch


async def test_replicas_write_their_views_back_when_redis_returns_empty(
    socket_path: Path,
) -> None:
    url = f"unix://{socket_path}"
    process = launch_redis(socket_path)
    try:
        async with running(url, "wb", "a") as a, running(url, "wb", "b") as b:
            assert await commit_turns(a, "s1", ["w1", "w1", "w1"]) == 3
            assert await commit_turns(b, "s2", ["w2", "w2"]) == 2
            # each replica's view holds the other's session too (invalidations)
            await eventually(lambda: b.cached_session("s1") == a.cached_session("s1"))
            await eventually(lambda: a.cached_session("s2") == b.cached_session("s2"))
            s2 = b.cached_session("s2")

            stop_redis(process)
            await eventually(lambda: a.degraded and b.degraded)
            pending = a.commit_session("s1", "w3", 40, 400, 3)  # a 4th turn, queued
            process = launch_redis(socket_path)  # empty: no persistence
            await eventually(lambda: not a.degraded and not b.degraded, within=10)

            moved = await asyncio.wait_for(pending, timeout=5)
            assert moved.ok and moved.record is not None
            record = moved.record
            assert (record.worker_id, record.turns, record.epoch) == ("w3", 4, 4)
            with redis.Redis(unix_socket_path=str(socket_path)) as client:
                s1_stored = client.hgetall("wb:session:s1")
                s2_stored = client.hgetall("wb:session:s2")
            assert (s1_stored[b"owner"], s1_stored[b"turns"], s1_stored[b"epoch"]) == (
                b"w3", b"4", b"4",
            )  # fmt: skip
            assert (s2_stored[b"owner"], s2_stored[b"turns"], s2_stored[b"epoch"]) == (
                b"w2", b"2", b"2",
            )  # fmt: skip
            await eventually(lambda: b.cached_session("s1") == record)
            assert a.cached_session("s2") == s2 == b.cached_session("s2")
            # ownership stays exact: compare-and-set goes on from the restored epochs
            assert not (await b.commit_session("s2", "w9", 1, 1, 1)).ok  # a stale epoch
            after = await b.commit_session("s1", "w1", 50, 500, 4)
            assert after.ok and after.record is not None and after.record.epoch == 5
            assert after.record.turns == 5
            await eventually(lambda: a.cached_session("s1") == after.record)
    finally:
        stop_redis(process)


class CuttableProxy:
    """A TCP front for a unix-socket Redis that can be cut (every connection reset, none
    accepted) and restored on the same port: an outage for the replicas behind it only."""

    def __init__(self, socket_path: Path) -> None:
        self._target = str(socket_path)
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.StreamWriter] = set()
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, "127.0.0.1", self.port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._pipes):
            writer.transport.abort()
        await self._server.wait_closed()
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_unix_connection(self._target)
        self._pipes.update((writer, upstream_writer))

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            sink.transport.abort()

        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))
        self._pipes.difference_update((writer, upstream_writer))


@contextlib.asynccontextmanager
async def proxied(socket_path: Path) -> AsyncIterator[CuttableProxy]:
    proxy = CuttableProxy(socket_path)
    await proxy.start()
    try:
        yield proxy
    finally:
        if proxy._server is not None:
            await proxy.cut()


async def test_a_write_back_never_overwrites_a_newer_commit(socket_path: Path) -> None:
    url = f"unix://{socket_path}"
    process = launch_redis(socket_path)
    try:
        async with proxied(socket_path) as proxy:
            behind = f"redis://127.0.0.1:{proxy.port}"
            async with running(behind, "nw", "a") as a, running(url, "nw", "b") as b:
                assert await commit_turns(a, "s", ["w1"]) == 1
                assert await b.load_session("s") == a.cached_session("s")
                await proxy.cut()  # only `a` loses Redis
                await eventually(lambda: a.degraded)
                newer = await b.commit_session("s", "w2", 20, 200, 1)  # `a` misses it
                assert newer.ok and newer.record is not None and newer.record.epoch == 2
                await proxy.start()
                await eventually(lambda: not a.degraded, within=10)
                # `a` wrote back epoch 1: refused; its view takes what Redis holds
                assert a.cached_session("s") == newer.record
                assert await b.load_session("s") == newer.record
    finally:
        stop_redis(process)
