"""router.state.view.FleetView's link views and in-flight counts: what every turn's
ClusterView carries."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from router.state.codec import Snapshot
from router.state.records import LinkState, Reservation
from router.state.view import FleetView

NOW = 1_000.0


def fleet_with_links() -> FleetView:
    fleet = FleetView()
    fleet.set_capacity("p0", "d0", 50e9)
    fleet.set_capacity("p0", "d1", 50e9)
    fleet.put_link(LinkState("d0", "d1", capacity_bps=25e9, migration_bytes=4096, as_of=NOW))
    return fleet


def handoff(reservation_id: str, nbytes: int, expires_at: float) -> Reservation:
    return Reservation(reservation_id, "p0", "d0", nbytes, "handoff", expires_at, True)


def fresh(fleet: FleetView, now: float) -> list[tuple[str, str, float, int, int]]:
    """What the policy must see, computed from scratch."""
    return [
        (v.src, v.dst, v.capacity_bps, v.reserved_bytes, v.bytes_in_flight)
        for v in (state.to_view() for state in fleet.link_views(now).values())
    ]


def seen(fleet: FleetView, now: float) -> list[tuple[str, str, float, int, int]]:
    return [
        (v.src, v.dst, v.capacity_bps, v.reserved_bytes, v.bytes_in_flight)
        for v in fleet.policy_links(now)
    ]


def test_policy_links_are_one_tuple_while_nothing_changes() -> None:
    fleet = fleet_with_links()
    first = fleet.policy_links(NOW)
    assert seen(fleet, NOW) == fresh(fleet, NOW)
    assert [(v.src, v.dst) for v in first] == [("p0", "d0"), ("p0", "d1"), ("d0", "d1")]
    assert fleet.policy_links(NOW + 60) is first
    fleet.put_link(LinkState("d0", "d1", migration_bytes=1, as_of=NOW - 1))  # older: ignored
    assert fleet.policy_links(NOW + 61) is first


CHANGES: dict[str, Callable[[FleetView], None]] = {
    "newer ledger": lambda f: f.put_link(LinkState("d0", "d1", migration_bytes=1, as_of=NOW + 1)),
    "capacity": lambda f: f.set_capacity("p0", "d1", 100e9),
    "local reservation": lambda f: f.add_local_reservation(handoff("r1", 777, NOW + 30)),
    "released ledger reservation": lambda f: f.drop_reservation(
        Reservation("x", "p0", "d0", 100, "handoff", NOW + 30)
    ),
    "link gone from Redis": lambda f: f.apply_snapshot(Snapshot(NOW + 5, [], {}, [])),
}


@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_every_change_shows_in_the_next_view(change: Callable[[FleetView], None]) -> None:
    fleet = fleet_with_links()
    fleet.put_link(LinkState("p0", "d0", capacity_bps=50e9, handoff_bytes=100, reservations=1,
                             as_of=NOW))  # fmt: skip
    before = seen(fleet, NOW)
    change(fleet)
    assert seen(fleet, NOW + 1) == fresh(fleet, NOW + 1) != before


def test_a_local_reservation_counts_until_it_expires() -> None:
    fleet = fleet_with_links()
    fleet.add_local_reservation(handoff("r1", 777, NOW + 10))
    fleet.add_local_reservation(handoff("r2", 1000, NOW + 20))
    reserved = {(v.src, v.dst): v.reserved_bytes for v in fleet.policy_links(NOW)}
    assert reserved[("p0", "d0")] == 1777
    assert {(v.src, v.dst): v.reserved_bytes for v in fleet.policy_links(NOW + 10)}[
        ("p0", "d0")
    ] == 1000
    assert seen(fleet, NOW + 25) == fresh(fleet, NOW + 25)
    assert {(v.src, v.dst): v.reserved_bytes for v in fleet.policy_links(NOW + 25)}[
        ("p0", "d0")
    ] == 0


def _implied(src: str, dst: str) -> float:
    return 50e9 if src.startswith("p") and src != dst else 0.0


@pytest.mark.parametrize("before", [True, False], ids=["set before", "set after"])
def test_idle_links_the_view_implies_are_left_out(before: bool) -> None:
    """Only links holding bytes, or whose capacity is not the implied one, are listed; a
    link that takes a reservation is listed until it is released."""
    fleet = FleetView()
    if before:
        fleet.leave_out_idle(_implied)
    fleet.set_capacity("p0", "d0", 50e9)
    fleet.set_capacity("p0", "d1", 40e9)  # not the implied rate
    fleet.put_link(LinkState("d0", "d1", capacity_bps=25e9, migration_bytes=4096, as_of=NOW))
    if not before:
        fleet.leave_out_idle(_implied)
    assert [(v.src, v.dst) for v in fleet.policy_links(NOW)] == [("p0", "d1"), ("d0", "d1")]
    fleet.put_link(LinkState("p0", "d0", capacity_bps=50e9, handoff_bytes=100, reservations=1,
                             as_of=NOW))  # fmt: skip
    busy = {(v.src, v.dst): v.reserved_bytes for v in fleet.policy_links(NOW)}
    assert busy == {("p0", "d1"): 0, ("d0", "d1"): 0, ("p0", "d0"): 100}
    fleet.drop_reservation(Reservation("x", "p0", "d0", 100, "handoff", NOW + 30))
    assert {(v.src, v.dst) for v in fleet.policy_links(NOW)} == {("p0", "d1"), ("d0", "d1")}
    fleet.add_local_reservation(handoff("r1", 777, NOW + 10))  # only this replica knows it
    local = {(v.src, v.dst): v.reserved_bytes for v in fleet.policy_links(NOW)}
    assert local[("p0", "d0")] == 777
    assert ("p0", "d0") not in {(v.src, v.dst) for v in fleet.policy_links(NOW + 10)}
    assert fleet.policy_links(NOW + 11) is fleet.policy_links(NOW + 12)  # shared while idle


@pytest.mark.parametrize("seed", range(5))
def test_the_fleet_inflight_kept_is_the_others_plus_this_replicas(seed: int) -> None:
    rng = random.Random(seed)
    fleet = FleetView()
    workers = ("w1", "w2", "w3")
    for _ in range(300):
        if rng.random() < 0.1:
            fleet.set_others_inflight({w: rng.randrange(3) for w in workers if rng.random() < 0.5})
        else:
            worker = rng.choice(workers)
            fleet.add_inflight(worker, 1 if fleet.own_inflight.get(worker, 0) == 0 else
                               rng.choice((-1, 1)))  # fmt: skip
        expected = dict(fleet.others_inflight)
        for worker, count in fleet.own_inflight.items():
            expected[worker] = expected.get(worker, 0) + count
        assert fleet.inflight() == expected


def test_a_snapshot_of_the_same_counts_keeps_the_mapping_the_views_read() -> None:
    """`WorkerPool.views` reads every worker again only when the mapping is another object."""
    fleet = FleetView()
    fleet.add_inflight("w1", 2)
    fleet.set_others_inflight({"w2": 1})
    read = fleet.inflight()
    fleet.set_others_inflight({"w2": 1})
    assert fleet.inflight() is read
    fleet.set_others_inflight({"w2": 2})
    assert fleet.inflight() is not read and fleet.inflight() == {"w1": 2, "w2": 2}
