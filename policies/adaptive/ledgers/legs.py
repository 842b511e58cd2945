"""What the adaptive policy remembers of its own recent placements, per worker, and the KV
crowding of a worker: the parts of `policies.adaptive.scoring` that keep state.

- `StallLedger`: the prefill steps longer than the ITL objective placed on each worker, as a
  decaying count (their rate), which expose the answers decoding there.
- `kv_crowding`: the misses one more stream costs where it fills a worker's KV cache.
- `slot_wait_ms`: the wait for a sequence slot where the engine's sequence cap is reached.
- `WorkLedger` (`policies.adaptive.ledgers.work`): the prefill work placed on each worker and not
  yet done.
- `LegLedger`: the decode legs of split turns placed on each worker and not yet sent there.
- B(g) = `slow_gap_budget`: the gaps of a g-token answer that may exceed the ITL objective
  while the p99 of its gaps meets it.
- `poisson_tail`: how likely enough other prefills join a step to make it slow.
- `stream_harm`: what added slow steps cost a stream beside them.
"""

from __future__ import annotations

import heapq
import math
from typing import TypeVar

from policies.adaptive import tuning
from policies.costmodel.estimates import Estimates
from policies.types import WorkerView

_Key = TypeVar("_Key")
_Value = TypeVar("_Value")


def forget_oldest(table: dict[_Key, _Value]) -> None:
    """Past `MAX_TRACKED_REQUESTS` entries, the oldest quarter goes (a dict keeps insertion
    order)."""
    limit = tuning.MAX_TRACKED_REQUESTS
    if len(table) > limit:
        for key in list(table)[: limit // 4]:
            del table[key]


def slow_gap_budget(tokens: float) -> float:
    """B(g): how many gaps of a `tokens`-token answer may exceed the ITL objective."""
    return max(1.0, (tokens - 1.0) * tuning.SLOW_GAP_SHARE)


def slow_gaps_allowed(tokens: float) -> int:
    """How many of a `tokens`-token answer's gaps may exceed the ITL objective, by any
    margin, while the p99 of its gaps (interpolated) meets it: one more fills its upper rank."""
    allowed = math.floor((tokens - 2.0) * tuning.SLOW_GAP_SHARE)
    return allowed if allowed > 0 else 0


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
    crowded = tuning.KV_CROWDED_FROM
    risk = (usage - crowded) / (1.0 - crowded)
    return 0.0 if risk <= 0.0 else tuning.KV_FULL_MISSES * min(risk, 1.0)


def slot_wait_ms(
    worker: WorkerView, cap: int, estimates: Estimates, streams: float = 1.0, coming: int = 0
) -> float:
    """The wait for room on `worker`: a sequence slot, its engine running at most `cap` (0:
    no cap), and KV for `streams` mean-sized streams' worth of new KV. Each request it holds
    past the cap (running and queued by the scrape, or in flight by the router's count if
    more, and the `coming` decode legs not sent yet) waits for a stream to finish; the KV past
    full (grown as in `kv_crowding`) waits for streams to free it. Its streams finish, and
    free their KV, at running / (mean answer x decode step) per second (Little's law)."""
    running = worker.running
    if running <= 0:
        return 0.0
    held = running + (worker.waiting if worker.waiting > 0 else 0)
    held = (worker.inflight if worker.inflight > held else held) + coming
    past = float(held + 1 - cap) if cap > 0 else 0.0
    usage = worker.kv_usage
    if usage > 0.0:
        # The usage past full, in the running streams' share of the cache each.
        over = (usage * (held - coming + streams) / running - 1.0) * running / usage
        past = over if over > past else past
    if past <= 0.0:
        return 0.0
    step = estimates.decode_step_ms(running, estimates.mean_context_tokens, worker.worker_id)
    return past * estimates.mean_completion_tokens * step / running


class LegLedger:
    """The decode legs of the split turns this policy placed, per decode worker, until they
    are sent there: the router sends a decode leg when its prefill ends, so until then no
    count of the view (in flight, running, KV usage) holds it, yet it will take a sequence
    slot and its context's KV there. Each leg is kept with the time its prefill is predicted
    to end and the tokens it brings; `coming` counts those still due at a time.

    Keyed by request like the other ledgers: placing a request again replaces its leg, and
    `coming` leaves the asking request's own out; a finished request's leg is dropped."""

    __slots__ = ("_by_worker", "_entries")

    def __init__(self) -> None:
        self._by_worker: dict[str, dict[str, tuple[float, int]]] = {}  # worker -> request -> leg
        self._entries: dict[str, str] = {}  # request -> worker

    def place(self, request_id: str, worker: str | None, sent_s: float, tokens: int) -> None:
        """`request_id`'s decode leg goes to `worker` at `sent_s` with `tokens` of context
        (None: no split turn)."""
        self.finish(request_id)
        if worker is None:
            return
        legs = self._by_worker.get(worker)
        if legs is None:
            if len(self._by_worker) >= tuning.MAX_TRACKED_WORKERS:
                return
            legs = self._by_worker[worker] = {}
        legs[request_id] = (sent_s, tokens)
        self._entries[request_id] = worker
        limit = tuning.MAX_TRACKED_REQUESTS
        if len(self._entries) > limit:
            for key in list(self._entries)[: limit // 4]:
                self.finish(key)

    def finish(self, request_id: str) -> None:
        worker = self._entries.pop(request_id, None)
        if worker is not None:
            self._by_worker[worker].pop(request_id, None)

    def coming(self, worker: str, now_s: float, exclude: str = "") -> tuple[int, int]:
        """(legs, their tokens) due on `worker` after `now_s`; those sent since are the
        router's in-flight legs (their entries are dropped here)."""
        legs = self._by_worker.get(worker)
        if not legs:
            return 0, 0
        count = tokens = 0
        for request_id, (sent_s, size) in list(legs.items()):
            if sent_s <= now_s:
                del legs[request_id]
                self._entries.pop(request_id, None)
            elif request_id != exclude:
                count += 1
                tokens += size
        return count, tokens

    def surplus(
        self, worker: str, now_s: float, exclude: str = "", freed_per_s: float = 0.0,
        held: float = 0.0,
    ) -> float:  # fmt: skip
        """The most KV (tokens) the legs due on `worker` after `now_s` add there at once past
        what its streams free meanwhile: at each leg's due time, the tokens of the legs due
        by then less min(`held`, `freed_per_s` x the time since `now_s`), at least 0 (with
        `freed_per_s` 0: all their tokens). `coming` (called first) drops the legs sent."""
        legs = self._by_worker.get(worker)
        if not legs:
            return 0.0
        due = sorted((sent_s, size) for request_id, (sent_s, size) in legs.items()
                     if sent_s > now_s and request_id != exclude)  # fmt: skip
        peak = total = 0.0
        for sent_s, size in due:
            total += size
            freed = freed_per_s * (sent_s - now_s)
            net = total - (freed if freed < held else held)
            peak = net if net > peak else peak
        return peak


class StallLedger:
    """The prefill steps longer than the ITL objective this policy has placed, per worker,
    as a count decaying with time constant `window_s` (their rate per second); any count
    placed per request works the same (`StreamLedger` counts answers with one).

    Keyed by request: placing a request again replaces its entry, so a decision repeated for
    the same turn and view is the same decision; `rate` leaves the asking request out.

    Every count decays at the same pace, so the order of the workers by count changes only
    when one is added to: `busiest` reads the top of a heap kept in that order (log count +
    as of / window: time drops out), never the whole fleet."""

    __slots__ = ("_counts", "_entries", "_heap", "_hosts", "_scores", "window_s")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._counts: dict[str, tuple[float, float]] = {}  # worker -> (count, as of time)
        self._entries: dict[str, tuple[str, float, int]] = {}  # request -> (worker, at, steps)
        self._scores: dict[str, float] = {}  # worker -> log count + as of / window
        self._heap: list[tuple[float, str]] = []  # (-score, worker); stale ones skipped
        self._hosts: tuple[float, float, int] | None = None  # `host_rate`'s (at, total, hosts)

    def place(self, request_id: str, worker: str | None, at_s: float, steps: int) -> None:
        """Record `request_id`'s prefill on `worker` (None or 0 steps: no slow step)."""
        old = self._entries.pop(request_id, None)
        if old is not None:
            self._add(old[0], old[1], -old[2])
        if worker is None or steps <= 0:
            return
        self._add(worker, at_s, steps)
        self._entries[request_id] = (worker, at_s, steps)
        forget_oldest(self._entries)  # the oldest entries' contributions have decayed away

    def forget(self, request_id: str) -> None:
        """Stop tracking the request (its steps stay counted)."""
        self._entries.pop(request_id, None)

    def rate(self, worker: str, now_s: float, exclude: str = "") -> float:
        entry = self._counts.get(worker)
        if entry is None:
            return 0.0
        own = self._entries.get(exclude)
        mine = (own[2], own[1]) if own is not None and own[0] == worker else None
        return decayed_rate(*entry, now_s, self.window_s, mine)

    def busiest(self, count: int) -> list[str]:
        """The `count` workers with the highest counts (any time: they decay alike), highest
        first, ties to the lower worker id; none with no count left."""
        heap, scores = self._heap, self._scores
        found: list[tuple[float, str]] = []
        while heap and len(found) < count:
            top = heapq.heappop(heap)
            if scores.get(top[1]) == -top[0] and (not found or found[-1] != top):
                found.append(top)  # current (a worker pushed twice at one score comes twice)
        for top in found:
            heapq.heappush(heap, top)
        return [worker for negative, worker in found if negative < math.inf]

    def host_rate(self, now_s: float, exclude: str = "", fresh_s: float = 0.0) -> float:
        """The mean rate of the workers that host slow prefills lately (at least one slow
        step in the window, the asking request's own left out). `fresh_s` > 0: the hosts
        found at most that long ago, their counts decayed to now (a pass over every worker
        that ever hosted one is due only then; the asking request's own taken off the total)."""
        own = self._entries.get(exclude)
        known = self._hosts
        if fresh_s > 0.0 and known is not None and 0.0 <= now_s - known[0] < fresh_s:
            at, total, hosts = known
            if not hosts:
                return 0.0
            if own is not None:
                total -= own[2] * math.exp((own[1] - at) / self.window_s)
            total *= math.exp((at - now_s) / self.window_s)
            return total / hosts / self.window_s if total > 0.0 else 0.0
        if fresh_s > 0.0:
            own = None  # the cache counts every request's
        total, hosts = 0.0, 0
        for worker, (count, as_of) in self._counts.items():
            if own is not None and own[0] == worker:
                count -= own[2] * math.exp((own[1] - as_of) / self.window_s)
            age = now_s - as_of if now_s > as_of else 0.0
            count *= math.exp(-age / self.window_s)
            if count >= 1.0:
                total += count
                hosts += 1
        if fresh_s > 0.0:
            self._hosts = (now_s, total, hosts)
            return self.host_rate(now_s, exclude, fresh_s)
        return total / hosts / self.window_s if hosts else 0.0

    def _add(self, worker: str, at_s: float, steps: int) -> None:
        count, as_of = decayed_add(*self._counts.get(worker, (0.0, at_s)), at_s, steps,
                                    self.window_s)  # fmt: skip
        if worker in self._counts or len(self._counts) < tuning.MAX_TRACKED_WORKERS:
            count = count if count > 0.0 else 0.0
            self._counts[worker] = (count, as_of)
            score = math.log(count) + as_of / self.window_s if count > 0.0 else -math.inf
            scores, heap = self._scores, self._heap
            if scores.get(worker) != score:
                scores[worker] = score
                heapq.heappush(heap, (-score, worker))
                if len(heap) > 2 * len(scores) + 64:  # mostly stale: rebuilt, amortised
                    heap[:] = [(-known, name) for name, known in scores.items()]
                    heapq.heapify(heap)


def decayed_rate(
    total: float, as_of: float, now_s: float, window_s: float, own: tuple[float, float] | None
) -> float:
    """A sum decaying with time constant `window_s` (`total` as of `as_of`) as a rate at
    `now_s`, less `own` = (amount, added at) when the asker's own share is left out."""
    if own is not None:
        total -= own[0] * math.exp((own[1] - as_of) / window_s)
    if total <= 0.0:
        return 0.0
    age = now_s - as_of if now_s > as_of else 0.0
    return total * math.exp(-age / window_s) / window_s


def decayed_add(
    total: float, as_of: float, at_s: float, amount: float, window_s: float
) -> tuple[float, float]:
    """`amount` added at `at_s` to a sum decaying with time constant `window_s`; the sum is
    kept as of the latest time it was added to."""
    if at_s >= as_of:
        return total * math.exp((as_of - at_s) / window_s) + amount, at_s
    return total + amount * math.exp((at_s - as_of) / window_s), as_of


def poisson_tail(mean: float, count: int) -> float:
    """P(N >= `count`) for N Poisson-distributed with `mean`."""
    if count <= 0:
        return 1.0
    if not mean > 0.0 or count > mean + 12.0 * math.sqrt(mean) + 12.0:
        return 0.0  # beyond 12 standard deviations (and a margin for small means)
    term = below = math.exp(-mean)
    for k in range(1, count):
        term *= mean / k
        below += term
    return 1.0 - below if below < 1.0 else 0.0


def budget_crossings(mean: float, allowed: int, added: float) -> float:
    """P(N <= `allowed` < N + `added`), N Poisson-distributed with `mean`: the chance that
    `added` more slow gaps push a stream whose own come as N past the `allowed` ones (a
    fractional `added` interpolates between its neighbours)."""
    whole = math.floor(added)
    part = added - whole
    within = 1.0 - poisson_tail(mean, allowed + 1)

    def crossed(count: int) -> float:
        rest = allowed - count
        return within - (1.0 - poisson_tail(mean, rest + 1) if rest >= 0 else 0.0)

    low = crossed(whole)
    return low + part * (crossed(whole + 1) - low) if part > 0.0 else low


def stream_harm(own: float, allowed: int, added: float, budget: float) -> float:
    """The misses `added` slow steps cost a stream whose own slow gaps come as N, Poisson with
    mean `own`: `CROSSING_WEIGHT` x `budget_crossings` + the rest x `added` / `budget` (B,
    `slow_gap_budget`: at least 1)."""
    crossings = budget_crossings(own, allowed, added)
    weight = tuning.CROSSING_WEIGHT
    return weight * crossings + (1.0 - weight) * added / budget
