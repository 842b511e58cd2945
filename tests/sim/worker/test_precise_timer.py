"""The simulated workers' step timer: never early, in deadline order, cancellable."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from sim.worker.precise_timer import PreciseTimer


@pytest.fixture
def timer() -> Iterator[PreciseTimer]:
    timer = PreciseTimer()
    yield timer


async def test_wakes_not_before_the_deadline_and_in_deadline_order(timer: PreciseTimer) -> None:
    woke: list[tuple[int, float, float]] = []
    start = time.monotonic()

    async def sleeper(index: int, after_s: float) -> None:
        deadline = start + after_s
        await timer.sleep_until(deadline)
        woke.append((index, deadline, time.monotonic()))

    delays = [0.03, 0.005, 0.02, 0.012, 0.001]
    await asyncio.gather(*(sleeper(i, d) for i, d in enumerate(delays)))
    assert [index for index, _, _ in woke] == sorted(range(5), key=lambda i: delays[i])
    assert all(now >= deadline for _, deadline, now in woke)


async def test_a_past_deadline_returns_at_once(timer: PreciseTimer) -> None:
    await asyncio.wait_for(timer.sleep_until(time.monotonic() - 1.0), timeout=1.0)


async def test_a_cancelled_sleeper_does_not_disturb_the_others(timer: PreciseTimer) -> None:
    start = time.monotonic()
    doomed = asyncio.ensure_future(timer.sleep_until(start + 0.01))
    kept = asyncio.ensure_future(timer.sleep_until(start + 0.02))
    await asyncio.sleep(0)
    doomed.cancel()
    await kept
    assert doomed.cancelled()
    assert time.monotonic() >= start + 0.02
