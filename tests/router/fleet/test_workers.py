"""`WorkerPool`: the workers' views, and the requests begun since each worker's scrape."""

from __future__ import annotations

from policies.types import WorkerView, idle_link_bps
from router.config import WorkerSpec
from router.fleet.telemetry import WorkerLoad
from router.fleet.workers import WorkerPool, nic_bps
from router.obs.events import StageClock
from router.turn.legs import LegRunner


class _FleetCounts:
    """The shared state's in-flight ledger, as far as a leg uses it."""

    def __init__(self) -> None:
        self.inflight: dict[str, int] = {}

    def add_inflight(self, worker_id: str, delta: int) -> None:
        self.inflight[worker_id] = self.inflight.get(worker_id, 0) + delta


def _load(running: int, waiting: int) -> WorkerLoad:
    return WorkerLoad(running, waiting, 0.1, None, None, scraped_at=0.0)


def _view(pool: WorkerPool, fleet: _FleetCounts) -> tuple[int, int, int, int]:
    (view,) = pool.views(fleet.inflight, now=0.0)
    return view.running, view.waiting, view.inflight, view.started_since_scrape


def test_a_request_counts_as_begun_until_a_scrape_sees_it() -> None:
    pool = WorkerPool([WorkerSpec(url="http://127.0.0.1:9", id="w1")])
    fleet = _FleetCounts()
    legs = LegRunner(pool, fleet, StageClock(), lambda worker, kind: None)
    pool.on_scrape("w1", _load(0, 0), True)
    with legs.inflight("w1") as early, legs.inflight("w1") as late:
        assert _view(pool, fleet) == (0, 0, 2, 0)  # both sent since the scrape, not answering
        early.begin()
        early.begin()  # once
        assert _view(pool, fleet) == (0, 0, 2, 1)
        pool.on_scrape("w1", _load(1, 1), True)  # sees one answering, one queued
        assert _view(pool, fleet) == (1, 1, 2, 0)
        late.begin()
        assert _view(pool, fleet) == (1, 1, 2, 1)
        with legs.inflight("w1") as brief:
            brief.begin()
            assert _view(pool, fleet) == (1, 1, 3, 2)
        assert _view(pool, fleet) == (1, 1, 2, 1)
    # `early` began before the last scrape, which counted it: its end leaves the count alone.
    assert _view(pool, fleet) == (1, 1, 0, 0)
    with legs.inflight("w1") as after:
        after.begin()
        pool.on_scrape("w1", None, False)  # a failed scrape saw nothing: the count stays
        assert _view(pool, fleet) == (1, 1, 1, 1)
    assert _view(pool, fleet) == (1, 1, 0, 0)


def test_a_worker_view_carries_its_nic_rate_as_its_declared_links_take_it() -> None:
    """A view implies an idle link at its ends' lower NIC rate (`policies.types`): the rate
    the router declares the link at (`router.app`)."""
    pool = WorkerPool([WorkerSpec(url="http://127.0.0.1:9", id="w1", nic_gbps=200.0),
                       WorkerSpec(url="http://127.0.0.1:10", id="w2")])  # fmt: skip
    one, two = pool.views({}, now=0.0)
    assert (one.nic_bps, two.nic_bps) == (25e9, 50e9)
    assert idle_link_bps(one, two) == nic_bps(min(200.0, 400.0))


def test_a_view_is_shared_until_what_it_shows_changes() -> None:
    """The policy re-ranks only the workers whose views are new objects
    (`policies.adaptive.fleet`): a worker's view is built again on a scrape, a change of its
    in-flight counts or its health, and the tuple is the same while no view changed."""
    pool = WorkerPool([WorkerSpec(url=f"http://127.0.0.1:{9 + i}", id=f"w{i}") for i in range(3)])
    inflight: dict[str, int] = {}
    for i in range(3):
        pool.on_scrape(f"w{i}", WorkerLoad(i, 0, 0.1, None, None, scraped_at=5.0), True)
    first = pool.views(inflight, now=6.0)
    assert pool.views(inflight, now=7.0) is first
    assert [(v.scraped_at_s, v.scraped_age_s) for v in first] == [(5.0, 1.0)] * 3
    assert first[0].scraped_at(7.0) == 5.0  # its age as of the turn's now

    def changed(views: tuple[WorkerView, ...], before: tuple[WorkerView, ...]) -> list[str]:
        return [v.worker_id for v, b in zip(views, before, strict=True) if v is not b]

    pool.on_scrape("w1", WorkerLoad(4, 2, 0.5, None, None, scraped_at=8.0), True)
    second = pool.views(inflight, now=8.5)
    assert changed(second, first) == ["w1"]
    assert (second[1].running, second[1].waiting, second[1].scraped_at_s) == (4, 2, 8.0)
    inflight = {"w2": 3}  # another replica's requests: a new snapshot of the fleet's counts
    third = pool.views(inflight, now=9.0)
    assert changed(third, second) == ["w2"] and third[2].inflight == 3
    pool.on_scrape("w0", None, False)  # unhealthy: no load read
    fourth = pool.views(inflight, now=9.5)
    assert changed(fourth, third) == ["w0"] and not fourth[0].healthy
    assert pool.views(inflight, now=10.0) is fourth
