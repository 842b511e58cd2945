"""One scheduling decision of the continuous-batching engine (vLLM v1 style).

Order within a step: one decode token for every running request that finished its prefill
(allocating a block when the next token starts one, preempting by recompute when none is
free), then the next chunks of running prefills, then admissions from the waiting queue in
FCFS order, within the token budget and the sequence cap. Admission takes all blocks of the
request's uncached context at once, so a request once admitted never waits for blocks
during its prefill; only decodes allocate (and preempt) later.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sim.engine.kvcache import extend_block_hashes
from sim.engine.requests import SeqState

if TYPE_CHECKING:
    from sim.engine.engine import Engine

# (request, tokens computed for it in this step), in batch order.
Batch = list[tuple[SeqState, int]]
# The batch and the totals the cost model prices it by: decode tokens, the sum of their
# contexts (the new token included), prefill tokens, the sum of the context before each
# prefill chunk, and the sum over chunks of new x (context before + new / 2).
Plan = tuple[Batch, int, int, int, int, float]


def schedule(engine: Engine) -> Plan:
    config = engine.config
    blocks = engine.blocks
    bs = blocks.block_size
    budget = config.max_num_batched_tokens
    chunk = config.chunked_prefill
    running = engine.running
    batch: Batch = []
    add = batch.append
    decode_context_sum = 0
    preempted = False

    # 1. Decodes, in admission order; victims come from the tail (the most recently admitted).
    i = 0
    while i < len(running) and budget > 0:
        seq = running[i]
        n_tokens = len(seq.tokens)
        if n_tokens - seq.num_computed != 1:
            i += 1
            continue
        if n_tokens > len(seq.block_ids) * bs:
            block = blocks.allocate_one()
            while block is None:
                victim = running.pop()
                engine.preempt(victim)
                preempted = True
                if victim is seq:
                    break
                block = blocks.allocate_one()
            if block is None:
                break  # preempted itself: everything after it was preempted before
            seq.block_ids.append(block)
        add((seq, 1))
        decode_context_sum += n_tokens
        budget -= 1
        i += 1
    decode_tokens = len(batch)
    prefill_tokens = prefill_context_sum = 0
    pairs = 0.0

    # 2. Running prefills continue. Only chunked prefill leaves a prompt unfinished: without
    # it every admitted prompt is computed whole in its first step.
    prefilling = False
    if chunk is not None:
        for seq in running:
            if budget == 0:
                break
            before = seq.num_computed
            remaining = len(seq.tokens) - before
            if remaining <= 1:
                continue
            n = min(remaining, chunk, budget)
            add((seq, n))
            prefill_tokens += n
            prefill_context_sum += before
            pairs += n * (before + n * 0.5)
            budget -= n
            prefilling = True

    # 3. Admissions. Skipped after a preemption so a victim is not readmitted at once.
    waiting = engine.waiting
    if preempted or not waiting:
        return batch, decode_tokens, decode_context_sum, prefill_tokens, prefill_context_sum, pairs
    limit = config.max_num_seqs
    now = engine.clock.now()
    caching = blocks.enable_prefix_caching
    while waiting and budget > 0 and len(running) < limit:
        seq = waiting[0]
        tokens = seq.tokens
        n_tokens = len(tokens)
        # At least the last token is computed, even on a full hit (as vLLM).
        lookup = (n_tokens - 1) // bs
        if caching and len(seq.hashes) < lookup:
            # All of them: the blocks computed here are registered under them after the step.
            extend_block_hashes(tokens, seq.hashes, bs, n_tokens // bs)
        matched = blocks.match(tokens, seq.hashes, lookup)
        local = len(matched) * bs
        start = max(local, min(seq.preloaded, n_tokens - 1))
        n = n_tokens - start
        if chunk is not None:
            n = min(n, chunk, budget)
        elif n > budget and (prefilling or n <= config.max_num_batched_tokens):
            break  # a prompt larger than the whole budget runs as the step's only prefill
        new_blocks = -(-n_tokens // bs) - len(matched)
        if new_blocks + blocks.evictable_among(matched) > blocks.num_free_blocks:
            break
        waiting.popleft()
        blocks.acquire(matched)
        matched += blocks.allocate(new_blocks)
        seq.block_ids = matched
        if seq.preloaded:
            _register_preloaded(engine, seq, local // bs)
        blocks.record_query(n_tokens, local)
        if seq.first_scheduled_time < 0.0:
            seq.first_scheduled_time = now
            seq.cached_tokens = start
            seq.preloaded_stat = start - local
            seq.external_tokens = max(0, min(seq.preloaded, n_tokens) - local)
        seq.preloaded = 0  # pulled KV is gone once the request is preempted
        seq.num_computed = start
        running.append(seq)
        add((seq, n))
        prefill_tokens += n
        prefill_context_sum += start
        pairs += n * (start + n * 0.5)
        budget -= n
        prefilling = True
    return batch, decode_tokens, decode_context_sum, prefill_tokens, prefill_context_sum, pairs


def _register_preloaded(engine: Engine, seq: SeqState, first_block: int) -> None:
    """Pulled KV fills the request's blocks: publish its full blocks for later turns."""
    blocks = engine.blocks
    full = min(seq.preloaded, len(seq.tokens)) // blocks.block_size
    if full <= first_block or not blocks.enable_prefix_caching:
        return
    extend_block_hashes(seq.tokens, seq.hashes, blocks.block_size, full)
    blocks.register_blocks(seq.block_ids, seq.hashes, first_block, full)
