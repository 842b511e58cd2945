"""Outlier ejection in `WorkerPool`, Envoy's consecutive-5xx detector: failed legs in a row eject
a worker for base x times ejected (capped), at most max_percent of the fleet at once; a success
resets the run; an ejected worker is unhealthy to the policy until its time is up. Then through
the router: a worker answering 500 to every turn, or a prefill worker failing every handoff,
stops getting work, and /metrics and /admin/workers say so."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from router.config import WorkerSpec
from router.fleet.workers import EjectionConfig, WorkerPool
from tests.router.turn.fake_upstream import WAIT_S, Stack, spec


class Clock:
    """A monotonic clock the test moves, counting its reads."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


def fleet(
    n: int, clock: Clock, calls: list[tuple[str, bool, int]] | None = None, **config: Any
) -> WorkerPool:
    specs = [WorkerSpec(url=f"http://127.0.0.1:{9000 + i}", id=f"w{i}") for i in range(n)]
    hook = None if calls is None else lambda w, e, k: calls.append((w, e, k))
    options = {"consecutive_failures": 3, "base_s": 10.0, "max_s": 25.0, **config}
    return WorkerPool(specs, EjectionConfig(**options), hook, clock)


def healthy_in_view(pool: WorkerPool) -> dict[str, bool]:
    return {view.worker_id: view.healthy for view in pool.views({}, now=0.0)}


def test_failures_in_a_row_eject_a_worker_and_a_success_resets_the_run() -> None:
    clock = Clock()
    calls: list[tuple[str, bool, int]] = []
    pool = fleet(3, clock, calls)
    assert not pool.record_failure("w0") and not pool.record_failure("w0")
    pool.record_success("w0")  # the run ends: two more failures are not enough
    assert not pool.record_failure("w0") and not pool.record_failure("w0")
    assert healthy_in_view(pool) == {"w0": True, "w1": True, "w2": True}
    assert pool.record_failure("w0")  # the third in a row
    assert calls == [("w0", True, 1)]
    assert healthy_in_view(pool) == {"w0": False, "w1": True, "w2": True}
    assert pool.healthy_count() == 2 and pool.workers["w0"].healthy  # its scrapes are fine
    assert pool.ejected_for("w0") == 10.0 and pool.ejected_for("w1") == 0.0
    assert not pool.record_failure("w0")  # legs still in flight fail: no second ejection
    clock.now += 10.0
    assert pool.healthy_count() == 3  # back once its time is up
    assert healthy_in_view(pool) == {"w0": True, "w1": True, "w2": True}
    assert calls[-1] == ("w0", False, 0)
    assert pool.workers["w0"].consecutive_failures == 0 and pool.workers["w0"].ejections == 1


def test_each_ejection_lasts_longer_up_to_the_cap_and_the_multiplier_decays() -> None:
    clock = Clock()
    pool = fleet(2, clock, consecutive_failures=1)
    lasted = []
    for _ in range(3):
        assert pool.record_failure("w0")
        lasted.append(pool.ejected_for("w0"))
        clock.now += lasted[-1]
        pool.healthy_count()  # it returns
    assert lasted == [10.0, 20.0, 25.0]  # base x times ejected, capped at max_s
    clock.now += 2 * 10.0  # two base periods in service: the multiplier drops by two
    assert pool.record_failure("w0")
    assert pool.ejected_for("w0") == 20.0
    assert pool.workers["w0"].ejections == 4


@pytest.mark.parametrize(
    ("workers", "percent", "ejectable"),
    [(4, 50.0, 2), (3, 50.0, 1), (2, 50.0, 1), (1, 50.0, 0), (1, 100.0, 1), (10, 10.0, 1),
     (4, 0.0, 1)],
)  # fmt: skip
def test_never_more_than_max_percent_of_the_fleet_is_ejected(
    workers: int, percent: float, ejectable: int
) -> None:
    """As Envoy: the first ejection always happens (when another worker is left)."""
    clock = Clock()
    pool = fleet(workers, clock, consecutive_failures=1, max_percent=percent)
    ejected = [w for w in list(pool.workers) if pool.record_failure(w)]
    assert len(ejected) == ejectable
    assert pool.healthy_count() == workers - ejectable
    if ejectable and ejectable < workers:
        # a worker refused for lack of room is ejected once room is made, failing still
        clock.now += 10.0
        assert pool.healthy_count() == workers
        assert pool.record_failure(list(pool.workers)[-1])


def test_a_turn_reads_no_clock_while_no_worker_is_ejected() -> None:
    """Ejections end by their own schedule, not by a scan on every turn: with none, a turn's
    reads (`healthy_count`, `views`) cost no clock read; with one, a clock read each."""
    clock = Clock()
    pool = fleet(64, clock, consecutive_failures=1)
    pool.healthy_count()
    pool.views({}, now=0.0)
    pool.record_success("w3")
    assert clock.reads == 0
    pool.record_failure("w3")
    reads = clock.reads
    pool.healthy_count()
    pool.views({}, now=0.0)
    assert clock.reads == reads + 2


def test_a_worker_never_fails_into_ejection_when_ejection_is_off() -> None:
    pool = fleet(4, Clock(), consecutive_failures=0)
    assert not any(pool.record_failure("w0") for _ in range(50))
    assert pool.healthy_count() == 4


async def test_an_ejection_ends_on_its_own_without_turns() -> None:
    """In a running loop a timer brings the worker back (and tells the metrics) on time."""
    calls: list[tuple[str, bool, int]] = []
    back = asyncio.Event()

    def hook(worker: str, ejected: bool, count: int) -> None:
        calls.append((worker, ejected, count))
        if not ejected:
            back.set()

    specs = [WorkerSpec(url=f"http://127.0.0.1:{9000 + i}", id=f"w{i}") for i in range(2)]
    pool = WorkerPool(specs, EjectionConfig(consecutive_failures=1, base_s=0.05), hook)
    assert pool.record_failure("w1")
    async with asyncio.timeout(WAIT_S):
        await back.wait()
    assert calls == [("w1", True, 1), ("w1", False, 0)]
    assert not pool.workers["w1"].ejected
    await pool.close()


# -- through the router --------------------------------------------------------------------


@pytest.fixture
async def stack(redis_url: str) -> AsyncIterator[Stack]:
    async with Stack(redis_url) as stack:
        yield stack


def chat_body(text: str = "hello") -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 5}


async def post(stack: Stack, url: str, session: str) -> tuple[int, Any]:
    async with stack.http.post(url + "/v1/chat/completions", json=chat_body(session),
                               headers={"X-Session-ID": session}) as response:  # fmt: skip
        return response.status, await response.json()


async def admin_workers(stack: Stack, router: Any) -> dict[str, dict[str, Any]]:
    async with stack.http.get(router.url + "/admin/workers", headers=router.admin) as response:
        assert response.status == 200
        return {row["id"]: row for row in (await response.json())["workers"]}


async def test_a_worker_answering_500_to_every_turn_is_ejected_and_gets_no_new_sessions(
    stack: Stack,
) -> None:
    a = await stack.worker("a")  # a new session's least-loaded tie goes to `a`
    b = await stack.worker("b")
    a.fail_always("status", status=500)
    router = await stack.router([spec(a), spec(b)], eject_consecutive_failures=3)
    statuses = [(await post(stack, router.url, f"s{i}"))[0] for i in range(6)]
    # three new sessions fail on `a`, which is then ejected: the next ones go to `b`
    assert statuses == [500, 500, 500, 200, 200, 200]
    assert len(a.received) == 3 and len(b.received) == 3
    rows = await admin_workers(stack, router)
    assert rows["a"]["ejected"] is True and rows["a"]["ejections"] == 1
    assert rows["a"]["ejected_for_s"] > 0 and rows["a"]["healthy"] is True  # it scrapes fine
    assert rows["b"]["ejected"] is False and rows["b"]["ejections"] == 0
    assert (
        await router.metric(stack.http, "session_router_worker_ejections_total", 'worker="a"') == 1
    )
    assert (
        await router.metric(stack.http, "session_router_worker_ejections_total", 'worker="b"') == 0
    )
    assert await router.metric(stack.http, "session_router_workers_ejected") == 1


async def test_a_failing_prefill_worker_is_ejected_and_handoffs_use_another(
    stack: Stack,
) -> None:
    a = await stack.worker("a")  # the least-loaded prefill tie goes to `a`
    b = await stack.worker("b")
    d = await stack.worker("d")
    a.fail_always("status", status=500)
    router = await stack.router([spec(a, "prefill"), spec(b, "prefill"), spec(d, "decode")],
                                "disaggregate", eject_consecutive_failures=2)  # fmt: skip
    for i in range(4):
        status, reply = await post(stack, router.url, f"p{i}")
        assert status == 200 and reply["choices"][0]["message"]["content"] == " d0 d1 d2"
    events = await router.decisions(stack.http, limit=4)
    prefill = [event["prefill_worker"] for event in reversed(events)]
    recomputed = [bool(event["recomputed_tokens"]) for event in reversed(events)]
    # two handoffs fail on `a` (the decode worker prefills itself), then `b` prefills
    assert prefill == ["a", "a", "b", "b"] and recomputed == [True, True, False, False]
    assert len(a.received) == 2 and len(b.received) == 2
    rows = await admin_workers(stack, router)
    assert rows["a"]["ejected"] is True
