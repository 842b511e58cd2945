"""`FleetIndex`: the view's workers by id and ranked by what the shortlists pick them by, kept
from turn to turn as the workers' views change.

The live router and the simulator rebuild a worker's `WorkerView` when it is scraped or its
in-flight count moves, and share the rest between views: a turn changes a few of them, seldom
the whole fleet. The index compares each worker's view with the one it last saw (by identity,
a pointer each; only at the positions the view's `WorkerChanges` names, where it names the
workers indexed last) and re-ranks only those that changed, so what a turn costs does not grow
with the fleet; a view that changes most workers at once (a scrape of them all, a fleet that
joined or left) is ranked again from scratch. Every ranking is sorted by its key
and then the worker id, so it depends only on the workers, never on their order in the view.

A ranking's key is one integer, `value x span + the worker id's rank` among the view's ids
sorted: ordered as (value, worker id) is, and sorted without comparing strings.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Iterable
from typing import TypeVar

from policies.eligibility import DECODE_ROLES, PREFILL_ROLES
from policies.types import WorkerChanges, WorkerView

UsageKey = tuple[float, int]  # (KV usage, the id's rank): emptiest first

# Past this share of its workers changed, the fleet is ranked again whole: re-ranking each
# costs a few bisections, ranking them all one sort.
_REBUILD_SHARE = 0.25


# What a worker's keys are entered in (`FleetIndex._flags`): none (not eligible), or these.
_DECODE = 1
_ROOMY = 2
_PREFILL = 4


class FleetIndex:
    """The workers of the latest view (`sync`) by id (`index`, edited in place as the views
    change), and the eligible ones (healthy, not draining) ranked, each a list of keys read
    through `head`, `least`, `most` and `emptiest` (sorted once a turn edits them; `id_of`
    names a key's worker):

    - `roomy` / `full`: the decode-capable ones by `load_score`, KV usage below `kv_limit`
      or not;
    - `usages`: the decode-capable ones by KV usage;
    - `prefill`: the prefill-capable ones by `load_score`;
    - `streams`: the prefill-capable ones by their decode streams (`TurnTerms.streams`: the
      scrape's running, or the router's legs there less its queue where more, at most
      `max_seqs` where positive).

    A view naming a worker twice is indexed whole each time (the last of the two wins the
    index, each ranking holds both)."""

    __slots__ = (
        "_exact",
        "_flags",
        "_ids",
        "_kv_limit",
        "_loads",
        "_max_seqs",
        "_named",
        "_ranks",
        "_sorted",
        "_span",
        "_streams",
        "_views",
        "_workers",
        "full",
        "index",
        "prefill",
        "roomy",
        "streams",
        "usages",
    )

    def __init__(self, kv_limit: float, max_seqs: int) -> None:
        self._kv_limit = kv_limit
        self._max_seqs = max_seqs
        self._workers: tuple[WorkerView, ...] | None = None
        self._exact = True  # every worker id once: the index can be edited in place
        self._named: list[str] = []  # the ids in the view's order, as last ranked
        self._ids: list[str] = []  # sorted: rank -> id
        self._ranks: dict[str, int] = {}
        self._span = 1
        # Whether the rankings are sorted: a fleet ranked whole is sorted only once a turn
        # edits it (a fleet changing whole every turn is only ever searched for its heads).
        self._sorted = True
        # Per position in the view: the view ranked, what it is ranked in, its keys.
        self._views: list[WorkerView] = []
        self._flags: list[int] = []
        self._loads: list[int] = []
        self._streams: list[int] = []
        self.index: dict[str, WorkerView] = {}
        self.roomy: list[int] = []
        self.full: list[int] = []
        self.usages: list[UsageKey] = []
        self.prefill: list[int] = []
        self.streams: list[int] = []

    def id_of(self, key: int) -> str:
        """The worker of a key of `roomy`, `full`, `prefill` or `streams`."""
        return self._ids[key % self._span]

    def value_of(self, key: int) -> int:
        """The value (load, streams) a key ranks its worker by."""
        return key // self._span

    def head(self, ranking: list[int], count: int) -> list[int]:
        """The first `count` keys of `ranking` (one of this index's), in order."""
        if self._sorted:
            return ranking[:count]
        return sorted(ranking) if len(ranking) <= count else heapq.nsmallest(count, ranking)

    def least(self, ranking: list[int], count: int, skip: str = "") -> list[str]:
        """The ids of the first `count` of `ranking` (of this index's) other than `skip`."""
        ids, span = self._ids, self._span
        chosen: list[str] = []
        for key in self.head(ranking, count + 1):
            wid = ids[key % span]
            if wid != skip and len(chosen) < count:
                chosen.append(wid)
        return chosen

    def most(self, ranking: list[int], count: int) -> list[str]:
        """The ids of the last `count` of `ranking` (of this index's), the last first."""
        if self._sorted:
            last = ranking[-count:][::-1] if count > 0 else []
        else:
            last = heapq.nlargest(count, ranking)
        ids, span = self._ids, self._span
        return [ids[key % span] for key in last]

    def emptiest(self, count: int) -> list[str]:
        """The ids of the `count` decode-capable workers with the lowest KV usage."""
        ids, usages = self._ids, self.usages
        if self._sorted:
            first = usages[:count]
        else:
            first = sorted(usages) if len(usages) <= count else heapq.nsmallest(count, usages)
        return [ids[rank] for _, rank in first]

    def sync(self, workers: tuple[WorkerView, ...], changes: WorkerChanges | None = None) -> None:
        """Index `workers`, the latest view's, re-ranking the workers whose views changed:
        where `changes` is given since the workers indexed last, only its positions are
        compared, else every worker's."""
        if workers is self._workers:
            return
        views = self._views
        if not self._exact or len(workers) != len(views):
            self._rebuild(workers)
            return
        changed: list[int] = []
        most = int(len(views) * _REBUILD_SHARE)
        if changes is not None and changes.since is self._workers:
            # the builder's word: every other position holds the object indexed (in the
            # order a full compare finds them, so the index is edited alike)
            positions: Iterable[int] = sorted(set(changes.positions))
        else:
            positions = range(len(views))
        for i in positions:
            old = views[i]
            new = workers[i]
            if new is not old:
                if new.worker_id != old.worker_id or len(changed) >= most:
                    self._rebuild(workers)
                    return
                changed.append(i)
        if not self._sorted:
            self.roomy.sort()
            self.full.sort()
            self.usages.sort()
            self.prefill.sort()
            self.streams.sort()
            self._sorted = True
        index = self.index
        for i in changed:
            worker = workers[i]
            self._leave(i)
            self._enter(i, worker)
            index[worker.worker_id] = worker
        self._workers = workers

    def _rebuild(self, workers: tuple[WorkerView, ...]) -> None:
        named = [w.worker_id for w in workers]
        if named != self._named:
            self._named = named
            self._ids = sorted(set(named))
            self._ranks = {wid: rank for rank, wid in enumerate(self._ids)}
            self._span = 1 << max(len(self._ids), 1).bit_length()
            self.index = {}
        count = len(workers)
        self._views = list(workers)
        self._flags = [0] * count
        self._loads = [0] * count
        self._streams = [0] * count
        self.roomy, self.full, self.usages, self.prefill, self.streams = [], [], [], [], []
        index = self.index
        for i in range(count):
            worker = workers[i]
            index[worker.worker_id] = worker
            flags = self._keyed(i, worker)
            if flags & _DECODE:
                (self.roomy if flags & _ROOMY else self.full).append(self._loads[i])
                self.usages.append((worker.kv_usage, self._loads[i] % self._span))
            if flags & _PREFILL:
                self.prefill.append(self._loads[i])
                self.streams.append(self._streams[i])
        self._sorted = False
        self._exact = len(index) == count
        self._workers = workers

    def _keyed(self, i: int, worker: WorkerView) -> int:
        """Key the worker at position `i` (its view `worker`): the rankings it goes in."""
        self._views[i] = worker
        if not worker.healthy or worker.draining:
            self._flags[i] = 0
            return 0
        span = self._span
        rank = self._ranks[worker.worker_id]
        running = worker.running
        waiting = worker.waiting
        inflight = worker.inflight
        self._loads[i] = (inflight + running + 2 * waiting) * span + rank
        role = worker.role
        flags = 0
        if role in DECODE_ROLES:
            flags = _DECODE | _ROOMY if worker.kv_usage < self._kv_limit else _DECODE
        if role in PREFILL_ROLES:
            flags |= _PREFILL
            running = running if running > 0 else 0
            placed = inflight - (waiting if waiting > 0 else 0)
            count = placed if placed > running else running
            max_seqs = self._max_seqs
            self._streams[i] = (max_seqs if 0 < max_seqs < count else count) * span + rank
        self._flags[i] = flags
        return flags

    def _enter(self, i: int, worker: WorkerView) -> None:
        flags = self._keyed(i, worker)
        if flags & _DECODE:
            insort(self.roomy if flags & _ROOMY else self.full, self._loads[i])
            insort(self.usages, (worker.kv_usage, self._loads[i] % self._span))
        if flags & _PREFILL:
            insort(self.prefill, self._loads[i])
            insort(self.streams, self._streams[i])

    def _leave(self, i: int) -> None:
        flags = self._flags[i]
        if flags & _DECODE:
            _remove(self.roomy if flags & _ROOMY else self.full, self._loads[i])
            _remove(self.usages, (self._views[i].kv_usage, self._loads[i] % self._span))
        if flags & _PREFILL:
            _remove(self.prefill, self._loads[i])
            _remove(self.streams, self._streams[i])


_Key = TypeVar("_Key", int, UsageKey)


def _remove(ranking: list[_Key], key: _Key) -> None:
    """Take `key` out of the sorted `ranking`, which holds it (a KV usage that is NaN sorts
    nowhere: then it is searched for)."""
    at = bisect_left(ranking, key)
    if at < len(ranking) and ranking[at] == key:
        del ranking[at]
    else:
        ranking.remove(key)
