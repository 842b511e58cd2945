from __future__ import annotations

import pytest

from sim.kvcache import BlockManager, extend_block_hashes

BS = 4


def _hashes(tokens: list[int], n: int | None = None) -> list[int]:
    out: list[int] = []
    extend_block_hashes(tokens, out, BS, len(tokens) // BS if n is None else n)
    return out


def _cache(bm: BlockManager, tokens: list[int]) -> list[int]:
    """Allocate blocks for `tokens`, register the full ones, and free them (cached)."""
    blocks = bm.allocate(-(-len(tokens) // BS))
    for block, h in zip(blocks, _hashes(tokens), strict=False):
        bm.register(block, h)
    bm.free(blocks)
    return blocks


def test_chained_hashes_depend_on_the_whole_prefix() -> None:
    a = _hashes([1, 2, 3, 4, 5, 6, 7, 8])
    b = _hashes([9, 2, 3, 4, 5, 6, 7, 8])
    assert len(a) == 2
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different parent
    assert _hashes([1, 2, 3, 4, 5, 6, 7, 8, 9]) == a  # the partial block has no hash
    partial: list[int] = [a[0]]
    extend_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], partial, BS, 2)
    assert partial == a


def test_allocate_and_free_track_usage() -> None:
    bm = BlockManager(8, BS)
    assert (bm.num_free_blocks, bm.usage) == (8, 0.0)
    blocks = bm.allocate(3)
    assert blocks == [0, 1, 2]
    assert (bm.num_free_blocks, bm.usage) == (5, 3 / 8)
    bm.free(blocks)
    assert (bm.num_free_blocks, bm.usage) == (8, 0.0)
    with pytest.raises(RuntimeError):
        bm.allocate(9)
    with pytest.raises(RuntimeError):
        bm.free([0])


def test_freed_full_blocks_stay_cached_and_hit() -> None:
    bm = BlockManager(8, BS)
    tokens = list(range(10))  # two full blocks and a partial one
    blocks = _cache(bm, tokens)
    assert bm.num_cached_blocks == 2
    assert bm.num_free_blocks == 8
    assert bm.cached_prefix_tokens(tokens) == 8
    assert bm.cached_prefix_tokens(tokens[:8]) == 8
    assert bm.cached_prefix_tokens(tokens[:7]) == 4
    assert bm.cached_prefix_tokens([99, *tokens]) == 0
    assert bm.match(tokens, [], 2) == blocks[:2]
    assert bm.match(tokens, [], 1) == blocks[:1]


def test_lookup_has_no_side_effects() -> None:
    bm = BlockManager(4, BS)
    tokens = list(range(8))
    _cache(bm, tokens)
    for _ in range(3):
        assert bm.cached_prefix_tokens(tokens) == 8
    assert (bm.queries, bm.hits, bm.num_free_blocks) == (0, 0, 4)
    assert [bm.ref_count(b) for b in range(4)] == [0, 0, 0, 0]


def test_hash_cache_is_extended_lazily_up_to_the_first_miss() -> None:
    bm = BlockManager(8, BS)
    _cache(bm, list(range(8)))
    tokens = [*range(8), 50, 51, 52, 53, 54, 55, 56, 57]
    hashes: list[int] = []
    assert len(bm.match(tokens, hashes, 4)) == 2
    assert len(hashes) == 3  # two hits and the first miss


def test_acquire_takes_cached_blocks_off_the_free_list() -> None:
    bm = BlockManager(4, BS)
    tokens = list(range(8))
    blocks = _cache(bm, tokens)
    matched = bm.match(tokens, [], 2)
    assert bm.evictable_among(matched) == 2
    bm.acquire(matched)
    assert bm.num_free_blocks == 2
    assert bm.evictable_among(matched) == 0
    bm.acquire(matched[:1])  # shared by a second request
    assert bm.ref_count(blocks[0]) == 2
    bm.free(matched[:1])
    bm.free(matched)
    assert bm.num_free_blocks == 4
    assert bm.cached_prefix_tokens(tokens) == 8


def test_allocation_prefers_unhashed_blocks_then_evicts_lru() -> None:
    bm = BlockManager(4, BS)
    first = _cache(bm, [1, 1, 1, 1])  # block 0, cached
    second = _cache(bm, [2, 2, 2, 2])  # block 1 (block 0 is cached, 2 and 3 unused)
    assert (first, second) == ([0], [1])
    assert bm.allocate(2) == [2, 3]  # never-used blocks first; both cached prefixes survive
    assert bm.cached_prefix_tokens([1, 1, 1, 1]) == 4
    assert bm.cached_prefix_tokens([2, 2, 2, 2]) == 4
    assert bm.allocate(1) == [0]  # then the least recently freed cached block
    assert bm.cached_prefix_tokens([1, 1, 1, 1]) == 0
    assert bm.cached_prefix_tokens([2, 2, 2, 2]) == 4
    assert bm.num_cached_blocks == 1


def test_a_request_tail_is_evicted_before_its_head() -> None:
    bm = BlockManager(3, BS)
    tokens = list(range(12))
    _cache(bm, tokens)  # three full blocks, freed tail first
    bm.allocate(1)
    assert bm.cached_prefix_tokens(tokens) == 8
    bm.allocate(1)
    assert bm.cached_prefix_tokens(tokens) == 4


def test_duplicate_content_keeps_the_first_copy() -> None:
    bm = BlockManager(4, BS)
    tokens = [7, 7, 7, 7]
    (h,) = _hashes(tokens)
    a, b = bm.allocate(2)
    bm.register(a, h)
    bm.register(b, h)
    bm.free([a, b])
    assert bm.match(tokens, [], 1) == [a]
    assert bm.num_cached_blocks == 1


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    tokens = list(range(8))
    _cache(bm, tokens)
    assert bm.cached_prefix_tokens(tokens) == 0
    assert bm.num_cached_blocks == 0


def test_counters() -> None:
    bm = BlockManager(4, BS)
    bm.record_query(100, 64)
    bm.record_query(10, 0)
    assert (bm.queries, bm.hits) == (110, 64)


@pytest.mark.parametrize(("blocks", "size"), [(0, 16), (4, 0)])
def test_rejects_empty_geometry(blocks: int, size: int) -> None:
    with pytest.raises(ValueError):
        BlockManager(blocks, size)
