from __future__ import annotations

import pytest

from sim.engine.kvcache import BlockManager, extend_block_hashes

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


def _registered(bm: BlockManager, tokens: list[int], hashes: list[int]) -> list[int]:
    """Match, acquire and allocate `tokens` as the scheduler does, then register every full
    block with one `register_blocks` call; the sequence's blocks."""
    matched = bm.match(tokens, hashes, len(tokens) // BS)
    bm.acquire(matched)
    blocks = matched + bm.allocate(-(-len(tokens) // BS) - len(matched))
    extend_block_hashes(tokens, hashes, BS, len(tokens) // BS)
    bm.register_blocks(blocks, hashes, len(matched), len(tokens) // BS)
    return blocks


def test_register_blocks_publishes_a_chain_and_a_later_sequence_extends_it() -> None:
    bm = BlockManager(16, BS)
    first = list(range(8))
    a = _registered(bm, first, [])
    assert bm.num_cached_blocks == 2 and bm.match(first, [], 2) == a
    longer = [*first, 8, 9, 10, 11, 12]  # two hits, one new full block, a partial one
    b = _registered(bm, longer, [])
    assert b[:2] == a and bm.num_cached_blocks == 3
    assert bm.match(longer, [], 3) == b[:3]
    assert bm.cached_prefix_tokens(longer) == 12


def test_register_blocks_keeps_the_first_copy_of_a_duplicate_prefix() -> None:
    bm = BlockManager(16, BS)
    tokens = list(range(12))
    hashes: list[int] = []
    extend_block_hashes(tokens, hashes, BS, 3)
    a, b = bm.allocate(3), bm.allocate(3)  # two requests computed the same prompt at once
    bm.register_blocks(a, hashes, 0, 3)
    bm.register_blocks(b, hashes, 0, 3)
    assert bm.num_cached_blocks == 3 and bm.match(tokens, [], 3) == a
    bm.free(b)  # the copies were never published: they go straight back to the free list
    assert bm.num_free_blocks == 13 and bm.num_cached_blocks == 3


def _chain(count: int) -> tuple[list[int], list[int]]:
    tokens = list(range(count * BS))
    return tokens, _hashes(tokens)


def test_evicting_a_chain_head_keeps_the_block_a_later_sequence_added() -> None:
    bm = BlockManager(8, BS)
    tokens, hashes = _chain(2)
    owner = bm.allocate(1)
    bm.register_blocks(owner, hashes, 0, 1)
    later = bm.allocate(2)  # its block 0 duplicates the owner's; its block 1 extends the chain
    bm.register_blocks(later, hashes, 0, 2)
    assert bm.match(tokens, [], 2) == [owner[0], later[1]] and bm.num_cached_blocks == 2
    bm.free(owner)
    assert len(bm.allocate(5)) == 5  # the never-used blocks
    assert bm.allocate(1) == owner  # then the chain's head; block 1 stays cached
    assert (bm.num_cached_blocks, bm.cached_prefix_tokens(tokens)) == (1, 0)
    bm.register_blocks(owner, hashes, 0, 1)  # block 0 cached again: the chain is whole
    assert bm.match(tokens, [], 2) == [owner[0], later[1]]


def test_evicting_inside_a_chain_splits_it() -> None:
    bm = BlockManager(8, BS)
    tokens, hashes = _chain(3)
    owner = bm.allocate(2)
    bm.register_blocks(owner, hashes, 0, 2)
    later = bm.allocate(3)  # duplicates blocks 0 and 1, adds block 2 after the owner's
    bm.register_blocks(later, hashes, 0, 3)
    assert bm.match(tokens, [], 3) == [*owner, later[2]]
    bm.free(owner)  # queued tail first: block 1, then block 0
    bm.allocate(3)
    assert bm.allocate(1) == owner[1:]
    assert (bm.num_cached_blocks, bm.cached_prefix_tokens(tokens)) == (2, BS)
    assert bm.allocate(1) == owner[:1]
    assert (bm.num_cached_blocks, bm.cached_prefix_tokens(tokens)) == (1, 0)
    again = [owner[1], owner[0]]
    bm.register_blocks(again, hashes, 0, 2)
    assert bm.match(tokens, [], 3) == [*again, later[2]]
    assert bm.cached_prefix_tokens(tokens) == 3 * BS


def test_hit_and_free_cycles_keep_the_eviction_queue_bounded() -> None:
    bm = BlockManager(64, BS)
    tokens = list(range(40))
    blocks = _registered(bm, tokens, [])
    bm.free(blocks)
    for _ in range(3000):
        hit = bm.match(tokens, [], 10)
        assert hit == blocks
        bm.acquire(hit)
        bm.free(hit)
    assert len(bm._lru) - bm._lru_head <= 2 * bm.num_free_blocks + 4096
    assert bm.allocate(54) == list(range(10, 64))  # the never-used blocks first
    assert bm.allocate(3) == blocks[-3:][::-1]  # then the chain's tail, last block first
    assert bm.cached_prefix_tokens(tokens) == 28


def test_given_contents_hash_like_the_tokens() -> None:
    tokens = [*range(30), 7, 7, 7]
    plain = _hashes(tokens)
    contents: list[int | None] = [hash(tuple(tokens[k * BS : (k + 1) * BS])) for k in range(8)]
    contents[0] = contents[5] = None  # hashed from the tokens
    given: list[int] = [plain[0]]
    extend_block_hashes(tokens, given, BS, 8, contents[1:])
    assert given == plain
    with pytest.raises(ValueError):
        extend_block_hashes(tokens, [], BS, 9)


def test_lookups_reuse_a_given_hash_cache() -> None:
    bm = BlockManager(8, BS)
    tokens = list(range(10))
    _cache(bm, tokens)
    hashes = _hashes(tokens)
    assert bm.cached_prefix_tokens(tokens, hashes) == 8 and len(hashes) == 2
    assert bm.cached_prefix_tokens(tokens, [999, 998]) == 0  # the given hashes are trusted
