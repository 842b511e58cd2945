"""Keeps the local view in sync with Redis: invalidations, periodic refresh, outage recovery.

One Redis client (no client-side retries: an unreachable Redis is reported at once and
handled here) serves the refresh task and the request path's round trips; the writer and the
subscriber each have a lean connection of their own (`router.state.redis_wire`) where the URL
allows, else they use the client too. On any unreachable error the state goes degraded and
`_recover` reconnects with backoff, resubscribes, writes back the sessions its local view holds
(Redis may have come back empty; a session is set only where Redis holds nothing or an older
epoch, and the view takes whatever Redis holds), flushes the pending writes and refreshes,
before it declares Redis back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError

from router.state.batcher import SESSIONS_PER_CALL, BatchWriter
from router.state.codec import invalidation_decoder, session_from_cas, snapshot_from_refresh
from router.state.health import UNREACHABLE, Health, backoff_delays
from router.state.keys import Keys
from router.state.records import StateConfig
from router.state.redis_url import StateClient, close_redis, open_redis
from router.state.redis_wire import RespConnection, lean_target
from router.state.scripts import Scripts
from router.state.view import FleetView, SessionEntry, SessionView
from router.state.write_queue import WriteQueue

log = logging.getLogger("router.state.shared")

CLOSE_FLUSH_S = 2.0  # how long close() waits for pending writes to reach Redis
WRITE_BACK_CALLS = 16  # session restore calls per pipeline when writing the view back
_encode_restore = msgspec.msgpack.Encoder().encode
_decode_stored = msgspec.msgpack.Decoder(list[tuple[int, str, int, int, int, int, str]]).decode


class StateSync:
    def __init__(
        self,
        config: StateConfig,
        keys: Keys,
        sessions: SessionView,
        fleet: FleetView,
        queue: WriteQueue,
        health: Health,
        on_roundtrip: Callable[[str, float], None] | None,
    ) -> None:
        self._config = config
        self._keys = keys
        self._scripts = Scripts()
        self._sessions = sessions
        self._fleet = fleet
        self._queue = queue
        self._health = health
        self._on_roundtrip = on_roundtrip
        self.client: StateClient = open_redis(
            config.url,
            socket_timeout=config.command_timeout_s,
            socket_connect_timeout=config.connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._lean = lean_target(config.url)
        self.writer = BatchWriter(
            client=self.client,
            config=config,
            keys=keys,
            scripts=self._scripts,
            queue=queue,
            sessions=sessions,
            fleet=fleet,
            health=health,
            on_roundtrip=on_roundtrip,
            on_unreachable=self.fail,
            reload_scripts=self._load_scripts,
            lean=self._lean,
        )
        self.own_capacities: dict[tuple[str, str], float] = {}
        self._capacities_asserted = time.monotonic()
        self._pubsub: PubSub | None = None
        self._subscriber: RespConnection | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._closing = False

    @property
    def scripts(self) -> Scripts:
        return self._scripts

    async def start(self) -> None:
        self._spawn("writer", self.writer.run())
        self._spawn("refresh", self._refresh_loop())
        try:
            await self._connect()
            await self.refresh_once()
        except UNREACHABLE as error:
            self.fail(error)

    async def close(self) -> None:
        """Flush (bounded wait), drop this replica's heartbeat, stop the tasks, disconnect."""
        self._closing = True
        for name in ("refresh", "recover"):
            await self._cancel(name)
        if not self._health.degraded:
            with contextlib.suppress(*UNREACHABLE, RedisError):
                await asyncio.wait_for(self.writer.flush_all(), CLOSE_FLUSH_S)
                pipe = self.client.pipeline(transaction=False)
                pipe.delete(self._keys.inflight(self._config.replica_id))
                pipe.srem(self._keys.replicas_index, self._config.replica_id)
                started = time.perf_counter()
                await pipe.execute()
                self.roundtrip("batch", started)
        for name in ("writer", "listener"):
            await self._cancel(name)
        await self._close_pubsub()
        self.writer.close()
        await close_redis(self.client)

    def roundtrip(self, kind: str, started: float) -> None:
        if self._on_roundtrip is not None:
            self._on_roundtrip(kind, time.perf_counter() - started)

    async def evalsha(self, sha: str, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self.client.evalsha(sha, len(keys), *keys, *args)
        except NoScriptError:  # Redis restarted or flushed its script cache
            await self._load_scripts()
            return await self.client.evalsha(sha, len(keys), *keys, *args)

    def fail(self, error: BaseException) -> None:
        if self._closing:  # errors while shutting down are not an outage
            return
        if self._health.fail(error):
            self._spawn("recover", self._recover())

    async def refresh_once(self) -> None:
        """Heartbeat this replica's in-flight counts and read the fleet (one round trip)."""
        keys, config = self._keys, self._config
        args: list[Any] = [
            keys.worker_prefix, keys.inflight_prefix, keys.link_prefix, keys.lease_prefix,
            keys.resv_prefix, config.replica_id, int(config.inflight_ttl_s * 1000),
        ]  # fmt: skip
        for worker_id, count in self._fleet.own_inflight.items():
            args += (worker_id, count)
        index_keys = [keys.workers_index, keys.replicas_index, keys.links_index]
        started = time.perf_counter()
        reply = await self.evalsha(
            self._scripts.refresh, [*index_keys, keys.inflight(config.replica_id)], args
        )
        self.roundtrip("refresh", started)
        self._fleet.apply_snapshot(snapshot_from_refresh(reply))
        if time.monotonic() - self._capacities_asserted > config.link_ttl_s / 3:
            self._capacities_asserted = time.monotonic()
            for (src, dst), capacity in self.own_capacities.items():
                self._queue.add_capacity(src, dst, capacity)
            self.writer.wake()

    async def _load_scripts(self) -> None:
        started = time.perf_counter()
        if isinstance(self.client, RedisCluster):
            # SCRIPT LOAD goes to every primary (redis-py routes it so outside a pipeline)
            await self.client.ping()
            replies = [None, *[await self.client.script_load(source)
                               for source in self._scripts.sources.values()]]  # fmt: skip
        else:
            pipe = self.client.pipeline(transaction=False)
            pipe.ping()
            for source in self._scripts.sources.values():
                pipe.script_load(source)
            replies = await pipe.execute()
        self.roundtrip("ping", started)
        loaded = [r.decode() if isinstance(r, bytes) else r for r in replies[1:]]
        if loaded != self._scripts.shas:
            raise RuntimeError(f"Redis returned unexpected script SHAs: {loaded}")

    async def _connect(self) -> None:
        """Load the scripts and (re)subscribe to invalidations, confirmed by the server."""
        await self._load_scripts()
        await self._close_pubsub()
        if self._lean is not None:
            started = time.perf_counter()
            subscriber = await RespConnection.open(self._lean, self._config.connect_timeout_s)
            self._subscriber = subscriber
            await subscriber.subscribe(
                self._keys.channel, self._on_invalidation, self.fail,
                self._config.command_timeout_s,
            )  # fmt: skip
            self.roundtrip("ping", started)
            return
        pubsub = self.client.pubsub()
        self._pubsub = pubsub
        started = time.perf_counter()
        await pubsub.subscribe(self._keys.channel)
        deadline = started + self._config.command_timeout_s
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                raise TimeoutError("no SUBSCRIBE confirmation from Redis")
            message = await pubsub.get_message(timeout=left)
            if message is not None and message["type"] == "subscribe":
                break
        self.roundtrip("ping", started)
        self._spawn("listener", self._listen(pubsub))

    async def _close_pubsub(self) -> None:
        if self._subscriber is not None:
            self._subscriber.close()
            self._subscriber = None
        await self._cancel("listener")
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(*UNREACHABLE, RedisError):
                await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]

    async def _listen(self, pubsub: PubSub) -> None:
        try:
            while True:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=None)
                if message is not None and message["type"] == "message":
                    self._invalidate(message["data"])
        except UNREACHABLE as error:
            self.fail(error)
        except Exception as error:  # without invalidations the view drifts: resubscribe
            log.exception("shared-state subscriber failed")
            self.fail(error)

    def _on_invalidation(self, data: bytes) -> None:
        try:
            self._invalidate(data)
        except Exception:  # one bad message must not end the subscription
            log.exception("shared-state invalidation failed")

    def _invalidate(self, data: bytes) -> None:
        try:
            message = invalidation_decoder.decode(data)
        except ValueError:
            log.warning("undecodable session invalidation ignored")
            return
        if message.replica != self._config.replica_id:
            for change in message.changes:
                self._sessions.apply_invalidation(change.session_id, change.epoch, change.record())

    async def _refresh_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(self._config.refresh_interval_s)
            await self._health.wait_up()
            try:
                await self.refresh_once()
            except UNREACHABLE as error:
                self.fail(error)
            except Exception:
                log.exception("shared-state refresh failed")

    async def _recover(self) -> None:
        next_delay = backoff_delays()
        while not self._closing:
            await asyncio.sleep(next_delay())
            failures = self._health.failures
            try:
                await self._connect()
                # Redis may have lost what the view holds, or the view missed invalidations
                await self.write_back()
                await self.writer.flush_all()
                await self.refresh_once()
            except UNREACHABLE:
                continue
            except Exception:
                log.exception("shared-state recovery attempt failed")
                continue
            if self._health.failures == failures:
                self._health.recovered()
                return

    async def write_back(self) -> int:
        """Write the view's sessions back to Redis (compare-and-set on the epoch, see
        `SESSION_RESTORE_BATCH`) and take into the view what Redis holds after; returns how
        many Redis took. Pending writes go after it: their expected epochs are these."""
        entries = self._sessions.write_back_entries(self._queue.session_ids())
        keys, config = self._keys, self._config
        ttl_ms = int(config.session_ttl_s * 1000)
        by_bucket: dict[int, list[tuple[str, SessionEntry]]] = {}
        for item in entries:
            by_bucket.setdefault(keys.bucket(item[0]), []).append(item)
        step = SESSIONS_PER_CALL
        every = [(keys.session_prefix_of(bucket), part[i : i + step])
                 for bucket, part in by_bucket.items()
                 for i in range(0, len(part), step)]  # fmt: skip
        applied = 0
        for first in range(0, len(every), WRITE_BACK_CALLS):
            calls = every[first : first + WRITE_BACK_CALLS]
            pipe = self.client.pipeline(transaction=False)
            for prefix, call in calls:
                rows = _encode_restore([_restore_row(sid, entry) for sid, entry in call])
                # the bucket's prefix is the call's one key, as in the batch writer
                pipe.evalsha(
                    self._scripts.session_restore_batch, 1, prefix, prefix, ttl_ms,
                    keys.channel, config.replica_id, rows,
                )  # fmt: skip
            started = time.perf_counter()
            replies = await pipe.execute()
            self.roundtrip("batch", started)
            for (_, call), reply in zip(calls, replies, strict=True):
                for (session_id, entry), stored in zip(call, _decode_stored(reply), strict=True):
                    ok, epoch, record = session_from_cas(session_id, stored)
                    applied += ok
                    # Redis is the truth: it replaces the entry written, unless a newer
                    # (optimistic) one has come since
                    self._sessions.apply(session_id, epoch, record, replaces=entry)
        if entries:
            log.info("wrote back %d of %d sessions from the local view", applied, len(entries))
        return applied

    def _spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro, name=f"shared-state-{name}")
        self._tasks[name] = task
        task.add_done_callback(_report_death)

    async def _cancel(self, name: str) -> None:
        task = self._tasks.pop(name, None)
        # asyncio.wait_for (inside redis-py) swallows a cancellation that races a reply on
        # Python 3.11, so cancel until the task is really done
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.1)


def _restore_row(session_id: str, entry: SessionEntry) -> tuple[Any, ...]:
    record = entry.record
    assert record is not None  # write_back_entries gives only entries with a residency
    return (session_id, entry.epoch, record.worker_id, record.tokens, record.bytes,
            record.turns, repr(record.last_seen))  # fmt: skip


def _report_death(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("shared-state task %s died", task.get_name(), exc_info=task.exception())
