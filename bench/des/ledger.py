"""The link reservation ledger, as the live router's Redis scripts keep it (one replica).

Same rules as `router.state.scripts`: expired leases are pruned first; a handoff reservation is
always admitted; a migration of `nbytes` is admitted iff
`handoff_bytes + migration_bytes + nbytes <= rate x lease_s`, with `rate` the link's capacity,
else its observed rate, and with neither known only onto an idle link. A release with a
measured rate updates the link's observed rate (EWMA). The policy sees handoff reservations as
`reserved_bytes` and admitted migrations as `bytes_in_flight`, as `LinkState.to_view` gives,
on the links that hold some, or whose capacity is not the one the view implies for a link it
leaves out (`policies.types.ClusterView`: an idle link at its NICs' rate, whose observed rate
that capacity overrides); the others are left out.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from policies.plan import TransferKind
from policies.types import LinkView


class Reservation(NamedTuple):
    id: int
    src: str
    dst: str
    nbytes: int
    kind: TransferKind
    expires_at: float


class _Link:
    __slots__ = (
        "capacity_bps",
        "handoff_bytes",
        "implied",
        "migration_bytes",
        "observed_bps",
        "reservations",
    )

    def __init__(self, capacity_bps: float, implied: bool = False) -> None:
        self.capacity_bps = capacity_bps
        self.implied = implied  # idle, a view may leave it out (its capacity is implied)
        self.observed_bps: float | None = None  # no release measured yet
        self.handoff_bytes = 0
        self.migration_bytes = 0
        self.reservations = 0


class LinkLedger:
    def __init__(
        self,
        capacities: Iterable[tuple[str, str, float]],
        lease_s: float,
        ewma_alpha: float,
        implied: Callable[[str, str], float] | None = None,
    ) -> None:
        """`implied`: the capacity a view implies for a link it leaves out (0: none; None:
        every link is listed)."""
        self._links: dict[tuple[str, str], _Link] = {}
        # The links a view lists: those not implied, or holding bytes (insertion order).
        self._listed: dict[tuple[str, str], _Link] = {}
        for src, dst, capacity in capacities:
            rate = implied(src, dst) if implied is not None else 0.0
            link = self._links[(src, dst)] = _Link(capacity, 0.0 < rate == capacity)
            if not link.implied:
                self._listed[(src, dst)] = link
        self._lease_s = lease_s
        self._alpha = ewma_alpha
        self._live: dict[int, Reservation] = {}
        self._expiries: list[tuple[float, int]] = []
        self._next_id = 0
        self._views: tuple[LinkView, ...] | None = None

    def reserve(
        self, src: str, dst: str, nbytes: int, kind: TransferKind, now: float
    ) -> Reservation | None:
        """Admit `nbytes` onto src>dst; None when a migration does not fit (deferred)."""
        self._prune(now)
        link = self._links.get((src, dst))
        if link is None:  # a link nobody declared: created with no known capacity
            link = self._links[(src, dst)] = self._listed[(src, dst)] = _Link(0.0)
            self._views = None
        if kind == "migration":
            rate = link.capacity_bps if link.capacity_bps > 0 else (link.observed_bps or 0.0)
            used = link.handoff_bytes + link.migration_bytes
            if rate > 0:
                admitted = used + nbytes <= rate * self._lease_s
            else:
                admitted = link.reservations == 0
            if not admitted:
                return None
        self._next_id += 1
        reservation = Reservation(self._next_id, src, dst, nbytes, kind, now + self._lease_s)
        self._live[reservation.id] = reservation
        heapq.heappush(self._expiries, (reservation.expires_at, reservation.id))
        self._apply(reservation, +1)
        return reservation

    def release(self, reservation: Reservation, transferred_bytes: int, seconds: float) -> None:
        """Drop the reservation (if its lease has not expired); learn the link's rate."""
        if self._live.pop(reservation.id, None) is not None:
            self._apply(reservation, -1)
        if seconds > 0 and transferred_bytes >= 0:
            link = self._links[(reservation.src, reservation.dst)]
            rate = transferred_bytes / seconds
            old = link.observed_bps
            link.observed_bps = (
                rate if old is None else self._alpha * rate + (1 - self._alpha) * old
            )
            if not link.implied:
                self._views = None

    def views(self, now: float) -> tuple[LinkView, ...]:
        """The links a view lists (rebuilt only after a change to one of them)."""
        self._prune(now)
        if self._views is None:
            self._views = tuple(
                LinkView(
                    src=src,
                    dst=dst,
                    capacity_bps=link.capacity_bps,
                    observed_bps=link.observed_bps or 0.0,
                    bytes_in_flight=link.migration_bytes,
                    reserved_bytes=link.handoff_bytes,
                )
                for (src, dst), link in self._listed.items()
            )
        return self._views

    def _apply(self, reservation: Reservation, sign: int) -> None:
        link = self._links[(reservation.src, reservation.dst)]
        if reservation.kind == "handoff":
            link.handoff_bytes += sign * reservation.nbytes
        else:
            link.migration_bytes += sign * reservation.nbytes
        link.reservations += sign
        self._views = None
        if link.implied:
            key = (reservation.src, reservation.dst)
            if link.reservations > 0:
                self._listed[key] = link
            else:
                self._listed.pop(key, None)

    def _prune(self, now: float) -> None:
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            _, reservation_id = heapq.heappop(expiries)
            reservation = self._live.pop(reservation_id, None)
            if reservation is not None:
                self._apply(reservation, -1)


def router_links(
    worker_ids: Sequence[str], roles: Sequence[str], rate_bps: float
) -> list[tuple[str, str, float]]:
    """The links the live router declares (`router.app`): from every non-decode worker to
    every other non-prefill worker, at the NIC rate."""
    count = len(worker_ids)
    return [
        (worker_ids[s], worker_ids[d], rate_bps)
        for s in range(count)
        if roles[s] != "decode"
        for d in range(count)
        if d != s and roles[d] != "prefill"
    ]
