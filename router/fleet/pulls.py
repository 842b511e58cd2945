"""What a worker's KV pulls take, measured by its engine.

An engine that pulls a handoff's KV (vLLM's NixlConnector, on the decode worker) counts its
transfers, their seconds and their bytes; no reply says what one request's pull took. Between
two scrapes, the counters' growth is what the pulls in that interval took. The seconds per
byte of the last `WINDOW_PULLS` pulls, pooled (their seconds over their bytes), price the next
handoff's bytes into that worker: that is the transfer time the policy learns its links from.

Pooled rather than averaged per interval: one pull's time swings widely with whether its
engine's thread held a core when the bytes landed, and an average of per-interval ratios lets
a small pull that waited price every byte after it.
"""

from __future__ import annotations

from collections import deque

from router.fleet.telemetry import WorkerLoad

WINDOW_PULLS = 32  # the pulls the rate pools, at least (whole scrape intervals)


class PullMeter:
    """Seconds per byte of one worker's recent KV pulls, from its scraped cumulative counters."""

    __slots__ = ("_bytes", "_intervals", "_pulls", "_seconds", "seconds_per_byte")

    def __init__(self) -> None:
        self._pulls: int | None = None
        self._seconds = 0.0
        self._bytes = 0.0
        self._intervals: deque[tuple[int, float, float]] = deque()  # (pulls, seconds, bytes)
        self.seconds_per_byte: float | None = None

    def update(self, load: WorkerLoad) -> None:
        """One scrape's counters. A counter that went down (the engine restarted) starts the
        count again from there."""
        pulls, seconds, nbytes = load.pulls, load.pull_seconds, load.pull_bytes
        if pulls is None or seconds is None or nbytes is None:
            return
        previous = self._pulls
        added_seconds, added_bytes = seconds - self._seconds, nbytes - self._bytes
        self._pulls, self._seconds, self._bytes = pulls, seconds, nbytes
        if previous is None or pulls <= previous or added_seconds <= 0.0 or added_bytes <= 0.0:
            return
        intervals = self._intervals
        intervals.append((pulls - previous, added_seconds, added_bytes))
        pooled = sum(interval[0] for interval in intervals)
        while pooled - intervals[0][0] >= WINDOW_PULLS:
            pooled -= intervals.popleft()[0]
        pooled_seconds = sum(interval[1] for interval in intervals)
        self.seconds_per_byte = pooled_seconds / sum(interval[2] for interval in intervals)

    def seconds_for(self, nbytes: int) -> float | None:
        """What pulling `nbytes` takes at the measured rate; None before any pull was seen."""
        if self.seconds_per_byte is None:
            return None
        return nbytes * self.seconds_per_byte
