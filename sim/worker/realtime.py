"""Drive the clock-free engine and link fabric in real time on an asyncio loop.

The engine never sleeps: it plans a step and says how long it takes. This module waits for that
time (on `sim.worker.precise_timer`, not the loop's millisecond timers) and applies the step. Steps
run on a schedule clock that advances by the modelled step durations, so a late wake-up delays
when tokens are delivered but never accumulates into the schedule; only a lag beyond
`max_schedule_slip_s` (an overloaded process) resyncs the schedule to real time.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Final, NamedTuple

from sim.engine.engine import Engine, StepOutput
from sim.fabric.links import Fabric
from sim.worker.precise_timer import PreciseTimer

_IDLE_POLL_S: Final = 1.0


class ScheduleClock:
    """The engine's clock: real monotonic time when idle, the step schedule when busy."""

    def __init__(self) -> None:
        self._schedule: float | None = None

    def now(self) -> float:
        return time.monotonic() if self._schedule is None else self._schedule

    def hold(self, at: float) -> None:
        self._schedule = at

    def release(self) -> None:
        self._schedule = None


class LagStats:
    """Wake-up lag of scheduled steps behind their planned end, in seconds (bounded sample)."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.samples: list[float] = []
        self._capacity = capacity

    def add(self, lag: float) -> None:
        if len(self.samples) < self._capacity:
            self.samples.append(lag)


class EngineRunner:
    """Runs one engine's steps back to back while it has work; sleeps when idle."""

    def __init__(
        self,
        engine: Engine,
        clock: ScheduleClock,
        on_outputs: Callable[[list[StepOutput]], None],
        max_schedule_slip_s: float = 0.005,
    ) -> None:
        self.engine = engine
        self._clock = clock
        self._on_outputs = on_outputs
        self._max_slip = max_schedule_slip_s
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.lag = LagStats()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-runner")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def wake(self) -> None:
        """Call after adding or aborting work so an idle engine plans its next step."""
        self._wakeup.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        schedule: float | None = None
        while True:
            self.engine.expire_held()
            real_now = time.monotonic()
            if schedule is None or real_now - schedule > self._max_slip:
                schedule = real_now
            self._clock.hold(schedule)
            duration = self.engine.begin_step()
            if duration is None:
                self._clock.release()
                schedule = None
                await self._idle(loop)
                continue
            target = schedule + duration
            await _timer().sleep_until(target)
            self.lag.add(time.monotonic() - target)
            schedule = target
            self._clock.hold(schedule)
            outputs = self.engine.finish_step()
            if outputs:
                self._on_outputs(outputs)

    async def _idle(self, loop: asyncio.AbstractEventLoop) -> None:
        self._wakeup.clear()
        if self.engine.has_work():
            # Work that cannot be scheduled yet (e.g. no free KV blocks and nothing running to
            # free them): wait for an abort or a release instead of spinning.
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout=0.01)
            except TimeoutError:
                pass
            return
        deadline = self.engine.next_held_deadline()
        timeout = _IDLE_POLL_S if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            await asyncio.wait_for(self._wakeup.wait(), timeout=min(timeout, _IDLE_POLL_S))
        except TimeoutError:
            pass


_shared_timer: tuple[int, PreciseTimer] | None = None


def _timer() -> PreciseTimer:
    """The process's one precise timer thread, started on first use (again in a forked child,
    which inherits the object but not the thread)."""
    global _shared_timer
    if _shared_timer is None or _shared_timer[0] != os.getpid():
        _shared_timer = (os.getpid(), PreciseTimer())
    return _shared_timer[1]


class TransferTime(NamedTuple):
    """One transfer's times: the whole of it, and posting it (what this process spent handing
    it to the link model, as NIXL's post time is what handing it to the agent took)."""

    seconds: float
    post_seconds: float


class FabricRunner:
    """Awaitable transfers over a shared `Fabric`; completion times come from the link model."""

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self._timer: asyncio.TimerHandle | None = None

    async def transfer(self, src: str, dst: str, nbytes: int) -> TransferTime:
        """Move `nbytes` from `src` to `dst`; how long posting it and the whole of it took."""
        loop = asyncio.get_running_loop()
        posting = time.perf_counter()
        started = loop.time()
        self._complete(loop)
        transfer_id = self.fabric.start(src, dst, nbytes, started)
        future: asyncio.Future[None] = loop.create_future()
        self._waiters[transfer_id] = future
        self._reschedule(loop)
        post_s = time.perf_counter() - posting
        try:
            await future
        except asyncio.CancelledError:
            self._waiters.pop(transfer_id, None)
            self.fabric.cancel(transfer_id, loop.time())
            self._reschedule(loop)
            raise
        return TransferTime(loop.time() - started, post_s)

    def _complete(self, loop: asyncio.AbstractEventLoop) -> None:
        for transfer_id in self.fabric.advance(loop.time()):
            future = self._waiters.pop(transfer_id, None)
            if future is not None and not future.done():
                future.set_result(None)

    def _reschedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        when = self.fabric.next_completion(loop.time())
        if when is not None:
            self._timer = loop.call_at(when, self._on_timer, loop)

    def _on_timer(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        self._complete(loop)
        self._reschedule(loop)
