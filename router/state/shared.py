"""The router's shared state: Redis is the truth, a local view answers the request path.

Reads (`cached_session`, `fleet_workers`, `fleet_inflight`, `link_views`) never touch Redis.
`load_session` (a session the view cannot answer) and `reserve` are one round trip each.
Writes go out in pipelined batches shared by many requests; session writes are Lua
compare-and-sets on the session epoch that publish an invalidation other replicas apply.
While Redis is unreachable nothing raises into the request path: reads answer from the view,
writes wait (bounded, coalesced), and the view is resynchronised when Redis is back.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import cast

from redis.exceptions import RedisError

from policies.types import LinkView
from router.state.codec import link_from_ledger, session_from_hash
from router.state.health import UNREACHABLE, Health
from router.state.keys import Keys
from router.state.records import (
    UNKNOWN,
    CommitResult,
    LinkState,
    Reservation,
    SessionRecord,
    StateConfig,
    TransferKind,
    Unknown,
    WorkerRecord,
)
from router.state.redis_url import is_cluster
from router.state.sync import StateSync
from router.state.view import FleetView, SessionView
from router.state.write_queue import ReleaseWrite, ReserveWrite, SessionWrite, WriteQueue

__all__ = [
    "UNKNOWN",
    "CommitResult",
    "LinkState",
    "Reservation",
    "SessionRecord",
    "SharedState",
    "StateConfig",
    "TransferKind",
    "Unknown",
    "WorkerRecord",
]

log = logging.getLogger("router.state.shared")


class SharedState:
    """One replica's handle on the shared state (see the module docstring)."""

    def __init__(
        self,
        config: StateConfig,
        on_roundtrip: Callable[[str, float], None] | None = None,
        on_degraded: Callable[[bool], None] | None = None,
    ) -> None:
        self.config = config
        self._keys = Keys(config.prefix, cluster=is_cluster(config.url))
        self._health = Health(on_degraded)
        self._sessions = SessionView(config.session_cache_size, config.session_ttl_s)
        self._fleet = FleetView()
        self._queue = WriteQueue(config.max_pending_writes, self._drop)
        self._sync = StateSync(
            config, self._keys, self._sessions, self._fleet, self._queue, self._health, on_roundtrip
        )
        # write ids must never repeat, even across restarts under the same replica id
        self._write_prefix = f"{config.replica_id}:{uuid.uuid4().hex[:8]}:"
        self._write_seq = 0
        self._started = False
        self._closed = False

    @property
    def degraded(self) -> bool:
        return self._health.degraded

    # lifecycle

    async def start(self) -> None:
        """Connect, load scripts, subscribe, start the writer and the refresh task.

        An unreachable Redis does not fail the start: the state starts degraded and recovers
        in the background.
        """
        if self._started:
            raise RuntimeError("SharedState already started")
        self._started = True
        await self._sync.start()

    async def close(self) -> None:
        """Flush pending writes (bounded wait), drop this replica's in-flight counts, stop."""
        if self._closed:
            return
        self._closed = True
        if not self._started:
            await self._sync.client.aclose()
            return
        await self._sync.close()
        for write in self._queue.drain_sessions():
            self._drop(write)

    async def ping(self) -> bool:
        """True when Redis answers a PING now (for GET /ready)."""
        started = time.perf_counter()
        try:
            await self._sync.client.ping()
        except UNREACHABLE as error:
            self._sync.fail(error)
            return False
        self._sync.roundtrip("ping", started)
        return True

    # sessions

    def cached_session(self, session_id: str) -> SessionRecord | Unknown | None:
        """The local view's residency: a record, None (no residency) or UNKNOWN. No I/O."""
        return self._sessions.lookup(session_id)

    async def load_session(self, session_id: str) -> SessionRecord | None:
        """Read the session from Redis into the view (one round trip); never raises."""
        if self.degraded:
            return self._local_session(session_id)
        started = time.perf_counter()
        try:
            key = self._keys.session(session_id)
            fields = cast("dict[bytes, bytes]", await self._sync.client.hgetall(key))
        except UNREACHABLE as error:
            self._sync.fail(error)
            return self._local_session(session_id)
        except RedisError:
            log.exception("load_session %s failed", session_id)
            return self._local_session(session_id)
        self._sync.roundtrip("load_session", started)
        epoch, record = session_from_hash(session_id, fields)
        self._sessions.apply(session_id, epoch, record)
        return self._local_session(session_id)

    def commit_session(
        self, session_id: str, worker_id: str, tokens: int, bytes_: int, expected_epoch: int
    ) -> asyncio.Future[CommitResult]:
        """Queue the CAS: residency on `worker_id` if the stored epoch is `expected_epoch`.

        `expected_epoch` 0 also matches any session with no residency. The view is updated
        now (optimistically) and corrected from the result; awaiting is optional.
        """
        future: asyncio.Future[CommitResult] = asyncio.get_running_loop().create_future()
        self.commit_session_nowait(session_id, worker_id, tokens, bytes_, expected_epoch, future)
        return future

    def commit_session_nowait(
        self,
        session_id: str,
        worker_id: str,
        tokens: int,
        bytes_: int,
        expected_epoch: int,
        future: asyncio.Future[CommitResult] | None = None,
    ) -> None:
        """`commit_session` for a caller that does not wait for the outcome (the view is
        corrected from it all the same): no future to make, resolve and collect per turn."""
        if not worker_id:
            raise ValueError("commit_session needs a worker; use clear_session")
        self._submit(session_id, worker_id, tokens, bytes_, expected_epoch, 1, future)

    def clear_session(self, session_id: str, expected_epoch: int) -> asyncio.Future[CommitResult]:
        """Queue the CAS that clears the residency (the worker lost the session's state)."""
        future: asyncio.Future[CommitResult] = asyncio.get_running_loop().create_future()
        self._submit(session_id, "", 0, 0, expected_epoch, 0, future)
        return future

    def clear_session_nowait(self, session_id: str, expected_epoch: int) -> None:
        """`clear_session` without waiting for the outcome."""
        self._submit(session_id, "", 0, 0, expected_epoch, 0, None)

    # workers

    def publish_worker(self, record: WorkerRecord) -> None:
        self._fleet.put_worker(record)
        self._fleet.unconfirmed_workers.add(record.worker_id)
        self._queue.add_worker(record)
        self._wake()

    def fleet_workers(self) -> dict[str, WorkerRecord]:
        return dict(self._fleet.workers)

    def add_inflight(self, worker_id: str, delta: int) -> None:
        """Count work this replica has in flight on a worker; published by the heartbeat."""
        self._fleet.add_inflight(worker_id, delta)

    def fleet_inflight(self) -> dict[str, int]:
        """In-flight counts summed over live replicas (this one's counts are current)."""
        return self._fleet.inflight()

    # links

    def set_link_capacity(self, src: str, dst: str, capacity_bps: float) -> None:
        self._sync.own_capacities[(src, dst)] = capacity_bps
        self._fleet.set_capacity(src, dst, capacity_bps)
        self._queue.add_capacity(src, dst, capacity_bps)
        self._wake()

    async def reserve(
        self, src: str, dst: str, nbytes: int, kind: TransferKind, lease_s: float | None = None
    ) -> Reservation | None:
        """Admit `nbytes` onto the link; None when a migration is deferred. A migration takes one
        round trip; a handoff none (always admitted, it reaches the ledger with the next batch).

        The admission rule is in `router.state.scripts`. While degraded, handoffs are admitted
        locally (a `local_only` reservation) and migrations deferred.
        """
        if kind not in ("handoff", "migration"):
            raise ValueError(f"unknown transfer kind {kind!r}")
        lease = self.config.reservation_lease_s if lease_s is None else lease_s
        reservation_id = f"{kind[0]}-{uuid.uuid4().hex}"
        if self.degraded:
            return self._reserve_locally(reservation_id, src, dst, nbytes, kind, lease)
        lease_ms = max(1, int(lease * 1000))
        if kind == "handoff":
            # Always admitted: nothing to wait for on the turn's path. The view counts it now,
            # the ledger from the next batch on (a release queued meanwhile follows it).
            held = Reservation(reservation_id, src, dst, nbytes, kind, time.time() + lease)
            self._fleet.add_local_reservation(held)
            self._queue.add_reserve(ReserveWrite(held, lease_ms))
            self._wake()
            return held
        lid, link_key, lease_key, resv_key = self._keys.link(src, dst)
        started = time.perf_counter()
        try:
            reply = await self._sync.evalsha(
                self._sync.scripts.link_reserve,
                [link_key, lease_key, resv_key, self._keys.links_index],
                [
                    lid,
                    src,
                    dst,
                    reservation_id,
                    nbytes,
                    lease_ms,
                    int(self.config.link_ttl_s * 1000),
                ],
            )
        except UNREACHABLE as error:
            self._sync.fail(error)
            return self._reserve_locally(reservation_id, src, dst, nbytes, kind, lease)
        except RedisError:
            log.exception("reserve on %s>%s failed", src, dst)
            return self._reserve_locally(reservation_id, src, dst, nbytes, kind, lease)
        self._sync.roundtrip("reserve", started)
        admitted, expires_ms, *ledger = reply
        self._fleet.put_link(link_from_ledger(src, dst, *ledger))
        if not admitted:
            return None
        return Reservation(reservation_id, src, dst, nbytes, kind, int(expires_ms) / 1000.0)

    def release(self, reservation: Reservation, transferred_bytes: int, seconds: float) -> None:
        """Queue the release; a transfer that took `seconds` > 0 updates observed_bps."""
        self._fleet.drop_reservation(reservation)
        rate = transferred_bytes / seconds if seconds > 0 and transferred_bytes >= 0 else None
        if reservation.local_only and rate is None:
            return
        self._queue.add_release(ReleaseWrite(reservation, rate))
        self._wake()

    def link_views(self) -> dict[tuple[str, str], LinkState]:
        return self._fleet.link_views(time.time())

    def policy_links(self) -> tuple[LinkView, ...]:
        """The links a policy's view lists (built again only after a change to one)."""
        return self._fleet.policy_links(time.time())

    def leave_out_idle_links(self, implied: Callable[[str, str], float]) -> None:
        """Policies' views leave out the idle links `implied` gives their capacity
        (`FleetView.leave_out_idle`)."""
        self._fleet.leave_out_idle(implied)

    # internals: writes

    def _submit(
        self,
        session_id: str,
        owner: str,
        tokens: int,
        nbytes: int,
        expected_epoch: int,
        turns_inc: int,
        future: asyncio.Future[CommitResult] | None,
    ) -> None:
        entry = self._sessions.entry(session_id)
        # the epoch Redis should hold: 0 stands for "no residency", whatever its epoch
        base = expected_epoch
        if expected_epoch == 0 and entry is not None and entry.record is None:
            base = entry.epoch
        optimistic = None
        if entry is None or entry.epoch == base:
            record = None
            if owner:
                turns = (entry.record.turns if entry and entry.record else 0) + turns_inc
                record = SessionRecord(
                    session_id, owner, tokens, nbytes, turns, base + 1, time.time()
                )
            optimistic = self._sessions.put_optimistic(session_id, base + 1, record)
        self._write_seq += 1
        write = SessionWrite(
            session_id=session_id,
            expected_epoch=expected_epoch,
            base_epoch=base,
            epoch_inc=1,
            turns_inc=turns_inc,
            owner=owner,
            tokens=tokens,
            bytes=nbytes,
            write_id=f"{self._write_prefix}{self._write_seq}",
            futures=[] if future is None else [future],
            optimistic=optimistic,
        )
        self._queue.add_session(write)
        self._wake()

    def _wake(self) -> None:
        self._sync.writer.wake()

    def _drop(self, write: SessionWrite) -> None:
        self._sync.writer.drop(write)

    def _local_session(self, session_id: str) -> SessionRecord | None:
        answer = self._sessions.lookup(session_id)
        return None if answer is UNKNOWN else answer

    def _reserve_locally(
        self, reservation_id: str, src: str, dst: str, nbytes: int, kind: TransferKind,
        lease_s: float,
    ) -> Reservation | None:  # fmt: skip
        if kind != "handoff":
            return None
        reservation = Reservation(
            reservation_id, src, dst, nbytes, kind, time.time() + lease_s, local_only=True
        )
        self._fleet.add_local_reservation(reservation)
        return reservation
