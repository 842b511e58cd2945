"""The event heap: (time, seq, callback, argument) on one virtual clock.

`seq` breaks ties in scheduling order, so two events at the same time run in the order they
were scheduled and a run is deterministic. Callbacks may schedule further events (never in
the past) and may advance the clock themselves when they can prove no other event comes
first (the cluster runs an engine's consecutive steps that way; see `Cluster`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

Callback = Callable[[Any], None]


class LoopClock:
    """The loop's virtual time: `now()` for the engines and the router; only the loop (and a
    callback that proves no event comes first, see `EventLoop`) sets `t`, never backwards."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


class EventLoop:
    __slots__ = ("clock", "events", "heap", "seq", "stopped")

    def __init__(self) -> None:
        self.clock = LoopClock()
        self.heap: list[tuple[float, int, Callback, Any]] = []
        self.seq = 0  # the last sequence number handed out (hot callers push directly)
        self.events = 0  # callbacks run from the heap
        self.stopped = False

    def now(self) -> float:
        return self.clock.now()

    def at(self, time: float, callback: Callback, argument: Any = None) -> None:
        """Run `callback(argument)` at virtual `time` (not before the current time).

        Ignored once the loop is stopped.
        """
        if self.stopped:
            return
        if time < self.clock.t:
            raise ValueError(f"event at {time} is in the past (now {self.clock.t})")
        self.seq += 1
        heapq.heappush(self.heap, (float(time), self.seq, callback, argument))

    def next_time(self) -> float | None:
        """When the earliest pending event runs; None when nothing is pending."""
        return self.heap[0][0] if self.heap else None

    def stop(self) -> None:
        """Drop every pending event and refuse new ones: `run` returns after this callback."""
        self.stopped = True
        self.heap.clear()

    def run(self) -> None:
        """Run events in (time, seq) order until none is left (or `stop` is called)."""
        heap = self.heap
        pop = heapq.heappop
        clock = self.clock
        count = 0
        try:
            while heap:
                time, _, callback, argument = pop(heap)
                clock.t = time
                count += 1
                callback(argument)
        finally:
            self.events += count
