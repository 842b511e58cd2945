"""What the adaptive policy remembers of its own recent placements, per worker, and the KV
crowding of a worker: the parts of `policies.adaptive_scoring` that keep state.

- `StallLedger`: the prefill steps longer than the ITL objective placed on each worker, as a
  decaying count (their rate), which expose the answers decoding there.
- `kv_crowding`: the misses one more stream costs where it fills a worker's KV cache.
- B(g) = `slow_gap_budget`: the gaps of a g-token answer that may exceed the ITL objective
  while the p99 of its gaps meets it.
"""

from __future__ import annotations

import math

from policies.types import WorkerView

KV_CROWDED_FROM = 0.8
KV_FULL_MISSES = 2.0
MAX_TRACKED_WORKERS = 4096
MAX_TRACKED_REQUESTS = 65536
# The ITL objective is on the p99 of a stream's gaps: 1% of them may be slow.
SLOW_GAP_SHARE = 0.01


def slow_gap_budget(tokens: float) -> float:
    """B(g): how many gaps of a `tokens`-token answer may exceed the ITL objective."""
    return max(1.0, (tokens - 1.0) * SLOW_GAP_SHARE)


def kv_crowding(worker: WorkerView, streams: float = 1.0) -> float:
    """Expected misses from placing `streams` mean-sized streams' worth of new KV on
    `worker` (a turn's share: its tokens not cached there over the streams' mean): a full
    cache preempts a stream (recomputed later: a long stall) and the new one waits for room.
    The usage, grown by the streams in flight there (counted by the router, not yet scraped)
    and by the new KV at the running streams' mean size, is weighed from `KV_CROWDED_FROM`
    (0) to full (`KV_FULL_MISSES`: the new stream and a victim)."""
    usage = worker.kv_usage
    running = worker.running
    if running > 0:
        in_flight = max(running + max(worker.waiting, 0), worker.inflight)
        usage *= (in_flight + streams) / running
    risk = (usage - KV_CROWDED_FROM) / (1.0 - KV_CROWDED_FROM)
    return 0.0 if risk <= 0.0 else KV_FULL_MISSES * min(risk, 1.0)


class StallLedger:
    """The prefill steps longer than the ITL objective this policy has placed, per worker,
    as a count decaying with time constant `window_s` (their rate per second).

    Keyed by request: placing a request again replaces its entry, so a decision repeated for
    the same turn and view is the same decision; `rate` leaves the asking request out."""

    __slots__ = ("_counts", "_entries", "window_s")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._counts: dict[str, tuple[float, float]] = {}  # worker -> (count, as of time)
        self._entries: dict[str, tuple[str, float, int]] = {}  # request -> (worker, at, steps)

    def place(self, request_id: str, worker: str | None, at_s: float, steps: int) -> None:
        """Record `request_id`'s prefill on `worker` (None or 0 steps: no slow step)."""
        old = self._entries.pop(request_id, None)
        if old is not None:
            self._add(old[0], old[1], -old[2])
        if worker is None or steps <= 0:
            return
        self._add(worker, at_s, steps)
        self._entries[request_id] = (worker, at_s, steps)
        if len(self._entries) > MAX_TRACKED_REQUESTS:
            # The oldest entries' contributions have decayed away; forget their keys.
            for key in list(self._entries)[: MAX_TRACKED_REQUESTS // 4]:
                del self._entries[key]

    def forget(self, request_id: str) -> None:
        """Stop tracking the request (its steps stay counted)."""
        self._entries.pop(request_id, None)

    def rate(self, worker: str, now_s: float, exclude: str = "") -> float:
        entry = self._counts.get(worker)
        if entry is None:
            return 0.0
        count, as_of = entry
        own = self._entries.get(exclude)
        if own is not None and own[0] == worker:
            count -= own[2] * math.exp((own[1] - as_of) / self.window_s)
        if count <= 0.0:
            return 0.0
        age = now_s - as_of if now_s > as_of else 0.0
        return count * math.exp(-age / self.window_s) / self.window_s

    def _add(self, worker: str, at_s: float, steps: int) -> None:
        count, as_of = self._counts.get(worker, (0.0, at_s))
        if at_s >= as_of:
            count = count * math.exp((as_of - at_s) / self.window_s) + steps
            as_of = at_s
        else:
            count += steps * math.exp((at_s - as_of) / self.window_s)
        if worker in self._counts or len(self._counts) < MAX_TRACKED_WORKERS:
            self._counts[worker] = (count if count > 0.0 else 0.0, as_of)


class WorkLedger:
    """The prefill work this policy has placed on each worker, as the time until which it
    keeps the worker busy (work placed at t on a worker busy until T ends at max(T, t) + its
    arithmetic): what a turn placed there now waits behind, before any scrape shows it, and
    weighed by size (a queue of long prompts is longer than one of short ones).

    Keyed by request like `StallLedger`: placing a request again replaces its entry, and
    `backlog_ms` leaves the asking request's own work out; a finished request takes back
    the work the ledger still counted ahead of its end."""

    __slots__ = ("_busy", "_entries")

    def __init__(self) -> None:
        self._busy: dict[str, float] = {}  # worker -> busy until (s)
        # request -> (worker, busy until before it, busy until after it)
        self._entries: dict[str, tuple[str, float, float]] = {}

    def place(self, request_id: str, worker: str | None, at_s: float, work_ms: float) -> None:
        old = self._entries.pop(request_id, None)
        if old is not None:
            busy = self._busy.get(old[0])
            if busy is not None:
                # Exact when nothing was placed there since; else take its share back.
                self._busy[old[0]] = old[1] if busy == old[2] else busy - (old[2] - old[1])
        if worker is None or not work_ms > 0.0:
            return
        before = self._busy.get(worker, at_s)
        after = (before if before > at_s else at_s) + work_ms / 1000.0
        if worker in self._busy or len(self._busy) < MAX_TRACKED_WORKERS:
            self._busy[worker] = after
            self._entries[request_id] = (worker, before, after)
        if len(self._entries) > MAX_TRACKED_REQUESTS:
            for key in list(self._entries)[: MAX_TRACKED_REQUESTS // 4]:
                del self._entries[key]

    def finish(self, request_id: str, now_s: float) -> None:
        """The request completed, so its prefill and the work placed before it are done."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        busy = self._busy.get(entry[0])
        if busy is not None and entry[2] > now_s:
            self._busy[entry[0]] = busy - (entry[2] - now_s)

    def backlog_ms(self, worker: str, now_s: float, exclude: str = "") -> float:
        busy = self._busy.get(worker)
        if busy is None:
            return 0.0
        own = self._entries.get(exclude)
        if own is not None and own[0] == worker:
            busy = own[1] if busy == own[2] else busy - (own[2] - own[1])
        return (busy - now_s) * 1000.0 if busy > now_s else 0.0
