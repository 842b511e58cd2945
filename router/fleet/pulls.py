"""What a worker's KV pulls take, measured by its engine.

An engine that pulls a handoff's KV (vLLM's NixlConnector, on the decode worker) counts its
transfers, their seconds and their bytes; no reply says what one request's pull took. Between
two scrapes, the counters' growth is what the pulls in that interval took: its seconds per
byte, smoothed over the intervals that saw pulls, prices the next handoff's bytes into that
worker. That is the transfer time the policy learns its links from.
"""

from __future__ import annotations

from router.fleet.telemetry import WorkerLoad

SMOOTHING = 0.3  # weight of the newest interval that saw pulls


class PullMeter:
    """Seconds per byte of one worker's KV pulls, from its scraped cumulative counters."""

    __slots__ = ("_bytes", "_pulls", "_seconds", "seconds_per_byte")

    def __init__(self) -> None:
        self._pulls: int | None = None
        self._seconds = 0.0
        self._bytes = 0.0
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
        rate = added_seconds / added_bytes
        known = self.seconds_per_byte
        self.seconds_per_byte = rate if known is None else known + SMOOTHING * (rate - known)

    def seconds_for(self, nbytes: int) -> float | None:
        """What pulling `nbytes` takes at the measured rate; None before any pull was seen."""
        if self.seconds_per_byte is None:
            return None
        return nbytes * self.seconds_per_byte
