"""Clocks the engine reads: wall time behind HTTP, virtual time inside the simulator."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """The current time in seconds."""
        ...


class MonotonicClock:
    """Real time from `time.monotonic` (never jumps backwards)."""

    __slots__ = ()

    def now(self) -> float:
        return time.monotonic()


class VirtualClock:
    """Time that moves only when the discrete-event simulator advances it."""

    __slots__ = ("_now",)

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance_to(self, t: float) -> None:
        if t < self._now:
            raise ValueError(f"virtual clock cannot go backwards: {t} < {self._now}")
        self._now = float(t)
