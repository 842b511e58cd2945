from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Literal

import aiohttp
import pytest
from aiohttp import web

from router.fleet.telemetry import (
    Scraper,
    ScrapeTarget,
    WorkerHealth,
    WorkerLoad,
    next_tick,
    parse_worker_load,
)
from tests.conftest import free_port

MODEL = 'model_name="meta-llama/Llama-3.1-8B-Instruct \\"bf16\\""'

# Two data-parallel engines, as vLLM v1 (0.10+) writes them, with the noise a real page has.
VLLM_PAGE = f"""# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{{generation="0"}} 12345.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",{MODEL}}} 3.0
vllm:num_requests_running{{engine="1",{MODEL}}} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",{MODEL}}} 1.0
vllm:num_requests_waiting{{engine="1",{MODEL}}} 6.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",{MODEL}}} 0.25
vllm:kv_cache_usage_perc{{engine="1",{MODEL}}} 5.078125e-01
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",{MODEL}}} 1.2e+06
vllm:prefix_cache_queries_total{{engine="1",{MODEL}}} 34567.0
vllm:prefix_cache_queries_created{{engine="0",{MODEL}}} 1.7123456789e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",{MODEL}}} 900000.0
vllm:prefix_cache_hits_total{{engine="1",{MODEL}}} 4567.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_sum{{engine="0",{MODEL}}} 41.25
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.001",{MODEL}}} 0.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.5",{MODEL}}} 87.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",{MODEL}}} 120.0
vllm:time_to_first_token_seconds_count{{engine="0",{MODEL}}} 120.0
"""

# A v1 release from before the renames (gpu_ prefixes; prefix counters in blocks).
VLLM_OLD_PAGE = f"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",{MODEL}}} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",{MODEL}}} 0.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{{engine="0",{MODEL}}} 0.125
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{{engine="0",{MODEL}}} 640.0
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total{{engine="0",{MODEL}}} 320.0
"""

# SGLang with --dp 2 and --enable-metrics-for-all-schedulers: TP ranks 0 and 1 of dp_rank 0
# both report that scheduler's numbers; they must count once.
SG_LABELS = 'engine_type="unified",model_name="Qwen/Qwen3-8B",pp_rank="0"'
SGLANG_PAGE = f"""# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{dp_rank="0",{SG_LABELS},tp_rank="0"}} 7.0
sglang:num_running_reqs{{dp_rank="0",{SG_LABELS},tp_rank="1"}} 7.0
sglang:num_running_reqs{{dp_rank="1",{SG_LABELS},tp_rank="2"}} 5.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{dp_rank="0",{SG_LABELS},tp_rank="0"}} 2.0
sglang:num_queue_reqs{{dp_rank="0",{SG_LABELS},tp_rank="1"}} 2.0
sglang:num_queue_reqs{{dp_rank="1",{SG_LABELS},tp_rank="2"}} 1.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{{dp_rank="0",{SG_LABELS},tp_rank="0"}} 0.3125
sglang:token_usage{{dp_rank="1",{SG_LABELS},tp_rank="2"}} 0.75
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{{dp_rank="0",{SG_LABELS},tp_rank="0"}} 0.0075
"""

# A single SGLang server as its docs show it (model_name only).
SGLANG_SINGLE_PAGE = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
"""

PARTIAL_PAGE = """vllm:num_requests_running{engine="0"} 2
vllm:kv_cache_usage_perc{engine="0"} NaN
vllm:kv_cache_usage_perc{engine="1"} 0.5
"""


@pytest.mark.parametrize(
    ("text", "engine", "expected"),
    [
        (VLLM_PAGE, "vllm", WorkerLoad(5, 7, 0.5078125, 904567, 1234567, 99.0)),
        (VLLM_OLD_PAGE, "vllm", WorkerLoad(4, 0, 0.125, 320, 640, 99.0)),
        (SGLANG_PAGE, "sglang", WorkerLoad(12, 3, 0.75, None, None, 99.0)),
        (SGLANG_SINGLE_PAGE, "sglang", WorkerLoad(12, 0, 0.28, None, None, 99.0)),
        # Missing gauges count as 0, NaN series are ignored, no prefix counters means None.
        (PARTIAL_PAGE, "vllm", WorkerLoad(2, 0, 0.5, None, None, 99.0)),
    ],
    ids=["vllm", "vllm-old-names", "sglang-dp-tp", "sglang-single", "vllm-partial"],
)
def test_parse_worker_load(
    text: str, engine: Literal["vllm", "sglang"], expected: WorkerLoad
) -> None:
    assert parse_worker_load(text, engine, now=99.0) == expected


NOT_LOAD_PAGES = [(SGLANG_PAGE, "vllm"), (VLLM_PAGE, "sglang"), ("", "vllm"), ("<html/>", "vllm")]


@pytest.mark.parametrize(("text", "engine"), NOT_LOAD_PAGES)
def test_parse_worker_load_without_load_metrics(
    text: str, engine: Literal["vllm", "sglang"]
) -> None:
    with pytest.raises(ValueError, match=f"no {engine} load metrics"):
        parse_worker_load(text, engine, now=0.0)


# (results, expected healthy after each); "ok" a good scrape, "fail" a failed one,
# "refused" the proxy's mark_failed_now.
HEALTH_CASES = [
    (3, ["fail", "fail", "fail"], [True, True, False]),
    (3, ["fail", "fail", "ok", "fail", "fail", "fail"], [True, True, True, True, True, False]),
    (3, ["fail"] * 5 + ["ok"], [True, True, False, False, False, True]),
    (1, ["fail", "ok", "fail"], [False, True, False]),
    (3, ["refused", "fail", "ok"], [False, False, True]),
    (3, ["ok", "refused", "ok"], [True, False, True]),
]


HEALTH_STEPS: dict[str, Callable[[WorkerHealth], bool]] = {
    "ok": WorkerHealth.record_success,
    "fail": WorkerHealth.record_failure,
    "refused": WorkerHealth.mark_failed_now,
}


@pytest.mark.parametrize(("threshold", "results", "expected"), HEALTH_CASES)
def test_worker_health(threshold: int, results: list[str], expected: list[bool]) -> None:
    health = WorkerHealth(failure_threshold=threshold)
    seen = []
    previous = health.healthy
    for result in results:
        changed = HEALTH_STEPS[result](health)
        seen.append(health.healthy)
        assert changed == (health.healthy != previous)
        previous = health.healthy
    assert seen == expected


def test_worker_never_scraped_counts_as_healthy_but_unknown() -> None:
    health = WorkerHealth()
    assert (health.healthy, health.known) == (True, False)
    health.record_success()
    assert (health.healthy, health.known) == (True, True)
    with pytest.raises(ValueError):
        WorkerHealth(failure_threshold=0)


@pytest.mark.parametrize(
    ("previous", "interval", "now", "expected"),
    [
        (10.0, 0.25, 10.1, 10.25),  # on time
        (10.0, 0.25, 10.25, 10.5),  # exactly at the tick: that tick is already taken
        (10.0, 0.25, 10.3, 10.5),  # one tick missed
        (10.0, 0.25, 11.1, 11.25),  # four missed: skipped, not bunched
        (0.0, 1.0, 0.0, 1.0),
    ],
)
def test_next_tick(previous: float, interval: float, now: float, expected: float) -> None:
    assert next_tick(previous, interval, now) == expected


class FakeWorker:
    """An aiohttp server on 127.0.0.1 whose /metrics answers per `mode`."""

    def __init__(self, mode: str, page: str = VLLM_PAGE) -> None:
        self.mode = mode
        self.page = page
        self.port = free_port()
        self.hits = 0
        self.release = asyncio.Event()
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self.runner = web.AppRunner(app)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        self.release.set()
        await self.runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        self.hits += 1
        if self.mode == "hang":
            await self.release.wait()
        if self.mode == "error":
            return web.Response(status=500, text="internal error")
        if self.mode == "garbage":
            return web.Response(text="<html>not metrics</html>")
        return web.Response(text=self.page, content_type="text/plain")


Update = tuple[float, str, WorkerLoad | None, bool]


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


@pytest.fixture
def telemetry_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.INFO, logger="router.fleet.telemetry"):
        yield caplog


async def test_scraper_health_and_isolation(
    session: aiohttp.ClientSession, telemetry_logs: pytest.LogCaptureFixture
) -> None:
    timeout_s = 0.5
    # The hanging worker comes first, so a sequential scraper would fail the timing checks.
    workers = {mode: FakeWorker(mode) for mode in ("hang", "error", "ok")}
    for worker in workers.values():
        await worker.start()
    targets = [ScrapeTarget(name, w.url, "vllm") for name, w in workers.items()]
    targets.append(ScrapeTarget("closed", f"http://127.0.0.1:{free_port()}/", "vllm"))
    loop = asyncio.get_running_loop()
    updates: list[Update] = []
    scraper = Scraper(
        session,
        targets,
        interval_s=0.25,
        timeout_s=timeout_s,
        on_update=lambda wid, load, ok: updates.append((loop.time(), wid, load, ok)),
        clock=lambda: 1234.5,
    )

    async def round_() -> dict[str, tuple[float, WorkerLoad | None, bool]]:
        updates.clear()
        started = loop.time()
        await scraper.scrape_once()
        assert sorted(wid for _, wid, _, _ in updates) == ["closed", "error", "hang", "ok"]
        return {wid: (at - started, load, ok) for at, wid, load, ok in updates}

    try:
        expected_load = parse_worker_load(VLLM_PAGE, "vllm", now=1234.5)
        for attempt in (1, 2, 3, 4):
            got = await round_()
            failing_ok = attempt < 3
            assert got["ok"][1:] == (expected_load, True)
            # The healthy worker's update does not wait for the hanging one's timeout.
            assert got["ok"][0] < timeout_s / 2
            assert got["hang"][0] >= timeout_s * 0.9
            failing = ("error", "hang", "closed")
            for wid in failing:
                assert got[wid][1:] == (None, failing_ok), (wid, attempt)
            assert scraper.health() == {"ok": True} | dict.fromkeys(failing, failing_ok)
        unhealthy_logs = [r for r in telemetry_logs.records if "unhealthy after 3" in r.message]
        assert sorted(r.message.split()[1] for r in unhealthy_logs) == ["closed", "error", "hang"]

        workers["error"].mode = "ok"
        got = await round_()
        assert got["error"][1:] == (expected_load, True)
        assert scraper.health()["error"] is True
        assert scraper.loads()["error"] == expected_load
        assert "closed" not in scraper.loads()
        assert [r.message for r in telemetry_logs.records if "healthy again" in r.message] == [
            "worker error healthy again"
        ]

        # The proxy reports a refused connection: unhealthy at once, healed by a good scrape.
        updates.clear()
        scraper.mark_failed_now("ok")
        assert [(wid, load, ok) for _, wid, load, ok in updates] == [("ok", None, False)]
        assert scraper.health()["ok"] is False
        got = await round_()
        assert got["ok"][1:] == (expected_load, True)
    finally:
        for worker in workers.values():
            await worker.stop()


SINGLE_SCRAPES = [
    # (worker mode, page, engine, the one update expected); failure_threshold is 1.
    ("garbage", VLLM_PAGE, "vllm", ("w", None, False)),
    ("error", VLLM_PAGE, "vllm", ("w", None, False)),
    ("ok", VLLM_PAGE, "sglang", ("w", None, False)),  # wrong engine kind: unparseable
    ("ok", SGLANG_PAGE, "sglang", ("w", WorkerLoad(12, 3, 0.75, None, None, 7.0), True)),
]


@pytest.mark.parametrize(("mode", "page", "engine", "expected"), SINGLE_SCRAPES)
async def test_single_scrape(
    session: aiohttp.ClientSession,
    mode: str,
    page: str,
    engine: Literal["vllm", "sglang"],
    expected: tuple[str, WorkerLoad | None, bool],
) -> None:
    worker = FakeWorker(mode, page)
    await worker.start()
    updates: list[tuple[str, WorkerLoad | None, bool]] = []
    scraper = Scraper(
        session,
        [ScrapeTarget("w", worker.url, engine)],
        interval_s=1.0,
        timeout_s=2.0,
        on_update=lambda wid, load, ok: updates.append((wid, load, ok)),
        failure_threshold=1,
        clock=lambda: 7.0,
    )
    try:
        await scraper.scrape_once()
    finally:
        await worker.stop()
    assert updates == [expected]
    assert scraper.worker_health("w").consecutive_failures == (0 if expected[2] else 1)


async def test_running_scraper_is_not_held_up_by_a_hanging_worker(
    session: aiohttp.ClientSession,
) -> None:
    good, hang = FakeWorker("ok"), FakeWorker("hang")
    await good.start()
    await hang.start()
    counts = {"good": 0, "hang": 0}

    def on_update(worker_id: str, load: WorkerLoad | None, healthy: bool) -> None:
        counts[worker_id] += 1
        if worker_id == "good":
            raise RuntimeError("a broken callback must not stop the scraper")

    scraper = Scraper(
        session,
        [ScrapeTarget("good", good.url, "vllm"), ScrapeTarget("hang", hang.url, "vllm")],
        interval_s=0.05,
        timeout_s=30.0,
        on_update=on_update,
    )
    try:
        scraper.start()
        await asyncio.sleep(0.6)
        await scraper.stop()
        seen = dict(counts)
        await asyncio.sleep(0.15)
    finally:
        await good.stop()
        await hang.stop()
    # About 12 ticks in 0.6 s; the hanging worker's one pending scrape skips its ticks.
    assert seen["good"] >= 5
    assert seen["hang"] == 0
    assert hang.hits == 1
    assert counts == seen  # nothing runs after stop()


@pytest.mark.parametrize(
    ("duplicate", "interval_s", "message"),
    [(True, 1.0, "duplicate"), (False, 0.0, "positive")],
)
async def test_scraper_rejects_bad_configuration(
    session: aiohttp.ClientSession, duplicate: bool, interval_s: float, message: str
) -> None:
    target = ScrapeTarget("a", "http://127.0.0.1:1", "vllm")
    targets = [target, target] if duplicate else [target]
    with pytest.raises(ValueError, match=message):
        Scraper(session, targets, interval_s, 1.0, lambda wid, load, ok: None)
