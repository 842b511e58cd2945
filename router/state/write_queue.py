"""Writes waiting for the next pipelined batch, coalesced per key and bounded.

Session writes coalesce per session: a write whose expected epoch is the epoch a pending
write will produce (the same replica's next turn) merges into it, so the pair goes out as one
compare-and-set with the latest residency; a write expecting the same epoch as the pending one
replaces it (the latest wins; the replaced callers learn they lost); any other write queues
behind it and Redis decides. Writes already sent once (their batch failed, so they may or may
not have been applied) never merge: they are retried as they were, followed by newer ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from router.state.records import CommitResult, Reservation, WorkerRecord
from router.state.view import SessionEntry

K = TypeVar("K")
V = TypeVar("V")


@dataclass(slots=True)
class SessionWrite:
    session_id: str
    expected_epoch: int  # sent to Redis
    base_epoch: int  # the epoch the view believes Redis holds (differs only for "0 = none")
    epoch_inc: int
    turns_inc: int
    owner: str  # "" clears the residency
    tokens: int
    bytes: int
    write_id: str
    futures: list[asyncio.Future[CommitResult]]
    optimistic: SessionEntry | None
    superseded: list[asyncio.Future[CommitResult]] = field(default_factory=list)
    attempted: bool = False

    def absorb(self, newer: SessionWrite) -> None:
        """Merge `newer`, which chains from this write, into it."""
        self.epoch_inc += newer.epoch_inc
        self.turns_inc += newer.turns_inc
        self.owner, self.tokens, self.bytes = newer.owner, newer.tokens, newer.bytes
        self.futures.extend(newer.futures)
        self.optimistic = newer.optimistic


@dataclass(slots=True)
class ReserveWrite:
    """A handoff's reservation, admitted already (handoffs always are): the ledger learns of
    it with the next batch, off the turn's path."""

    reservation: Reservation
    lease_ms: int


@dataclass(slots=True)
class ReleaseWrite:
    reservation: Reservation
    rate_bps: float | None


@dataclass(slots=True)
class Batch:
    sessions: list[SessionWrite]
    workers: list[WorkerRecord]
    capacities: list[tuple[str, str, float]]
    reserves: list[ReserveWrite]
    releases: list[ReleaseWrite]

    def __len__(self) -> int:
        return (
            len(self.sessions) + len(self.workers) + len(self.capacities) + len(self.reserves)
            + len(self.releases)
        )  # fmt: skip


class WriteQueue:
    """Pending writes; `on_drop` resolves the callers of session writes dropped when full."""

    def __init__(self, limit: int, on_drop: Callable[[SessionWrite], None]) -> None:
        self._limit = limit
        self._on_drop = on_drop
        self._sessions: dict[str, list[SessionWrite]] = {}
        self._workers: dict[str, WorkerRecord] = {}
        self._capacities: dict[tuple[str, str], float] = {}
        self._reserves: dict[str, ReserveWrite] = {}
        self._releases: dict[str, ReleaseWrite] = {}
        self._session_writes = 0

    def __len__(self) -> int:
        return (
            self._session_writes + len(self._workers) + len(self._capacities)
            + len(self._reserves) + len(self._releases)
        )  # fmt: skip

    def session_ids(self) -> set[str]:
        return set(self._sessions)

    def add_session(self, write: SessionWrite) -> None:
        pending = self._sessions.get(write.session_id)
        if pending and not pending[-1].attempted:
            last = pending[-1]
            if write.expected_epoch == last.base_epoch + last.epoch_inc:
                last.absorb(write)
                return
            if write.expected_epoch == last.expected_epoch:
                write.superseded = [*last.superseded, *last.futures]
                write.optimistic = write.optimistic or last.optimistic
                pending[-1] = write
                return
        if pending:
            pending.append(write)
        else:
            self._sessions[write.session_id] = [write]
        self._session_writes += 1
        self._shed()

    def add_worker(self, record: WorkerRecord) -> None:
        current = self._workers.get(record.worker_id)
        if current is None or record.scraped_at >= current.scraped_at:
            self._workers[record.worker_id] = record

    def add_capacity(self, src: str, dst: str, capacity_bps: float) -> None:
        self._capacities[(src, dst)] = capacity_bps

    def add_reserve(self, reserve: ReserveWrite) -> None:
        self._reserves[reserve.reservation.id] = reserve
        if len(self._reserves) > self._limit:
            del self._reserves[next(iter(self._reserves))]

    def add_release(self, release: ReleaseWrite) -> None:
        self._releases[release.reservation.id] = release
        if len(self._releases) > self._limit:
            del self._releases[next(iter(self._releases))]

    def take(self, limit: int) -> Batch:
        """Up to about `limit` writes, oldest first; a session's writes are taken together."""
        batch = Batch([], [], [], [], [])
        while self._sessions and len(batch.sessions) < limit:
            session_id = next(iter(self._sessions))
            writes = self._sessions.pop(session_id)
            self._session_writes -= len(writes)
            batch.sessions.extend(writes)
        batch.workers = _pop_some(self._workers, limit)
        batch.capacities = [(s, d, c) for (s, d), c in _pop_items(self._capacities, limit)]
        # a batch sends its reserves before its releases: a release never overtakes its reserve
        batch.reserves = _pop_some(self._reserves, limit)
        batch.releases = _pop_some(self._releases, limit)
        return batch

    def restore(self, batch: Batch) -> None:
        """Put back a batch whose outcome is unknown, ahead of anything queued since."""
        for write in reversed(batch.sessions):
            write.attempted = True
            self._sessions.setdefault(write.session_id, []).insert(0, write)
            self._session_writes += 1
        for record in batch.workers:
            self._workers.setdefault(record.worker_id, record)
        for src, dst, capacity in batch.capacities:
            self._capacities.setdefault((src, dst), capacity)
        for reserve in batch.reserves:
            self._reserves.setdefault(reserve.reservation.id, reserve)
        for release in batch.releases:
            self._releases.setdefault(release.reservation.id, release)
        self._shed()

    def drain_sessions(self) -> Iterable[SessionWrite]:
        """Remove and yield every pending session write (on close)."""
        sessions, self._sessions = self._sessions, {}
        self._session_writes = 0
        for writes in sessions.values():
            yield from writes

    def _shed(self) -> None:
        while self._session_writes > self._limit:
            session_id = next(iter(self._sessions))
            writes = self._sessions.pop(session_id)
            self._session_writes -= len(writes)
            for write in writes:
                self._on_drop(write)


def _pop_some(items: dict[K, V], limit: int) -> list[V]:
    return [value for _, value in _pop_items(items, limit)]


def _pop_items(items: dict[K, V], limit: int) -> list[tuple[K, V]]:
    taken: list[tuple[K, V]] = []
    while items and len(taken) < limit:
        key = next(iter(items))
        taken.append((key, items.pop(key)))
    return taken
