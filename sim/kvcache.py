"""Paged KV cache with prefix caching by chained block hashes and LRU eviction (as vLLM v1).

A block holds `block_size` tokens of KV. A FULL block is identified by the hash of (parent
block's hash, the block's token ids), so equal hashes mean equal prefixes. A block whose last
reference goes away keeps its hash and stays cached (evictable) until its slot is needed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

# The parent hash of a sequence's first block.
ROOT_HASH = 0x5E55_10E0


def extend_block_hashes(
    token_ids: Sequence[int], hashes: list[int], block_size: int, upto: int
) -> None:
    """Append to `hashes` the chained hashes of full blocks until it holds `upto` of them."""
    parent = hashes[-1] if hashes else ROOT_HASH
    for k in range(len(hashes), upto):
        start = k * block_size
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)


class BlockManager:
    """Block ids 0..num_blocks-1 with reference counts; hashes map to cached full blocks."""

    __slots__ = (
        "_block_hash",
        "_by_hash",
        "_evictable",
        "_free",
        "_refs",
        "block_size",
        "enable_prefix_caching",
        "hits",
        "num_blocks",
        "queries",
    )

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
        self._refs = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        # Unhashed free blocks, popped from the end: block 0 is handed out first.
        self._free = list(range(num_blocks - 1, -1, -1))
        # Cached blocks nobody references, least recently freed first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.queries = 0
        self.hits = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never used or unhashed, plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_hash)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live or held requests (vllm:kv_cache_usage_perc)."""
        return (self.num_blocks - self.num_free_blocks) / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    def match(self, token_ids: Sequence[int], hashes: list[int], max_blocks: int) -> list[int]:
        """Block ids of the longest cached prefix, at most `max_blocks`; no side effects.

        `hashes` is the sequence's hash cache: it is extended lazily, only as far as needed.
        """
        if not self.enable_prefix_caching:
            return []
        by_hash = self._by_hash
        matched: list[int] = []
        for k in range(max_blocks):
            if k == len(hashes):
                extend_block_hashes(token_ids, hashes, self.block_size, k + 1)
            block = by_hash.get(hashes[k])
            if block is None:
                break
            matched.append(block)
        return matched

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """Leading tokens whose full blocks are cached; no last-token rule, no side effects."""
        max_blocks = len(token_ids) // self.block_size
        return len(self.match(token_ids, [], max_blocks)) * self.block_size

    def evictable_among(self, block_ids: Sequence[int]) -> int:
        """How many of these blocks are unreferenced, so taking them uses up free capacity."""
        refs = self._refs
        return sum(1 for b in block_ids if refs[b] == 0)

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks returned by `match`."""
        refs, evictable = self._refs, self._evictable
        for b in block_ids:
            if refs[b] == 0:
                del evictable[b]
            refs[b] += 1

    def allocate(self, count: int) -> list[int]:
        """Take `count` fresh blocks, evicting least recently freed cached blocks if needed."""
        if count > self.num_free_blocks:
            raise RuntimeError(f"cannot allocate {count} blocks, {self.num_free_blocks} free")
        free, refs = self._free, self._refs
        out: list[int] = []
        for _ in range(count):
            if free:
                b = free.pop()
            else:
                b, _none = self._evictable.popitem(last=False)
                h = self._block_hash[b]
                if h is not None:
                    del self._by_hash[h]
                    self._block_hash[b] = None
            refs[b] = 1
            out.append(b)
        return out

    def allocate_one(self) -> int | None:
        """One fresh block, or None when nothing is free (the caller preempts)."""
        if not self._free and not self._evictable:
            return None
        return self.allocate(1)[0]

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block; tail blocks first, so they are evicted first."""
        refs, block_hash = self._refs, self._block_hash
        for b in reversed(block_ids):
            r = refs[b] - 1
            if r < 0:
                raise RuntimeError(f"block {b} freed more often than referenced")
            refs[b] = r
            if r == 0:
                if block_hash[b] is None:
                    self._free.append(b)
                else:
                    self._evictable[b] = None

    def register(self, block_id: int, block_hash: int) -> None:
        """Publish a referenced, completely written block under its chained hash.

        A duplicate of an already cached prefix stays unhashed: the first copy serves hits.
        """
        if not self.enable_prefix_caching or block_hash in self._by_hash:
            return
        if self._block_hash[block_id] is not None:
            return
        self._by_hash[block_hash] = block_id
        self._block_hash[block_id] = block_hash

    def record_query(self, queried_tokens: int, hit_tokens: int) -> None:
        self.queries += queried_tokens
        self.hits += hit_tokens
