"""The metric names the router reads from a worker's /metrics page, per engine kind."""

from __future__ import annotations

import msgspec


class EngineMetrics(msgspec.Struct, frozen=True):
    """Sample names for one engine kind; within each tuple the first name present wins."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_usage: tuple[str, ...]
    prefix_hits: tuple[str, ...]
    prefix_queries: tuple[str, ...]
    # Series with different values of this label are different schedulers (summed); series
    # with the same value are copies of one scheduler's numbers (max taken).
    replica_label: str
    # Cumulative KV pulls on the worker that pulls (the decode side): their number, seconds
    # and bytes; empty where the engine does not export them.
    pulls: tuple[str, ...] = ()
    pull_seconds: tuple[str, ...] = ()
    pull_bytes: tuple[str, ...] = ()

    @property
    def groups(self) -> tuple[tuple[str, ...], ...]:
        return (self.running, self.waiting, self.kv_usage, self.prefix_hits, self.prefix_queries,
                self.pulls, self.pull_seconds, self.pull_bytes)  # fmt: skip
