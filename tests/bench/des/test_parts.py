"""Pieces of the simulator: the goodput search, worker roles, the link ledger, the clusters."""

from __future__ import annotations

import math

import msgspec
import pytest

from bench.cli_simulate import params_by_policy
from bench.des.goodput import GoodputSearch, goodput_search
from bench.des.ledger import LinkLedger
from bench.des.loop import EventLoop
from bench.stack.layout import ClusterSpec, hardware_params, worker_roles
from policies.adaptive.policy import AdaptiveParams


def drive(threshold: float, **kwargs: float) -> GoodputSearch:
    """Run a search against attainment 1.0 up to `threshold`, 0.5 above it."""
    search = goodput_search(**kwargs)
    scale = next(search)
    try:
        while True:
            scale = search.send(1.0 if scale <= threshold else 0.5)
    except StopIteration as stop:
        result: GoodputSearch = stop.value
        return result


@pytest.mark.parametrize("threshold", [0.01, 0.37, 1.0, 1.5, 3.7, 100.0])
def test_goodput_search_brackets_the_threshold_within_tolerance(threshold: float) -> None:
    result = drive(threshold)
    assert result.best_scale is not None and result.failing_scale is not None
    assert result.best_scale <= threshold < result.failing_scale
    assert result.failing_scale / result.best_scale <= 1.05
    attained = {p.rate_scale: p.attainment for p in result.probes}
    assert attained[result.best_scale] == 1.0 and attained[result.failing_scale] == 0.5
    assert len(result.probes) == len(attained)  # no scale probed twice


def test_goodput_search_probes_doubling_then_bisects() -> None:
    result = drive(3.0)
    scales = [p.rate_scale for p in result.probes]
    assert scales[:3] == [1.0, 2.0, 4.0]
    assert scales[3] == pytest.approx(math.sqrt(8.0))


@pytest.mark.parametrize(
    ("threshold", "best", "failing"), [(1e-6, None, 1.0 / 1024), (1e9, 1024.0, None)]
)
def test_goodput_search_stops_at_its_floor_and_ceiling(
    threshold: float, best: float | None, failing: float | None
) -> None:
    result = drive(threshold)
    assert (result.best_scale, result.failing_scale) == (best, failing)


@pytest.mark.parametrize(
    ("policy", "workers", "prefill", "roles"),
    [
        ("colocate", 4, None, ["mixed"] * 4),
        ("colocate", 4, 3, ["mixed"] * 4),
        ("disaggregate", 8, None, ["prefill"] * 2 + ["decode"] * 6),
        ("threshold", 3, None, ["prefill", "decode", "decode"]),
        ("adaptive", 8, 3, ["prefill"] * 3 + ["decode"] * 5),
        ("adaptive", 4, None, ["mixed"] * 4),
        ("round-robin", 2, None, ["prefill", "decode"]),
        ("my.plugin:Policy", 4, None, ["prefill", "decode", "decode", "decode"]),
    ],
)
def test_worker_roles(policy: str, workers: int, prefill: int | None, roles: list[str]) -> None:
    assert worker_roles(policy, workers, prefill) == roles


@pytest.mark.parametrize(("workers", "prefill"), [(1, None), (4, 0), (4, 4)])
def test_worker_roles_refuse_a_split_without_both_roles(workers: int, prefill: int | None) -> None:
    with pytest.raises(ValueError, match="prefill workers"):
        worker_roles("disaggregate", workers, prefill)


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("8xh200-sxm/llama-3.1-8b", ClusterSpec(8, "h200-sxm", "llama-3.1-8b")),
        (" 2xa100-80g/llama-3.1-70b ", ClusterSpec(2, "a100-80g", "llama-3.1-70b")),
    ],
)
def test_cluster_spec_parses(text: str, spec: ClusterSpec) -> None:
    assert ClusterSpec.parse(text) == spec


@pytest.mark.parametrize("text", ["8 h200/llama", "0xh200-sxm/llama-3.1-8b", "h200-sxm"])
def test_cluster_spec_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="cluster"):
        ClusterSpec.parse(text)


def test_hardware_params_fill_what_the_policy_declares_and_the_user_left_out() -> None:
    cluster = ClusterSpec(4, "h100-sxm", "llama-3.1-70b", tp=2)
    filled = hardware_params(AdaptiveParams, {"model": "llama-3.1-8b"}, cluster, 512, 1024)
    assert filled == {"model": "llama-3.1-8b", "gpu": "h100-sxm", "tp": 2, "chunked_prefill": 512,
                      "max_num_seqs": 1024}  # fmt: skip
    assert "max_num_seqs" not in hardware_params(AdaptiveParams, {}, cluster)
    assert hardware_params(None, {"threshold": "9"}, cluster) == {"threshold": "9"}


def test_params_by_policy_splits_on_the_last_colon() -> None:
    given = ["threshold:threshold=9", "pkg.mod:Cls:depth=2", "pkg.mod:Cls:k=v=w"]
    assert params_by_policy(given) == {
        "threshold": {"threshold": "9"},
        "pkg.mod:Cls": {"depth": "2", "k": "v=w"},
    }
    with pytest.raises(ValueError, match="POLICY:KEY=VALUE"):
        params_by_policy(["threshold=9"])


def ledger(lease_s: float = 10.0) -> LinkLedger:
    return LinkLedger([("a", "b", 100.0)], lease_s=lease_s, ewma_alpha=0.5)


def test_ledger_admits_handoffs_always_and_migrations_within_rate_times_lease() -> None:
    book = ledger()
    handoff = book.reserve("a", "b", 5000, "handoff", 0.0)  # over rate x lease: still admitted
    assert handoff is not None
    assert book.reserve("a", "b", 1, "migration", 0.0) is None
    book.release(handoff, 0, 0.0)
    migration = book.reserve("a", "b", 600, "migration", 0.0)
    assert migration is not None
    assert book.reserve("a", "b", 401, "migration", 0.0) is None
    assert book.reserve("a", "b", 400, "migration", 0.0) is not None
    [view] = book.views(0.0)
    assert (view.reserved_bytes, view.bytes_in_flight, view.capacity_bps) == (0, 1000, 100.0)


def test_ledger_leases_expire_and_releases_teach_the_observed_rate() -> None:
    book = ledger(lease_s=1.0)
    first = book.reserve("a", "b", 70, "handoff", 0.0)
    assert first is not None
    assert book.views(0.5)[0].reserved_bytes == 70
    assert book.views(1.0)[0].reserved_bytes == 0  # the lease ran out
    book.release(first, 80, 2.0)  # released late: nothing to drop, the rate still counts
    assert book.views(1.0)[0].observed_bps == 40.0
    second = book.reserve("a", "b", 10, "handoff", 1.0)
    assert second is not None
    book.release(second, 100, 1.0)
    assert book.views(1.0)[0].observed_bps == 0.5 * 100 + 0.5 * 40


def test_ledger_undeclared_links_admit_a_migration_only_when_idle() -> None:
    book = ledger()
    first = book.reserve("b", "a", 10**12, "migration", 0.0)
    assert first is not None
    assert book.reserve("b", "a", 1, "migration", 0.0) is None
    views = {(v.src, v.dst): v for v in book.views(0.0)}
    assert views[("b", "a")].capacity_bps == 0.0


def test_event_loop_runs_in_time_then_schedule_order_and_stops() -> None:
    loop = EventLoop()
    seen: list[tuple[float, str]] = []

    def note(label: str) -> None:
        seen.append((loop.now(), label))
        if label == "b":
            loop.at(loop.now(), note, "b-again")
        if label == "stop":
            loop.stop()
            loop.at(loop.now() + 1, note, "never")

    for time, label in [(2, "c"), (1.0, "a"), (1.0, "b"), (3.0, "stop"), (4.0, "late")]:
        loop.at(time, note, label)
    loop.run()
    assert seen == [(1.0, "a"), (1.0, "b"), (1.0, "b-again"), (2.0, "c"), (3.0, "stop")]
    assert loop.events == 5
    assert all(type(time) is float for time, _ in seen)  # an int time reads back as a float
    with pytest.raises(ValueError, match="past"):
        EventLoop().at(-1.0, note, "x")


def test_goodput_search_arguments_are_checked() -> None:
    with pytest.raises(ValueError):
        next(goodput_search(target=0.0))
    with pytest.raises(ValueError):
        next(goodput_search(start=2000.0))
    assert msgspec.json.decode(msgspec.json.encode(drive(2.0)), type=GoodputSearch) == drive(2.0)


def test_ledger_lists_the_links_a_view_cannot_imply() -> None:
    """An idle link at the rate its NICs imply is left out of the view; one holding bytes, or
    declared at another rate, or not declared at all (made by a reservation) is listed."""
    implied = {("a", "b"): 100.0, ("b", "a"): 100.0, ("a", "c"): 100.0}
    declared = [("a", "b", 100.0), ("b", "a", 100.0), ("a", "c", 50.0)]
    ledger = LinkLedger(declared, lease_s=10.0, ewma_alpha=0.5,
                        implied=lambda s, d: implied.get((s, d), 0.0))  # fmt: skip
    assert [(v.src, v.dst) for v in ledger.views(0.0)] == [("a", "c")]
    reservation = ledger.reserve("a", "b", 40, "handoff", now=0.0)
    assert reservation is not None
    listed = {(v.src, v.dst): v for v in ledger.views(0.0)}
    assert set(listed) == {("a", "c"), ("a", "b")} and listed[("a", "b")].reserved_bytes == 40
    ledger.release(reservation, 40, 1.0)
    assert [(v.src, v.dst) for v in ledger.views(1.0)] == [("a", "c")]
    ledger.reserve("c", "b", 10, "handoff", now=1.0)  # undeclared: no capacity
    assert {(v.src, v.dst) for v in ledger.views(1.0)} == {("a", "c"), ("c", "b")}
    expired = ledger.views(20.0)  # its lease over, it stays listed: no capacity is implied
    assert {(v.src, v.dst) for v in expired} == {("a", "c"), ("c", "b")}
    assert all(v.reserved_bytes == 0 for v in expired)
