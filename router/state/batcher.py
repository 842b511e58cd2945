"""The single writer task: drains the write queue into one pipeline per batch.

Every `batch_interval_s` (at once when the queue is large) the pending writes go out as ONE
non-transactional pipeline of EVALSHAs (the session writes of a batch as a single call), and
each caller's future is resolved from its reply. The pipeline goes over a lean connection of
its own (`router.state.redis_wire`) where the URL allows, else through redis-py (on Redis
Cluster, its cluster pipeline, which sends each call to its slot's primary: the session writes
go as one call per bucket, `Keys.bucket`).
A batch that fails to reach Redis is put back whole and retried after recovery; the session
script recognises its own earlier write (by write id), so a retry that was in fact applied
still reports success.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from redis.exceptions import NoScriptError, ReadOnlyError

from router.state.codec import link_from_ledger, session_from_cas, worker_encoder
from router.state.health import UNREACHABLE, Health
from router.state.keys import Keys
from router.state.records import CommitResult, StateConfig
from router.state.redis_url import StateClient
from router.state.redis_wire import Command, LeanTarget, RespConnection
from router.state.scripts import Scripts
from router.state.view import FleetView, SessionView
from router.state.write_queue import Batch, SessionWrite, WriteQueue

log = logging.getLogger("router.state.shared")

LARGE_QUEUE = 256  # this many pending writes go out without waiting for the interval
MAX_BATCH = 4096  # writes per pipeline, so one batch never stalls Redis for long
SESSIONS_PER_CALL = 256  # session writes per script call: one call runs in well under 10 ms


class BatchWriter:
    def __init__(
        self,
        *,
        client: StateClient,
        config: StateConfig,
        keys: Keys,
        scripts: Scripts,
        queue: WriteQueue,
        sessions: SessionView,
        fleet: FleetView,
        health: Health,
        on_roundtrip: Callable[[str, float], None] | None,
        on_unreachable: Callable[[BaseException], None],
        reload_scripts: Callable[[], Awaitable[None]],
        lean: LeanTarget | None = None,
    ) -> None:
        self._client = client
        self._lean = lean
        self._conn: RespConnection | None = None
        self._config = config
        self._keys = keys
        self._scripts = scripts
        self._queue = queue
        self._sessions = sessions
        self._fleet = fleet
        self._health = health
        self._on_roundtrip = on_roundtrip
        self._on_unreachable = on_unreachable
        self._reload_scripts = reload_scripts
        self._wake = asyncio.Event()
        self._session_ttl_ms = int(config.session_ttl_s * 1000)
        self._worker_ttl_ms = int(config.worker_ttl_s * 1000)
        self._link_ttl_ms = int(config.link_ttl_s * 1000)
        self._alpha = repr(config.ewma_alpha)
        self.lock = asyncio.Lock()

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
            if len(self._queue) < LARGE_QUEUE and self._config.batch_interval_s > 0:
                await asyncio.sleep(self._config.batch_interval_s)
            await self._health.wait_up()
            try:
                async with self.lock:
                    await self.flush_once()
            except UNREACHABLE as error:
                self._on_unreachable(error)
            except Exception:
                log.exception("shared-state writer failed a batch")

    async def flush_all(self) -> None:
        """Send batches until the queue is empty; raises if Redis stops answering."""
        while self._queue:
            async with self.lock:
                await self.flush_once()

    async def flush_once(self) -> None:
        batch = self._queue.take(MAX_BATCH)
        if not batch:
            return
        calls = session_calls(self._keys, batch.sessions)
        commands = self._commands(batch, calls)
        started = time.perf_counter()
        try:
            replies = await self._send(commands)
        except asyncio.CancelledError:
            self._queue.restore(batch)
            raise
        except UNREACHABLE:
            self._queue.restore(batch)
            raise
        except Exception:
            log.exception("shared-state batch failed; its writes are dropped")
            for write in batch.sessions:
                self.drop(write)
            return
        if self._on_roundtrip is not None:
            self._on_roundtrip("batch", time.perf_counter() - started)
        await self._dispatch(batch, calls, replies)

    async def _send(self, commands: list[Command]) -> list[Any]:
        """One pipeline: its replies, error replies in place."""
        if self._lean is not None:
            conn = self._conn
            if conn is None or conn.closed:
                connect_s = self._config.connect_timeout_s
                conn = self._conn = await RespConnection.open(self._lean, connect_s)
            return await conn.execute(commands, self._config.command_timeout_s)
        pipe = self._client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return await pipe.execute(raise_on_error=False)

    def close(self) -> None:
        """Close the writer's own connection (the client is its owner's to close)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def drop(self, write: SessionWrite) -> None:
        """Resolve a write that will never be sent; forget the guess it put in the view."""
        if write.optimistic is None:
            entry = self._sessions.entry(write.session_id)
        else:
            entry = self._sessions.retract(write.session_id, write.optimistic)
        record = entry.record if entry is not None and not entry.optimistic else None
        _resolve(write, CommitResult(ok=False, record=record))

    def _commands(self, batch: Batch, calls: list[tuple[str, list[SessionWrite]]]) -> list[Command]:
        keys, scripts, replica = self._keys, self._scripts, self._config.replica_id
        commands: list[Command] = []
        add = commands.append
        for prefix, chunk in calls:
            writes = _encode_writes([
                (w.session_id, w.expected_epoch, w.epoch_inc, w.turns_inc, w.owner, w.tokens,
                 w.bytes, w.write_id)
                for w in chunk
            ])  # fmt: skip
            # the bucket's key prefix is the call's one key: Redis Cluster sends it to that
            # slot's primary (the script reads its prefix from ARGV)
            add(("EVALSHA", scripts.session_cas_batch, 1, prefix, prefix,
                 self._session_ttl_ms, keys.channel, replica, writes))  # fmt: skip
        for record in batch.workers:
            add((
                "EVALSHA", scripts.worker_put, 2, keys.worker(record.worker_id),
                keys.workers_index, record.worker_id, worker_encoder.encode(record),
                repr(record.scraped_at), self._worker_ttl_ms,
            ))  # fmt: skip
        for src, dst, capacity in batch.capacities:
            lid, link_key, _, _ = keys.link(src, dst)
            add((
                "EVALSHA", scripts.link_capacity, 2, link_key, keys.links_index, lid, src, dst,
                repr(float(capacity)), self._link_ttl_ms,
            ))  # fmt: skip
        for reserve in batch.reserves:
            r = reserve.reservation
            lid, link_key, lease_key, resv_key = keys.link(r.src, r.dst)
            add((
                "EVALSHA", scripts.link_reserve, 4, link_key, lease_key, resv_key,
                keys.links_index, lid, r.src, r.dst, r.id, r.nbytes, reserve.lease_ms,
                self._link_ttl_ms,
            ))  # fmt: skip
        for release in batch.releases:
            r = release.reservation
            lid, link_key, lease_key, resv_key = keys.link(r.src, r.dst)
            rate = "" if release.rate_bps is None else repr(release.rate_bps)
            add((
                "EVALSHA", scripts.link_release, 4, link_key, lease_key, resv_key,
                keys.links_index, lid, r.src, r.dst, r.id, rate, self._alpha, self._link_ttl_ms,
            ))  # fmt: skip
        return commands

    async def _dispatch(
        self, batch: Batch, calls: list[tuple[str, list[SessionWrite]]], replies: list[Any]
    ) -> None:
        retry = Batch([], [], [], [], [])
        outage: BaseException | None = None
        reload = False

        def rejected(reply: Any) -> str | None:
            """None for a good reply, else "retry" (after reload/recovery) or "drop"."""
            nonlocal outage, reload
            if not isinstance(reply, Exception):
                return None
            if isinstance(reply, NoScriptError):
                reload = True
                return "retry"
            if isinstance(reply, ReadOnlyError):
                outage = reply
                return "retry"
            log.error("shared-state write rejected by Redis: %s", reply)
            return "drop"

        position = iter(replies)
        for _, chunk in calls:
            reply = next(position)
            verdict = rejected(reply)
            if verdict == "retry":
                retry.sessions.extend(chunk)
            elif verdict == "drop":
                for write in chunk:
                    self.drop(write)
            else:
                for write, stored in zip(chunk, _decode_replies(reply), strict=True):
                    ok, epoch, record = session_from_cas(write.session_id, stored)
                    self._sessions.apply(write.session_id, epoch, record, replaces=write.optimistic)
                    _resolve(write, CommitResult(ok=ok, record=record))
        for worker in batch.workers:
            if rejected(next(position)) == "retry":
                retry.workers.append(worker)
            else:
                self._fleet.unconfirmed_workers.discard(worker.worker_id)
        for capacity in batch.capacities:
            if rejected(next(position)) == "retry":
                retry.capacities.append(capacity)
        for reserve in batch.reserves:
            reply = next(position)
            verdict = rejected(reply)
            if verdict == "retry":
                retry.reserves.append(reserve)
            elif verdict is None:
                r = reserve.reservation
                self._fleet.confirm_reservation(r)
                self._fleet.put_link(link_from_ledger(r.src, r.dst, *reply[2:]))
        for release in batch.releases:
            reply = next(position)
            verdict = rejected(reply)
            if verdict == "retry":
                retry.releases.append(release)
            elif verdict is None:
                r = release.reservation
                self._fleet.put_link(link_from_ledger(r.src, r.dst, *reply))
        if retry:
            self._queue.restore(retry)
        if outage is not None:
            raise outage
        if reload:
            await self._reload_scripts()
            self.wake()


def session_calls(keys: Keys, writes: list[SessionWrite]) -> list[tuple[str, list[SessionWrite]]]:
    """Session writes in script calls: per bucket (one on a standalone Redis), at most
    SESSIONS_PER_CALL each; with their bucket's key prefix."""
    if keys.buckets == 1:
        by_bucket = {0: writes}
    else:
        by_bucket = {}
        for write in writes:
            by_bucket.setdefault(keys.bucket(write.session_id), []).append(write)
    calls: list[tuple[str, list[SessionWrite]]] = []
    for bucket, part in by_bucket.items():
        prefix = keys.session_prefix_of(bucket)
        for i in range(0, len(part), SESSIONS_PER_CALL):
            calls.append((prefix, part[i : i + SESSIONS_PER_CALL]))
    return calls


_encode_writes = msgspec.msgpack.Encoder().encode
_decode_replies = msgspec.msgpack.Decoder(list[tuple[int, str, int, int, int, int, str]]).decode


def _resolve(write: SessionWrite, result: CommitResult) -> None:
    for future in write.futures:
        if not future.done():
            future.set_result(result)
    if write.superseded:
        lost = CommitResult(ok=False, record=result.record)
        for future in write.superseded:
            if not future.done():
                future.set_result(lost)
