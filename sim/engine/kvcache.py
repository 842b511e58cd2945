"""Paged KV cache with prefix caching by chained block hashes and LRU eviction (as vLLM v1).

A block holds `block_size` tokens of KV. A FULL block is identified by the hash of (parent
block's hash, the block's token ids), so equal hashes mean equal prefixes. A block whose last
reference goes away keeps its hash and stays cached (evictable) until its slot is needed.

A long prompt has about a thousand blocks, so the cache works on runs of them. Cached blocks
are kept as runs, each a stretch of one chain, and only each run's first hash is indexed:
every hash is cached at most once, so a cached hash is either a run's first or the
successor of its parent in the parent's run. Lookups walk a chain that way; registering a
chain's new blocks, or evicting a run's tail (tails go first), touches no index.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import suppress
from itertools import compress, count, islice
from operator import ne

# The parent hash of a sequence's first block.
ROOT_HASH = 0x5E55_10E0
# Consumed or stale entries the eviction queue may hold before it is trimmed.
_QUEUE_SLACK = 4096


def extend_block_hashes(
    token_ids: Sequence[int], hashes: list[int], block_size: int, upto: int,
    contents: Sequence[int | None] | None = None,
) -> None:  # fmt: skip
    """Append to `hashes` the chained hashes of full blocks until it holds `upto` of them.

    Block k's hash is hash((block k-1's hash or ROOT_HASH, hash(tuple(block k's tokens)))).
    `contents[j]`, where not None, is the caller's hash(tuple(...)) of block len(hashes) + j
    (a block whose tokens it knows the hash of already); it covers the blocks up to `upto`,
    which must not exceed the sequence's full blocks.
    """
    first = len(hashes)
    if first >= upto:
        return
    if upto * block_size > len(token_ids):
        raise ValueError(f"{len(token_ids)} tokens have fewer than {upto} full blocks")
    own: Iterable[int]
    if contents is None:  # zip over block_size references to one iterator: each block's tuple
        blocks = [iter(token_ids[first * block_size : upto * block_size])] * block_size
        own = map(hash, zip(*blocks, strict=False))
    else:
        known = list(islice(contents, upto - first))
        j = -1
        with suppress(ValueError):  # index() raises once no None is left
            while True:
                j = known.index(None, j + 1)
                start = (first + j) * block_size
                known[j] = hash(tuple(token_ids[start : start + block_size]))
        own = known  # type: ignore[assignment]  # no None left
    parent = hashes[-1] if hashes else ROOT_HASH
    append = hashes.append
    for content in own:
        parent = hash((parent, content))
        append(parent)


def block_hash_at(token_ids: Sequence[int], hashes: Sequence[int], block_size: int, k: int) -> int:
    """The chained hash of block k; `hashes` holds (at least) those of blocks 0..k-1."""
    content = hash(tuple(token_ids[k * block_size : (k + 1) * block_size]))
    return hash((hashes[k - 1] if k else ROOT_HASH, content))


class _Run:
    """Cached blocks of one chain, in chain order: `hashes[i]` is the parent of `hashes[i+1]`."""

    __slots__ = ("blocks", "hashes")

    def __init__(self, hashes: list[int], blocks: list[int]) -> None:
        self.hashes = hashes
        self.blocks = blocks


_Holder = tuple[_Run, int]  # where a cached block is: its run and its index there


class BlockManager:
    """Block ids 0..num_blocks-1 with reference counts; hashes map to cached full blocks.

    Evictable blocks queue in a list in the order they were freed; taking one back (a prefix
    hit) leaves its entry stale rather than deleting it. One list per block, `_meta`, holds
    the reference count (> 0), 0 for a block on the free list, or for an evictable block the
    mark of the `free` call that queued it: a negative int made for that call, kept next to
    each entry too, so an entry is live iff its block's meta is that very object.
    """

    __slots__ = ("_free", "_lru", "_lru_head", "_lru_marks", "_marks", "_meta", "_num_cached",
                 "_num_evictable", "_run_of", "_starts", "block_size", "enable_prefix_caching",
                 "hits", "num_blocks", "queries")  # fmt: skip

    def __init__(
        self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._meta = [0] * num_blocks
        self._run_of: list[_Run | None] = [None] * num_blocks  # None: the block is unhashed
        self._starts: dict[int, _Run] = {}  # the first hash of every run -> the run
        # Unhashed free blocks, popped from the end: block 0 is handed out first.
        self._free = list(range(num_blocks - 1, -1, -1))
        # Cached blocks nobody references, least recently freed first (consumed up to
        # `_lru_head`, stale ones anywhere), and the mark of each entry's call.
        self._lru: list[int] = []
        self._lru_marks: list[int] = []
        self._lru_head = self._marks = self._num_evictable = self._num_cached = 0
        self.queries = self.hits = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never used or unhashed, plus evictable cached ones."""
        return len(self._free) + self._num_evictable

    @property
    def num_cached_blocks(self) -> int:
        return self._num_cached

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live or held requests (vllm:kv_cache_usage_perc)."""
        return (self.num_blocks - len(self._free) - self._num_evictable) / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return max(self._meta[block_id], 0)

    def record_query(self, queried_tokens: int, hit_tokens: int) -> None:
        self.queries += queried_tokens
        self.hits += hit_tokens

    def _holder(self, block_hash: int, parent: _Holder | None) -> _Holder | None:
        """The cached block of `block_hash`, given the one of its parent (None if none)."""
        if parent is not None:
            run, i = parent
            if i + 1 < len(run.hashes) and run.hashes[i + 1] == block_hash:
                return run, i + 1
        found = self._starts.get(block_hash)
        return None if found is None else (found, 0)

    def match(self, token_ids: Sequence[int], hashes: list[int], max_blocks: int) -> list[int]:
        """Block ids of the longest cached prefix, at most `max_blocks`; no side effects.

        `hashes` is the sequence's hash cache: it is extended lazily, only as far as needed.
        """
        if not self.enable_prefix_caching or max_blocks <= 0:
            return []
        matched: list[int] = []
        holder: _Holder | None = None
        k = 0
        while k < max_blocks:
            if k == len(hashes):
                extend_block_hashes(token_ids, hashes, self.block_size, k + 1)
            holder = self._holder(hashes[k], holder)
            if holder is None:
                break
            run, i = holder
            # The run goes on with the chain as far as the hashes agree.
            n = min(len(run.hashes) - i, max_blocks - k, len(hashes) - k)
            if run.hashes[i : i + n] != hashes[k : k + n]:
                n = next(compress(count(), map(ne, run.hashes[i : i + n], hashes[k : k + n])))
            matched += run.blocks[i : i + n]
            k += n
            holder = run, i + n - 1
        return matched

    def cached_prefix_tokens(
        self, token_ids: Sequence[int], hashes: list[int] | None = None
    ) -> int:
        """Leading tokens whose full blocks are cached; no last-token rule, no side effects.

        `hashes`, when given, is the sequence's hash cache (extended as `match` does).
        """
        max_blocks = len(token_ids) // self.block_size
        found = self.match(token_ids, [] if hashes is None else hashes, max_blocks)
        return len(found) * self.block_size

    def evictable_among(self, block_ids: Sequence[int]) -> int:
        """How many of these blocks are unreferenced, so taking them uses up free capacity."""
        meta = self._meta
        return sum(1 for b in block_ids if meta[b] <= 0)

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks returned by `match`."""
        meta = self._meta
        for b in block_ids:
            m = meta[b]
            if m > 0:
                meta[b] = m + 1
            elif m < 0:
                meta[b] = 1  # its queue entry goes stale
                self._num_evictable -= 1
            else:
                raise KeyError(b)  # unreferenced but not cached: not a block `match` returns

    def allocate(self, count: int) -> list[int]:
        """Take `count` fresh blocks, evicting least recently freed cached blocks if needed."""
        free = self._free
        spare = len(free)
        if count <= spare:
            out = free[spare - count :]
            del free[spare - count :]
            out.reverse()  # as popped one by one from the end
        else:
            if count > spare + self._num_evictable:
                raise RuntimeError(f"cannot allocate {count} blocks, {self.num_free_blocks} free")
            out = free[::-1]
            free.clear()
            self._evict(count - spare, out)
        meta = self._meta
        for b in out:
            meta[b] = 1
        return out

    def allocate_one(self) -> int | None:
        """One fresh block, or None when nothing is free (the caller preempts)."""
        if self._free:
            b = self._free.pop()
            self._meta[b] = 1
            return b
        return self.allocate(1)[0] if self._num_evictable else None

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block; tail blocks first, so they are evicted first."""
        meta, run_of = self._meta, self._run_of
        self._marks += 1
        mark = ~self._marks  # a value no earlier call had
        queued: list[int] = []
        release, queue = self._free.append, queued.append
        try:
            for b in reversed(block_ids):
                m = meta[b]
                if m == 1 and run_of[b] is not None:  # the usual case first
                    meta[b] = mark
                    queue(b)
                elif m > 1:
                    meta[b] = m - 1
                elif m < 1:
                    raise RuntimeError(f"block {b} freed more often than referenced")
                else:
                    meta[b] = 0
                    release(b)
        finally:
            self._lru += queued
            self._lru_marks += [mark] * len(queued)
            self._num_evictable += len(queued)
        if len(self._lru) - self._lru_head > 2 * self._num_evictable + _QUEUE_SLACK:
            self._compact()

    # -- eviction -----------------------------------------------------------------------------
    def _evict(self, number: int, out: list[int]) -> None:
        """Append the `number` least recently freed evictable blocks to `out`, uncached."""
        lru, marks, meta, run_of = self._lru, self._lru_marks, self._meta, self._run_of
        i = self._lru_head
        left = number
        while left:
            b = lru[i]
            if meta[b] is not marks[i]:  # stale: taken back since it was queued
                i += 1
                continue
            run: _Run = run_of[b]  # type: ignore[assignment]  # evictable blocks are cached
            blocks = run.blocks
            if blocks[-1] != b:
                self._cut(run, b)
                out.append(b)
                i += 1
                left -= 1
                continue
            # A run leaves from its tail, which its last `free` queued reversed: as far as the
            # queue goes on with it (entries live, compared by identity in C), all at once.
            taken = lru[i : i + min(left, len(blocks))]
            tail = blocks[-len(taken) :]
            tail.reverse()
            if taken != tail:
                del taken[next(compress(count(), map(ne, taken, tail))) :]
            if list(map(meta.__getitem__, taken)) != marks[i : i + len(taken)]:
                live = map(ne, map(meta.__getitem__, taken), marks[i : i + len(taken)])
                del taken[next(compress(count(), live)) :]
            m = len(taken)
            del blocks[-m:]
            if not blocks:
                del self._starts[run.hashes[0]]
            del run.hashes[-m:]
            for b in taken:
                run_of[b] = None
            out += taken
            i += m
            left -= m
        self._num_evictable -= number
        self._num_cached -= number
        if i > _QUEUE_SLACK and 2 * i > len(lru):  # drop the consumed half of the queue
            del lru[:i], marks[:i]
            i = 0
        self._lru_head = i

    def _cut(self, run: _Run, block_id: int) -> None:
        """Uncache a block other than its run's last: the blocks after it start a run."""
        self._run_of[block_id] = None
        i = run.blocks.index(block_id)
        if i > 0:
            rest = _Run(run.hashes[i + 1 :], run.blocks[i + 1 :])
            del run.hashes[i:], run.blocks[i:]
            for b in rest.blocks:
                self._run_of[b] = rest
            self._starts[rest.hashes[0]] = rest
        else:
            del self._starts[run.hashes[0]]
            del run.hashes[0], run.blocks[0]
            self._starts[run.hashes[0]] = run

    def _compact(self) -> None:
        """Rebuild the queue from its live entries: hits can leave it mostly stale."""
        meta, head = self._meta, self._lru_head
        self._marks += 1
        mark = ~self._marks
        live: list[int] = []
        for b, old in zip(self._lru[head:], self._lru_marks[head:], strict=True):
            if meta[b] is old:
                meta[b] = mark
                live.append(b)
        self._lru, self._lru_marks, self._lru_head = live, [mark] * len(live), 0

    # -- registration -------------------------------------------------------------------------
    def register(self, block_id: int, block_hash: int) -> None:
        """Publish a referenced, completely written block under its chained hash.

        A duplicate of an already cached prefix stays unhashed: the first copy serves hits.
        Its parent unknown, the hash is searched in every run (`register_blocks` walks).
        """
        if not self.enable_prefix_caching or self._run_of[block_id] is not None:
            return
        if not any(block_hash in run.hashes for run in self._starts.values()):
            self._publish(None, [block_hash], [block_id])

    def register_blocks(
        self, block_ids: Sequence[int], hashes: Sequence[int], start: int, stop: int
    ) -> None:
        """`register(block_ids[k], hashes[k])` for k in [start, stop), in that order.

        `hashes` is the sequence's hash chain and `block_ids` its blocks, from block 0.
        """
        if not self.enable_prefix_caching or start >= stop:
            return
        run_of, starts = self._run_of, self._starts
        holder = self._holder_of(block_ids, hashes, start - 1) if start else None
        k = start
        while k < stop:
            run, i = holder if holder is not None else (None, -1)
            if run is None or i == len(run.hashes) - 1:
                # After a chain's last cached block a cached hash can only start a run, so
                # every block up to the next such hash (or published block) is new.
                j = stop
                if not starts.keys().isdisjoint(hashes[k:stop]):
                    j = next(compress(count(k), map(starts.__contains__, hashes[k:stop])))
                if any(map(run_of.__getitem__, block_ids[k:j])):
                    j = next(compress(count(k), map(run_of.__getitem__, block_ids[k:j])))
                if j > k:
                    run = self._publish(run, list(hashes[k:j]), list(block_ids[k:j]))
                    holder, k = (run, len(run.hashes) - 1), j
                    continue
            if run_of[block_ids[k]] is not None:  # published already (under this chain's hash)
                holder = self._holder_of(block_ids, hashes, k)
            else:
                holder = self._holder(hashes[k], holder)
                if holder is None:  # not cached: this block serves it now
                    holder = self._publish(None, [hashes[k]], [block_ids[k]]), 0
            k += 1

    def _holder_of(self, block_ids: Sequence[int], hashes: Sequence[int], k: int) -> _Holder | None:
        """The cached block of hashes[k], the sequence's own block if that one is cached."""
        run = self._run_of[block_ids[k]]
        if run is not None:
            blocks = run.blocks
            last = len(blocks) - 1
            return run, (last if blocks[last] == block_ids[k] else blocks.index(block_ids[k]))
        holder = None  # the block is a duplicate: walk the chain to its cached copy
        for h in islice(hashes, k + 1):
            holder = self._holder(h, holder)
        return holder

    def _publish(self, run: _Run | None, hashes: list[int], blocks: list[int]) -> _Run:
        """Cache `blocks` under `hashes` (chained), after `run`'s last block or as a new run."""
        if run is None:
            run = _Run(hashes, blocks)
            self._starts[hashes[0]] = run
        else:
            run.hashes += hashes
            run.blocks += blocks
        run_of = self._run_of
        for b in blocks:
            run_of[b] = run
        self._num_cached += len(blocks)
        return run
