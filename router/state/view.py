"""The replica's local view of the shared state: answers the request path without I/O.

Sessions are an LRU of (epoch, record) entries kept coherent by invalidations and by this
replica's own commit results: a newer epoch always wins, and an optimistic entry (written
before Redis confirmed it) yields to any confirmed entry of the same epoch. Worker loads,
in-flight counts and link ledgers are replaced by each periodic refresh.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Collection

import msgspec

from policies.types import LinkView
from router.state.codec import Snapshot
from router.state.records import (
    UNKNOWN,
    LinkState,
    Reservation,
    SessionRecord,
    Unknown,
    WorkerRecord,
)


class SessionEntry:
    """One session in the view; an optimistic entry remembers the confirmed one it covers."""

    __slots__ = ("epoch", "optimistic", "previous", "record", "stamp")

    def __init__(
        self,
        epoch: int,
        record: SessionRecord | None,
        optimistic: bool,
        previous: SessionEntry | None = None,
    ) -> None:
        self.epoch = epoch
        self.record = record
        self.optimistic = optimistic
        self.previous = previous
        self.stamp = time.monotonic()


class SessionView:
    """A bounded LRU of session residencies; entries older than the session TTL read UNKNOWN."""

    def __init__(self, capacity: int, ttl_s: float) -> None:
        self._entries: OrderedDict[str, SessionEntry] = OrderedDict()
        self._capacity = capacity
        self._ttl_s = ttl_s

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, session_id: str) -> SessionRecord | Unknown | None:
        entry = self.entry(session_id)
        return UNKNOWN if entry is None else entry.record

    def entry(self, session_id: str) -> SessionEntry | None:
        entry = self._entries.get(session_id)
        if entry is None:
            return None
        if time.monotonic() - entry.stamp > self._ttl_s:
            del self._entries[session_id]
            return None
        self._entries.move_to_end(session_id)
        return entry

    def put_optimistic(
        self, session_id: str, epoch: int, record: SessionRecord | None
    ) -> SessionEntry:
        current = self._entries.get(session_id)
        previous = current.previous if current is not None and current.optimistic else current
        entry = SessionEntry(epoch, record, optimistic=True, previous=previous)
        self._store(session_id, entry)
        return entry

    def retract(self, session_id: str, guess: SessionEntry) -> SessionEntry | None:
        """Undo an optimistic entry whose write was dropped; returns what the view holds."""
        current = self._entries.get(session_id)
        if current is not guess:
            return current
        if guess.previous is None:
            del self._entries[session_id]
        else:
            self._entries[session_id] = guess.previous
        return guess.previous

    def apply(
        self,
        session_id: str,
        epoch: int,
        record: SessionRecord | None,
        *,
        replaces: SessionEntry | None = None,
    ) -> None:
        """Store a confirmed (epoch, record) unless the view already holds something newer.

        `replaces` is the optimistic entry this confirmation answers: it is replaced whatever
        its epoch, since it was only a guess.
        """
        current = self._entries.get(session_id)
        if (
            current is None
            or current is replaces
            or epoch > current.epoch
            or (epoch == current.epoch and current.optimistic)
        ):
            self._store(session_id, SessionEntry(epoch, record, optimistic=False))

    def apply_invalidation(self, session_id: str, epoch: int, record: SessionRecord | None) -> None:
        """Apply another replica's commit, cached or not.

        Storing it even for a session this replica has not seen closes a race: a
        `load_session` read answered just before that commit, on another connection than the
        pub/sub one, would otherwise land after the invalidation and cache a stale answer
        for good. `apply` keeps whichever of the two has the newer epoch. The LRU bound holds.
        """
        self.apply(session_id, epoch, record)

    def forget_except(self, keep: Collection[str]) -> None:
        """Drop every entry not in `keep` (after invalidations may have been missed)."""
        for session_id in [sid for sid in self._entries if sid not in keep]:
            del self._entries[session_id]

    def write_back_entries(self, pending: Collection[str]) -> list[tuple[str, SessionEntry]]:
        """After an outage, what to write back: each session's confirmed entry with a
        residency (under an optimistic entry, the one it covers), oldest first.

        Sessions the view knows only as "no residency" are forgotten, unless a write for them
        is pending (their turns are not known, and Redis may hold a newer epoch): the next turn
        reads Redis. Expired entries go too.
        """
        now = time.monotonic()
        out: list[tuple[str, SessionEntry]] = []
        forget: list[str] = []
        for session_id, entry in self._entries.items():
            if now - entry.stamp > self._ttl_s:
                forget.append(session_id)
                continue
            confirmed = entry.previous if entry.optimistic else entry
            if confirmed is not None and confirmed.record is not None:
                out.append((session_id, confirmed))
            elif session_id not in pending:
                forget.append(session_id)
        for session_id in forget:
            del self._entries[session_id]
        return out

    def _store(self, session_id: str, entry: SessionEntry) -> None:
        self._entries[session_id] = entry
        self._entries.move_to_end(session_id)
        if len(self._entries) > self._capacity:
            self._entries.popitem(last=False)


class FleetView:
    """Worker loads, in-flight counts and link ledgers, as of the last refresh plus own writes."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerRecord] = {}
        self.unconfirmed_workers: set[str] = set()  # published here, not yet acknowledged
        self.others_inflight: dict[str, int] = {}
        self.own_inflight: dict[str, int] = {}
        # others' plus own, per worker, kept as either changes (`inflight`: read per turn)
        self._inflight: dict[str, int] = {}
        self.links: dict[tuple[str, str], LinkState] = {}
        self.local_reservations: dict[str, Reservation] = {}
        # Every turn's ClusterView carries the links it cannot imply (`leave_out_idle`; else
        # all N x (N - 1) of them): rebuilt only after a change to one of those, or when a
        # local reservation expires.
        self._implied: Callable[[str, str], float] | None = None
        self._listed: dict[tuple[str, str], LinkState] = {}
        self._links_changes = 0
        self._policy_links: tuple[LinkView, ...] = ()
        self._policy_links_as_of = -1
        self._policy_links_until = -math.inf

    def put_worker(self, record: WorkerRecord) -> None:
        current = self.workers.get(record.worker_id)
        if current is None or record.scraped_at >= current.scraped_at:
            self.workers[record.worker_id] = record

    def add_inflight(self, worker_id: str, delta: int) -> None:
        count = self.own_inflight.get(worker_id, 0) + delta
        if count:
            self.own_inflight[worker_id] = count
        else:
            self.own_inflight.pop(worker_id, None)
        others = self.others_inflight.get(worker_id)
        if others is None and not count:
            self._inflight.pop(worker_id, None)
        else:
            self._inflight[worker_id] = (others or 0) + count

    def set_others_inflight(self, counts: dict[str, int]) -> None:
        """The other replicas' in-flight counts, as the latest snapshot read them."""
        self.others_inflight = counts
        total = dict(counts)
        for worker_id, count in self.own_inflight.items():
            total[worker_id] = total.get(worker_id, 0) + count
        if total != self._inflight:
            # A new mapping: the workers' views read it whole (`WorkerPool.views`); the same
            # counts keep the one they read.
            self._inflight = total

    def inflight(self) -> dict[str, int]:
        """In-flight counts per worker, the other replicas' plus this one's: kept current,
        not copied (read it, do not edit it)."""
        return self._inflight

    def put_link(self, state: LinkState) -> None:
        """Store a ledger reading unless the view holds a later one."""
        key = (state.src, state.dst)
        current = self.links.get(key)
        if current is None or state.as_of >= current.as_of:
            self.links[key] = state
            self._relist(key)

    def set_capacity(self, src: str, dst: str, capacity_bps: float) -> None:
        current = self.links.get((src, dst)) or LinkState(src=src, dst=dst)
        self.links[(src, dst)] = msgspec.structs.replace(current, capacity_bps=capacity_bps)
        self._relist((src, dst))

    def add_local_reservation(self, reservation: Reservation) -> None:
        """A reservation only this replica knows of until it expires: Redis did not take it
        (`local_only`), or has not yet (`confirm_reservation`)."""
        self.local_reservations[reservation.id] = reservation
        self._links_changes += 1

    def confirm_reservation(self, reservation: Reservation) -> None:
        """Redis took the reservation: the ledger readings count it from now on."""
        if self.local_reservations.pop(reservation.id, None) is not None:
            self._links_changes += 1

    def drop_reservation(self, reservation: Reservation) -> None:
        """Take a released reservation out of the view now, before Redis confirms it."""
        if self.local_reservations.pop(reservation.id, None) is not None:
            self._links_changes += 1
            return
        current = self.links.get((reservation.src, reservation.dst))
        if current is None or current.reservations == 0:
            return
        if reservation.kind == "handoff":
            changes = {"handoff_bytes": max(0, current.handoff_bytes - reservation.nbytes)}
        else:
            changes = {"migration_bytes": max(0, current.migration_bytes - reservation.nbytes)}
        self.links[(reservation.src, reservation.dst)] = msgspec.structs.replace(
            current, reservations=current.reservations - 1, **changes
        )
        self._relist((reservation.src, reservation.dst))

    def leave_out_idle(self, implied: Callable[[str, str], float]) -> None:
        """From now on the policy's links leave out each idle link whose capacity is the one
        `implied` gives it (what a `ClusterView` implies for a link it does not list,
        `policies.types.idle_link_bps`; 0: none)."""
        self._implied = implied
        for key in self.links:
            self._relist(key)

    def _relist(self, key: tuple[str, str]) -> None:
        """The link changed: list it for the policy unless its view would be implied."""
        state = self.links.get(key)
        implied = self._implied
        if state is None or (
            implied is not None
            and state.handoff_bytes == 0
            and state.migration_bytes == 0
            and state.reservations == 0
            and 0.0 < state.capacity_bps == implied(state.src, state.dst)
        ):
            if self._listed.pop(key, None) is not None:
                self._links_changes += 1
        else:
            self._listed[key] = state
            self._links_changes += 1

    def policy_links(self, now: float) -> tuple[LinkView, ...]:
        """`link_views(now)` as the policy sees them, less the links it implies
        (`leave_out_idle`); the same tuple while nothing changed."""
        if self._policy_links_as_of != self._links_changes or now >= self._policy_links_until:
            listed = self._overlaid(now, self._listed)
            links = tuple(state.to_view() for state in listed.values())
            self._policy_links, self._policy_links_as_of = links, self._links_changes
            self._policy_links_until = min(
                (r.expires_at for r in self.local_reservations.values()), default=math.inf
            )
        return self._policy_links

    def link_views(self, now: float) -> dict[tuple[str, str], LinkState]:
        return self._overlaid(now, self.links)

    def _overlaid(
        self, now: float, links: dict[tuple[str, str], LinkState]
    ) -> dict[tuple[str, str], LinkState]:
        """`links` with this replica's unexpired local reservations added."""
        views = dict(links)
        expired = [r.id for r in self.local_reservations.values() if r.expires_at <= now]
        for reservation_id in expired:
            del self.local_reservations[reservation_id]
        if expired:
            self._links_changes += 1
        for r in self.local_reservations.values():
            base = views.get((r.src, r.dst)) or LinkState(src=r.src, dst=r.dst)
            views[(r.src, r.dst)] = msgspec.structs.replace(
                base,
                handoff_bytes=base.handoff_bytes + (r.nbytes if r.kind == "handoff" else 0),
                migration_bytes=base.migration_bytes + (r.nbytes if r.kind == "migration" else 0),
                reservations=base.reservations + 1,
            )
        return views

    def apply_snapshot(self, snapshot: Snapshot) -> None:
        seen = {record.worker_id for record in snapshot.workers}
        for record in snapshot.workers:
            self.put_worker(record)
        # a worker missing from Redis expired, unless its record is still on its way there
        for worker_id in [w for w in self.workers if w not in seen]:
            if worker_id not in self.unconfirmed_workers:
                del self.workers[worker_id]
        self.set_others_inflight(snapshot.inflight)
        present: set[tuple[str, str]] = set()
        for state in snapshot.links:
            present.add((state.src, state.dst))
            self.put_link(state)
        for key in [k for k, s in self.links.items() if k not in present]:
            if self.links[key].as_of < snapshot.as_of:
                del self.links[key]
                self._relist(key)
