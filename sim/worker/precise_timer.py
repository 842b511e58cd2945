"""Sub-millisecond wake-ups for an asyncio loop.

An event loop's timers ride on epoll's millisecond timeouts (and uvloop's clock ticks in whole
milliseconds), so a step planned to end at t finished anywhere in [t, t + ~1 ms]: that jitter
went straight into every stream's inter-token gaps, which the discrete-event simulator, with
exact step ends, does not have. Here one thread sleeps until the exact deadline (a condition
variable with a microsecond timeout) and hands the wake-up to the loop through
`call_soon_threadsafe`, which interrupts the loop's poll at once. The thread holds no lock
while sleeping and only takes the GIL to hand the wake-up over.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time


class PreciseTimer:
    """Resolves futures at monotonic deadlines on their loop, one daemon thread per instance."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="precise-timer", daemon=True)
        self._thread.start()

    async def sleep_until(self, deadline: float) -> None:
        """Return at `deadline` (time.monotonic), or at once when it has passed."""
        if deadline <= time.monotonic():
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._changed:
            heapq.heappush(self._heap, (deadline, next(self._order), future))
            if self._heap[0][2] is future:
                self._changed.notify()
        await future

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        heap, changed = self._heap, self._changed
        with changed:
            while not self._closed:
                if not heap:
                    changed.wait()
                    continue
                delay = heap[0][0] - time.monotonic()
                if delay > 0:
                    changed.wait(delay)
                    continue
                _, _, future = heapq.heappop(heap)
                if future.done():
                    continue  # the sleeper was cancelled
                try:
                    future.get_loop().call_soon_threadsafe(_resolve, future)
                except RuntimeError:
                    pass  # its loop is closed: nobody waits any more


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
