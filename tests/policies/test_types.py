"""`policies.types`: the links a view leaves out, implied by its workers' NICs."""

from __future__ import annotations

import pytest

from policies.adaptive.params import AdaptiveParams
from policies.adaptive.scoring import Scorer
from policies.costmodel.estimates import Estimates
from policies.types import ClusterView, LinkView, Objectives, Turn, WorkerView, idle_link_bps


def _worker(wid: str, role: str, nic_bps: float = 50e9) -> WorkerView:
    return WorkerView(worker_id=wid, role=role, healthy=True, nic_bps=nic_bps)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("src", "dst", "rate"),
    [
        (_worker("a", "mixed"), _worker("b", "mixed", 25e9), 25e9),
        (_worker("a", "prefill"), _worker("b", "decode"), 50e9),
        (_worker("a", "decode"), _worker("b", "mixed"), 0.0),  # a decode worker sends none
        (_worker("a", "mixed"), _worker("b", "prefill"), 0.0),  # a prefill worker takes none
        (_worker("a", "mixed"), _worker("a", "mixed"), 0.0),  # no link to itself
        (_worker("a", "mixed", 0.0), _worker("b", "mixed"), 0.0),  # a NIC rate not known
        (None, _worker("b", "mixed"), 0.0),
    ],
)
def test_idle_link_rate(src: WorkerView | None, dst: WorkerView | None, rate: float) -> None:
    assert idle_link_bps(src, dst) == rate


def test_a_view_answers_a_link_it_leaves_out_as_idle() -> None:
    listed = LinkView(src="b", dst="a", capacity_bps=1e9, reserved_bytes=5)
    view = ClusterView(now_s=0.0, workers=(_worker("a", "mixed"), _worker("b", "mixed", 40e9)),
                       links=(listed,))  # fmt: skip
    assert view.link("b", "a") is listed
    assert view.link("a", "b") == LinkView(src="a", dst="b", capacity_bps=40e9)
    assert view.link("a", "c") is None


@pytest.mark.parametrize("nbytes", [1, 4096, 3 << 30])
def test_a_link_left_out_is_priced_as_the_idle_link_listed(nbytes: int) -> None:
    """The adaptive policy's transfer time over an implied link is the listed idle one's,
    to the last bit."""
    workers = (_worker("a", "mixed", 50e9), _worker("b", "mixed", 25e9))
    turn = Turn(session_id="s", request_id="r", prompt_tokens=100, uncached_tokens=100,
                max_tokens=10, objectives=Objectives(ttft_ms=1000.0, itl_ms=50.0),
                arrival_s=0.0)  # fmt: skip
    params = AdaptiveParams()
    estimates = Estimates.from_presets(params.gpu, params.model, params.tp)
    idle = LinkView(src="a", dst="b", capacity_bps=25e9)
    times = []
    for links in ({}, {("a", "b"): idle}):
        scorer = Scorer(turn, ClusterView(now_s=0.0, workers=workers), estimates, links=links,
                        horizon_s=1.0, default_bps=1e9)  # fmt: skip
        times.append(scorer.transfer_ms("a", "b", nbytes, start_ms=5.0))
    assert times[0] == times[1] == nbytes / 25e9 * 1000.0


@pytest.mark.parametrize(
    ("scraped_at_s", "age_s", "expected"), [(None, 0.25, 9.75), (9.5, 0.0, 9.5), (9.5, 3.0, 9.5)]
)
def test_a_worker_scrape_time_is_its_own_or_now_less_its_age(
    scraped_at_s: float | None, age_s: float, expected: float
) -> None:
    worker = WorkerView(worker_id="a", role="mixed", healthy=True, scraped_age_s=age_s,
                        scraped_at_s=scraped_at_s)  # fmt: skip
    assert worker.scraped_at(10.0) == expected
