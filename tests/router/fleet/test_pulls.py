"""The KV pull meter: seconds per byte from an engine's cumulative pull counters, and what
the router reads of them from a real vLLM 0.32 decode engine's /metrics page."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.fleet.pulls import WINDOW_PULLS, PullMeter
from router.fleet.telemetry import WorkerLoad, parse_worker_load

CAPTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vllm_0_32"


def _load(pulls: int | None, seconds: float | None, nbytes: float | None) -> WorkerLoad:
    return WorkerLoad(running=0, waiting=0, kv_usage=0.0, prefix_hits=None,
                      prefix_queries=None, scraped_at=0.0, pulls=pulls,
                      pull_seconds=seconds, pull_bytes=nbytes)  # fmt: skip


def test_real_decode_page_gives_the_pull_counters() -> None:
    # one NIXL handoff of 1,107 prompt tokens: 9 blocks of 128 tokens at 1,024 bytes a token
    page = (CAPTURES / "decode_metrics.txt").read_text()
    load = parse_worker_load(page, "vllm", now=5.0)
    assert (load.pulls, load.pull_seconds, load.pull_bytes) == (1, 0.009049, 1_179_648.0)
    assert load.kv_usage == 0.0 and load.running == 0


def test_real_prefill_page_has_no_pulls() -> None:
    page = (CAPTURES / "prefill_metrics.txt").read_text()
    load = parse_worker_load(page, "vllm", now=5.0)
    assert load.pulls == 0 and load.pull_bytes == 0.0


def test_sglang_pages_carry_no_pull_counters() -> None:
    page = "sglang:num_running_reqs 1\nsglang:num_queue_reqs 0\nsglang:token_usage 0.5\n"
    load = parse_worker_load(page, "sglang", now=1.0)
    assert (load.pulls, load.pull_seconds, load.pull_bytes) == (None, None, None)


@pytest.mark.parametrize(
    ("scrapes", "expected"),
    [
        # the first scrape is the baseline: what came before the router is not priced
        ([(3, 0.3, 3000.0)], None),
        ([(0, 0.0, 0.0), (0, 0.0, 0.0)], None),
        ([(0, 0.0, 0.0), (1, 0.01, 1000.0)], 1e-5),
        # two intervals with pulls: their seconds over their bytes
        ([(0, 0.0, 0.0), (1, 0.01, 1000.0), (3, 0.05, 2000.0)], 0.05 / 2000),
        # a small pull that waited prices its own bytes, not every byte after it
        ([(0, 0.0, 0.0), (1, 0.01, 1000.0), (2, 0.02, 1100.0)], 0.02 / 1100),
        # an interval without pulls changes nothing
        ([(0, 0.0, 0.0), (1, 0.01, 1000.0), (1, 0.01, 1000.0)], 1e-5),
        # the window: the oldest interval leaves once the newer ones hold WINDOW_PULLS pulls
        ([(0, 0.0, 0.0), (1, 1.0, 1000.0), (1 + WINDOW_PULLS, 1.01, 2000.0)], 1e-5),
        ([(0, 0.0, 0.0), (1, 1.0, 1000.0), (WINDOW_PULLS, 1.01, 2000.0)], 1.01 / 2000),
        # the engine restarted: its counters went down, the next growth counts from there
        ([(0, 0.0, 0.0), (5, 0.05, 5000.0), (1, 0.5, 1000.0), (2, 0.51, 2000.0)], 0.06 / 6000),
        # an engine without the counters
        ([(None, None, None), (None, None, None)], None),
    ],
)
def test_meter_prices_bytes_at_the_measured_rate(
    scrapes: list[tuple[int | None, float | None, float | None]], expected: float | None
) -> None:
    meter = PullMeter()
    for pulls, seconds, nbytes in scrapes:
        meter.update(_load(pulls, seconds, nbytes))
    if expected is None:
        assert meter.seconds_for(1000) is None
    else:
        assert meter.seconds_for(1000) == pytest.approx(1000 * expected)
