"""`WorkLedger`: the prefill work the adaptive policy placed on each worker and not yet done
(a part of `policies.adaptive.scoring` that keeps state, beside
`policies.adaptive.ledgers.legs`)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping

from policies.adaptive import tuning
from policies.adaptive.ledgers.legs import decayed_add, decayed_rate
from policies.costmodel.calibration import queue_ahead
from policies.types import WorkerView

# request -> (worker, busy until before it, busy until after it, placed at, work s, weight,
# due at)
_WorkEntry = tuple[str, float, float, float, float, float, float]


class WorkLedger:
    """The prefill work this policy has placed on each worker, as the time until which it
    keeps the worker busy (work placed at t on a worker busy until T ends at max(T, t) + its
    arithmetic): what a turn placed there now waits behind, before any scrape shows it, and
    weighed by size (a queue of long prompts is longer than one of short ones).

    Keyed by request like `StallLedger`: placing a request again replaces its entry, and
    `backlog_ms` leaves the asking request's own work out; a finished request takes back
    the work the ledger still counted ahead of its end. `settle` bounds it by a scrape: the
    work is predicted (a cold prior, a prefix not yet learned) but the queue a scrape saw is
    not, so a worker can be busy past the scrape only with what it had queued then and what
    was placed there since. `utilisation`: the share of a worker's time the work placed there
    lately takes (decaying with time constant `window_s`), backlog or not."""

    __slots__ = (
        "_busy",
        "_current",
        "_entries",
        "_held",
        "_pending",
        "_rates",
        "_recent",
        "_settled",
        "window_s",
    )

    def __init__(self, window_s: float = 1.0) -> None:
        self.window_s = window_s
        self._busy: dict[str, float] = {}  # worker -> busy until (s)
        # The workers busy past the latest `settle_pending` (a scrape can bound no other).
        self._pending: dict[str, None] = {}
        # worker -> (work placed, decaying with time constant window_s, in s; as of time)
        self._rates: dict[str, tuple[float, float]] = {}
        # request -> (worker, busy until before it, busy until after it, placed at, work s)
        self._entries: dict[str, _WorkEntry] = {}
        # worker -> the latest requests placed there, in placement order
        self._recent: dict[str, deque[tuple[float, str]]] = {}
        # worker -> how often its `_recent` holds each (placed at, request), and how many of
        # those are their request's entry still: past them `settle` would find only stale ones.
        self._held: dict[str, dict[tuple[float, str], int]] = {}
        self._current: dict[str, int] = {}
        # worker -> the scrape (at, queued) `settle_pending` settled it by, while none of its
        # placements changed since: settling by it again would change nothing.
        self._settled: dict[str, tuple[float, int]] = {}

    def place(
        self,
        request_id: str,
        worker: str | None,
        at_s: float,
        work_ms: float,
        weight: float = 1.0,
        due_s: float | None = None,
    ) -> None:
        """`request_id`'s prefill of `work_ms` placed on `worker` at `at_s` (None or no work:
        nothing placed); `weight`: what it costs a request queued behind it, in typical
        prefills (`Estimates.queue_wait_ms`); `due_s`: when its first token is due (`at_s`
        when not told), which orders it on a worker with priority scheduling."""
        old = self._drop(request_id)
        if old is not None:
            busy = self._busy.get(old[0])
            if busy is not None:
                # Exact when nothing was placed there since; else take its share back.
                self._busy[old[0]] = old[1] if busy == old[2] else busy - (old[2] - old[1])
            self._rate_add(old[0], old[3], -old[4])
        if worker is None or not work_ms > 0.0:
            return
        before = self._busy.get(worker, at_s)
        work_s = work_ms / 1000.0
        after = (before if before > at_s else at_s) + work_s
        if worker in self._busy or len(self._busy) < tuning.MAX_TRACKED_WORKERS:
            self._busy[worker] = after
            self._pending[worker] = None
            self._rate_add(worker, at_s, work_s)
            due = at_s if due_s is None else due_s
            self._enter(request_id, (worker, before, after, at_s, work_s, weight, due))
        limit = tuning.MAX_TRACKED_REQUESTS
        if len(self._entries) > limit:
            for key in list(self._entries)[: limit // 4]:
                self._drop(key)

    def _enter(self, request_id: str, entry: _WorkEntry) -> None:
        """Make `entry` the request's and the latest placement on its worker (the oldest
        falls out of a full `_recent`)."""
        worker, at_s = entry[0], entry[3]
        recent = self._recent.get(worker)
        if recent is None:
            # The placements `settle` may find queued at a scrape.
            recent = self._recent[worker] = deque(maxlen=tuning.MAX_RECENT)
            self._held[worker] = {}
            self._current[worker] = 0
        held = self._held[worker]
        self._settled.pop(worker, None)
        if len(recent) == recent.maxlen:
            oldest = recent[0]
            last = self._entries.get(oldest[1])
            if last is not None and last[0] == worker and last[3] == oldest[0]:
                self._current[worker] -= 1
            if held[oldest] > 1:
                held[oldest] -= 1
            else:
                del held[oldest]
        self._entries[request_id] = entry
        recent.append((at_s, request_id))
        key = (at_s, request_id)
        copies = held[key] = held.get(key, 0) + 1
        # A copy placed before, at the same time on the same worker, is current again too.
        self._current[worker] += copies

    def _drop(self, request_id: str) -> _WorkEntry | None:
        """Forget the request's entry: its copies in `_recent` are stale from now on."""
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self._settled.pop(entry[0], None)
            self._current[entry[0]] -= self._held[entry[0]].get((entry[3], request_id), 0)
        return entry

    def finish(self, request_id: str, now_s: float) -> None:
        """The request completed, so its prefill and the work placed before it are done."""
        entry = self._drop(request_id)
        if entry is None:
            return
        busy = self._busy.get(entry[0])
        if busy is not None:
            # What the ledger still counted of it (a settled ledger may count less).
            ahead = (entry[2] if entry[2] < busy else busy) - now_s
            if ahead > 0.0:
                self._busy[entry[0]] = busy - ahead

    def _latest(self, worker: str) -> list[tuple[float, str, _WorkEntry]]:
        """The requests placed on `worker` and not finished, latest first: (placed at,
        request, entry); a request placed again at once comes twice. (A list: a compiled
        generator costs more per item than the items its callers skip.)"""
        latest: list[tuple[float, str, _WorkEntry]] = []
        recent = self._recent.get(worker)
        if recent is None:
            return latest
        entries = self._entries
        current = self._current[worker]
        for at_s, request_id in reversed(recent):
            if not current:
                break  # the rest are stale
            entry = entries.get(request_id)
            if entry is None or entry[0] != worker or entry[3] != at_s:
                continue  # placed again since, or forgotten
            current -= 1
            latest.append((at_s, request_id, entry))
        return latest

    def settle(self, worker: str, scraped_s: float, queued: int) -> None:
        """A scrape at `scraped_s` saw `queued` requests waiting on `worker`: the last ones
        placed there before it (first come, first served); what was placed before them is
        running or done, the latest of it at most its work after its placement. So the worker
        is busy at most until that, their work and then the work placed since (each from its
        placement on) are done."""
        busy = self._busy.get(worker)
        if busy is None:
            return
        since: list[tuple[float, float]] = []
        bound = scraped_s
        for at_s, _, entry in self._latest(worker):
            if at_s >= scraped_s:
                since.append((at_s, entry[4]))
            elif queued > 0:
                queued -= 1
                bound += entry[4]
            else:
                # The latest one admitted may still be in its step (a long prefill is one).
                left = at_s + entry[4] - scraped_s
                bound += left if left > 0.0 else 0.0
                break
        for at_s, work_s in reversed(since):
            bound = (bound if bound > at_s else at_s) + work_s
        if busy > bound:
            self._busy[worker] = bound

    def settle_pending(self, workers: Mapping[str, WorkerView], now_s: float) -> None:
        """`settle` each worker still busy at `now_s` by its view in `workers` (the rest are
        busy until a time a scrape, never later than now, cannot bring forward)."""
        busy, pending, settled = self._busy, self._pending, self._settled
        for worker in list(pending):
            until = busy.get(worker)
            if until is None or until <= now_s:
                del pending[worker]
                continue
            view = workers.get(worker)
            if view is not None:
                scraped_s = view.scraped_at(now_s)
                if math.isfinite(scraped_s):
                    scrape = (scraped_s, view.waiting)
                    if settled.get(worker) != scrape:
                        self.settle(worker, *scrape)
                        settled[worker] = scrape

    def queued(
        self, worker: str, scraped_s: float, waiting: int, exclude: str = ""
    ) -> tuple[int, float]:
        """(how many, their weights) of the requests a scrape of `worker` at `scraped_s` that
        saw `waiting` queued leaves ahead of a new one there that this policy placed:
        those placed since the scrape (it has not seen them) and the last `waiting` placed
        before it (first come, first served), the asking request's own left out."""
        counted = {exclude}  # a request placed again at once has two copies
        weight = 0.0
        for at_s, request_id, entry in self._latest(worker):
            if request_id in counted:
                continue
            if at_s < scraped_s:
                if waiting <= 0:
                    break
                waiting -= 1
            counted.add(request_id)
            weight += entry[5]
        return len(counted) - 1, weight

    def ahead(self, worker: WorkerView, now_s: float, exclude: str = "") -> float:
        """The requests queued at `worker` (`queue_ahead`) in mean placed prefills: those
        this policy placed (`queued`) by their weights, the others one each (prompts can be
        heavy-tailed: a queue of short ones is short)."""
        depth = queue_ahead(worker)
        if depth <= 0:
            return 0.0
        scraped_s = worker.scraped_at(now_s)
        own, weight = self.queued(worker.worker_id, scraped_s, worker.waiting, exclude)
        if own >= depth:  # the scrape is older than some of them finished
            return weight * depth / own
        return depth - own + weight

    def due_share(self, worker: str, now_s: float, due_s: float, exclude: str = "") -> float:
        """Of the placed work `worker` has still to do, the share it does before a turn due at
        `due_s` when it admits the earliest due first (priority scheduling): the work due no
        later, and the prefill already running; 1 when none is left."""
        total = before = 0.0
        for _, request_id, entry in self._latest(worker):
            if request_id == exclude:
                continue
            left = entry[2] - now_s
            if left <= 0.0:
                continue
            work = entry[4] if entry[4] < left else left
            total += work
            if entry[6] <= due_s or entry[1] <= now_s:
                before += work
        return before / total if total > 0.0 else 1.0

    def backlog_ms(self, worker: str, now_s: float, exclude: str = "") -> float:
        busy = self._busy.get(worker)
        if busy is None:
            return 0.0
        own = self._entries.get(exclude)
        if own is not None and own[0] == worker:
            busy = own[1] if busy == own[2] else busy - (own[2] - own[1])
        return (busy - now_s) * 1000.0 if busy > now_s else 0.0

    def utilisation(self, worker: str, now_s: float, exclude: str = "") -> float:
        """The share of `worker`'s time the prefill work placed there recently takes (work
        per second over the last `window_s`, the asking request's own left out)."""
        entry = self._rates.get(worker)
        if entry is None:
            return 0.0
        own = self._entries.get(exclude)
        mine = (own[4], own[3]) if own is not None and own[0] == worker else None
        return decayed_rate(*entry, now_s, self.window_s, mine)

    def _rate_add(self, worker: str, at_s: float, work_s: float) -> None:
        total, as_of = decayed_add(*self._rates.get(worker, (0.0, at_s)), at_s, work_s,
                                    self.window_s)  # fmt: skip
        self._rates[worker] = (total if total > 0.0 else 0.0, as_of)
