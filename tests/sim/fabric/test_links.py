from __future__ import annotations

import pytest

from sim.fabric.links import Fabric

GB = 1_000_000_000
LAT = 5e-6


def _fabric(*names: str, bps: float = 50e9, spine: float | None = None) -> Fabric:
    fabric = Fabric(spine_bps=spine)
    for name in names:
        fabric.add_nic(name, bps, bps, LAT)
    return fabric


def test_one_transfer_takes_size_over_bandwidth_plus_latency() -> None:
    fabric = _fabric("a", "b")
    tid = fabric.start("a", "b", GB, now=0.0)
    assert fabric.rate_of(tid) == 50e9
    assert fabric.bytes_in_flight() == GB
    assert fabric.next_completion(0.0) == pytest.approx(0.02 + LAT)
    assert fabric.advance(0.02) == []  # bytes sent, latency pending
    assert fabric.rate_of(tid) == 0.0
    assert fabric.bytes_in_flight() == 0
    assert fabric.active_count == 1
    assert fabric.advance(0.02 + LAT) == [tid]
    assert fabric.active_count == 0
    assert fabric.next_completion(1.0) is None
    with pytest.raises(KeyError):
        fabric.rate_of(tid)


def test_zero_byte_transfer_completes_after_latency() -> None:
    fabric = _fabric("a", "b")
    tid = fabric.start("a", "b", 0, now=1.0)
    assert fabric.next_completion(1.0) == pytest.approx(1.0 + LAT)
    assert fabric.advance(1.0) == []
    assert fabric.advance(1.0 + LAT) == [tid]


def test_two_transfers_from_one_source_share_its_egress() -> None:
    fabric = _fabric("a", "b", "c")
    t1 = fabric.start("a", "b", GB, now=0.0)
    t2 = fabric.start("a", "c", GB, now=0.0)
    assert fabric.rate_of(t1) == fabric.rate_of(t2) == 25e9
    assert fabric.bytes_in_flight(src="a") == 2 * GB
    assert fabric.bytes_in_flight(dst="c") == GB
    assert fabric.next_completion(0.0) == pytest.approx(0.04 + LAT)
    assert fabric.advance(0.04 + LAT) == [t1, t2]


def test_disjoint_pair_is_unaffected_without_spine() -> None:
    fabric = _fabric("a", "b", "c", "d")
    fabric.start("a", "b", GB, now=0.0)
    t2 = fabric.start("c", "d", GB, now=0.0)
    assert fabric.rate_of(t2) == 50e9
    assert fabric.advance(0.02 + LAT) == [1, t2]


def test_disjoint_pair_is_slowed_by_a_tight_spine() -> None:
    fabric = _fabric("a", "b", "c", "d", spine=60e9)
    t1 = fabric.start("a", "b", GB, now=0.0)
    assert fabric.rate_of(t1) == 50e9  # the spine alone does not bind one transfer
    t2 = fabric.start("c", "d", GB, now=0.0)
    assert fabric.rate_of(t1) == fabric.rate_of(t2) == 30e9
    assert fabric.next_completion(0.0) == pytest.approx(GB / 30e9 + LAT)


def test_max_min_fairness_gives_leftover_to_unconstrained_flows() -> None:
    # a -> b is limited to 10 GB/s by b's ingress; a -> c gets the rest of a's egress.
    fabric = Fabric()
    fabric.add_nic("a", 50e9, 50e9)
    fabric.add_nic("b", 50e9, 10e9)
    fabric.add_nic("c", 50e9, 50e9)
    slow = fabric.start("a", "b", GB, now=0.0)
    fast = fabric.start("a", "c", GB, now=0.0)
    assert fabric.rate_of(slow) == 10e9
    assert fabric.rate_of(fast) == 40e9


def test_transfer_starting_while_another_is_half_done() -> None:
    fabric = _fabric("a", "b", "c")
    t1 = fabric.start("a", "b", GB, now=0.0)
    # t1 is half done at 10 ms; from then both share a's egress at 25 GB/s.
    t2 = fabric.start("a", "c", GB, now=0.01)
    assert fabric.bytes_in_flight(dst="b") == GB // 2
    assert fabric.rate_of(t1) == 25e9
    # t1: 0.5 GB at 25 GB/s -> bytes done at 30 ms; t2 then has 0.5 GB left at 50 GB/s.
    assert fabric.next_completion(0.01) == pytest.approx(0.03 + LAT)
    assert fabric.advance(0.03 + LAT) == [t1]
    assert fabric.rate_of(t2) == 50e9
    assert fabric.next_completion(0.03 + LAT) == pytest.approx(0.04 + LAT)
    assert fabric.advance(0.05) == [t2]


def test_advance_past_several_events_is_exact() -> None:
    fabric = _fabric("a", "b", "c")
    t1 = fabric.start("a", "b", GB // 2, now=0.0)
    t2 = fabric.start("a", "c", GB, now=0.0)
    # both at 25 GB/s: t1 bytes done at 20 ms, then t2 (0.5 GB left) at 50 GB/s until 30 ms.
    assert fabric.advance(1.0) == [t1, t2]
    fabric2 = _fabric("a", "b", "c")
    fabric2.start("a", "b", GB // 2, now=0.0)
    fabric2.start("a", "c", GB, now=0.0)
    assert fabric2.advance(0.03 + LAT - 1e-9) == [1]
    assert fabric2.advance(0.03 + LAT) == [2]


def test_cancel_frees_capacity() -> None:
    fabric = _fabric("a", "b", "c")
    t1 = fabric.start("a", "b", GB, now=0.0)
    t2 = fabric.start("a", "c", GB, now=0.0)
    assert fabric.cancel(t1, now=0.02)  # t2 has 0.5 GB left, now alone
    assert fabric.rate_of(t2) == 50e9
    assert fabric.active_count == 1
    assert fabric.next_completion(0.02) == pytest.approx(0.03 + LAT)
    assert fabric.advance(1.0) == [t2]
    assert not fabric.cancel(t1, now=1.0)
    assert not fabric.cancel(t2, now=1.0)


def test_cancel_during_the_latency_tail() -> None:
    fabric = _fabric("a", "b")
    tid = fabric.start("a", "b", GB, now=0.0)
    fabric.advance(0.02)
    assert fabric.cancel(tid, now=0.02)
    assert fabric.next_completion(0.02) is None
    assert fabric.advance(1.0) == []


def test_completions_found_while_starting_are_reported_by_advance() -> None:
    fabric = _fabric("a", "b", "c")
    t1 = fabric.start("a", "b", GB, now=0.0)
    t2 = fabric.start("a", "c", GB, now=0.5)  # t1 completed long before
    assert fabric.rate_of(t2) == 50e9
    assert fabric.advance(0.5) == [t1]


def test_earlier_time_is_treated_as_the_last_one_seen() -> None:
    fabric = _fabric("a", "b")
    fabric.advance(1.0)
    tid = fabric.start("a", "b", GB, now=0.999)
    assert fabric.next_completion(1.0) == pytest.approx(1.02 + LAT)
    assert fabric.advance(1.02 + LAT) == [tid]


def test_next_completion_does_not_change_state() -> None:
    fabric = _fabric("a", "b", "c")
    fabric.start("a", "b", GB, now=0.0)
    fabric.start("a", "c", 2 * GB, now=0.0)
    first = fabric.next_completion(0.0)
    assert first == fabric.next_completion(0.0) == pytest.approx(0.04 + LAT)
    assert fabric.bytes_in_flight() == 3 * GB
    assert fabric.rate_of(1) == 25e9


@pytest.mark.parametrize(
    ("src", "dst", "nbytes", "error"),
    [("a", "zz", 1, KeyError), ("zz", "a", 1, KeyError), ("a", "b", -1, ValueError)],
)
def test_start_validation(src: str, dst: str, nbytes: int, error: type[Exception]) -> None:
    fabric = _fabric("a", "b")
    with pytest.raises(error):
        fabric.start(src, dst, nbytes, now=0.0)


def test_nic_validation() -> None:
    fabric = _fabric("a")
    assert fabric.has_nic("a") and not fabric.has_nic("b")
    with pytest.raises(ValueError):
        fabric.add_nic("a", 1.0, 1.0)
    with pytest.raises(ValueError):
        fabric.add_nic("b", 0.0, 1.0)
    with pytest.raises(ValueError):
        Fabric(spine_bps=0.0)
