"""Prompt token ids for a trace's turns, laid out as the live replay's prompts are.

The live replay sends chat messages (`bench.traces.textgen.PromptSynth`) that the simulated worker
renders as `<|role|> content ...` plus a final `<|assistant|>`. This module builds the same
token sequence directly, without text: one tag token per message and one for the generation
prompt; content position p of turn i comes from block `turn.prefix_blocks[p // block_tokens]`
at offset p % block_tokens when that block is known, else it is a token unique to this
position of this turn. A later turn is the previous prompt, the previous answer's generated
ids, then `<|user|>`, its new input and `<|assistant|>`, so it extends the previous prompt
exactly as the live replay's does.

Only equality of prefixes matters to the engine's prefix cache, so ids are plain integers.
A run of consecutive positions of one block (a span's part within one block) starts with an
id naming that block and offset; its other positions take a shared id per offset (-offset),
so building a prompt copies references instead of creating a new int per token. A run
always follows a tag or the previous block's run (one ending at the block's end), so a
position's id and its predecessor's determine the block and offset exactly: two prompts
share a prefix iff they would with a distinct id for every (block, offset).
"""

from __future__ import annotations

from collections import OrderedDict

from bench.traces.model import Conversation
from sim.engine.kvcache import ROOT_HASH, block_hash_at, extend_block_hashes
from sim.worker.tokenizer import token_id

SYSTEM_TAG = token_id("<|system|>")
USER_TAG = token_id("<|user|>")
ASSISTANT_TAG = token_id("<|assistant|>")

# Generated ids are CRC-32 values below 2**31; block and unique ids live above them, shared
# offset ids below zero.
_BLOCK_BASE = 1 << 32
_UNIQUE_BASE = 1 << 48

# A block run appended to a prompt: (its position there, its offset in the block, its length).
_Run = tuple[int, int, int]
# Hash chains through runs' shared ids remembered (see `PromptBuilder._hash`), at most: about
# 1.3 kB each at 512-token trace blocks and 16-token KV blocks. On the Mooncake trace this many
# save 2/3 of the prompts' chained hashes (twice as many, hardly more).
_CHAINS_KEPT = 32768


class PromptBuilder:
    """Token ids of each turn's prompt; deterministic for a trace replayed in the same order.

    Given the workers' `kv_block_size`, it also extends a prompt's KV block hashes: a KV
    block inside a run holds shared ids only, whose content hash it looks up by offset.
    """

    def __init__(self, block_tokens: int, kv_block_size: int | None = None) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self.block_tokens = block_tokens
        self.kv_block_size = kv_block_size
        self._pool = [-offset for offset in range(block_tokens)]
        self._block_index: dict[int, int] = {}
        self._next_unique = _UNIQUE_BASE
        # hash(tuple(ids)) of the KV block starting at each offset of a run's shared ids
        bs = kv_block_size or block_tokens + 1
        pool = self._pool
        self._contents = [hash(tuple(pool[a : a + bs])) for a in range(block_tokens - bs + 1)]
        self._tail = tuple(pool[1:])  # a whole block's shared ids
        # (parent hash, first shared offset, KV blocks) -> the chained hashes of those blocks
        self._chains: OrderedDict[tuple[int, int, int], tuple[int, ...]] = OrderedDict()

    def first_prompt(
        self, conversation: Conversation, hashes: list[int] | None = None
    ) -> list[int]:
        """Turn 0: an optional system message, the user message, the generation prompt.

        `hashes` (empty) receives the prompt's KV block hashes.
        """
        prompt: list[int] = []
        runs: list[_Run] = []
        system = conversation.system_prefix_tokens
        if system:
            prompt.append(SYSTEM_TAG)
            self._span(conversation, 0, 0, system, prompt, runs)
        self._user(conversation, 0, prompt, runs)
        if hashes is not None:
            self._hash(prompt, hashes, runs)
        return prompt

    def next_prompt(
        self, conversation: Conversation, turn_index: int, previous: list[int],
        answer: list[int], hashes: list[int] | None = None,
    ) -> list[int]:  # fmt: skip
        """Turn `turn_index` > 0: the previous prompt and answer, then the new user message.

        `hashes`: the previous prompt's KV block hashes, extended to this prompt's.
        """
        prompt = previous + answer
        runs: list[_Run] = []
        self._user(conversation, turn_index, prompt, runs)
        if hashes is not None:
            self._hash(prompt, hashes, runs)
        return prompt

    def filler(self, count: int) -> list[int]:
        """A stand-in answer of `count` tokens for a turn that got none (as the replay's)."""
        first = self._next_unique
        self._next_unique = first + count
        return list(range(first, self._next_unique))

    def _user(
        self, conversation: Conversation, turn_index: int, out: list[int], runs: list[_Run]
    ) -> None:
        end = conversation.context_tokens(turn_index)
        start = end - conversation.turns[turn_index].new_input_tokens
        out.append(USER_TAG)
        self._span(conversation, turn_index, start, end, out, runs)
        out.append(ASSISTANT_TAG)

    def _span(
        self, conversation: Conversation, turn_index: int, start: int, end: int, out: list[int],
        runs: list[_Run],
    ) -> None:  # fmt: skip
        """Append the ids at content positions [start, end) of a turn (as PromptSynth._span)."""
        size = self.block_tokens
        blocks = conversation.turns[turn_index].prefix_blocks
        known_end = min(end, len(blocks) * size)
        pool = self._pool
        position = start
        while position < known_end:
            index, offset = divmod(position, size)
            take = min(size - offset, known_end - position)
            runs.append((len(out), offset, take))
            out.append(_BLOCK_BASE + self._dense(blocks[index]) * size + offset)
            out += self._tail if take == size else pool[offset + 1 : offset + take]
            position += take
        if position < end:
            first = self._next_unique
            self._next_unique = first + (end - position)
            out.extend(range(first, self._next_unique))

    def _hash(self, prompt: list[int], hashes: list[int], runs: list[_Run]) -> None:
        """Extend `hashes` to the prompt's full KV blocks; `runs` holds every run past them.

        The KV blocks wholly among a run's shared ids hash alike wherever the run is, given the
        hash before them: prompts that share a prefix chain through the same runs from the same
        hashes, so those chains are remembered (the most recently used ones).
        """
        bs = self.kv_block_size
        if bs is None:
            return
        first = len(hashes)
        upto = len(prompt) // bs
        if first >= upto:
            return
        shared: list[tuple[int, int, int]] = []  # (first KV block, end, offset of its ids)
        for at, offset, take in runs:
            k0 = max(-(-(at + 1) // bs), first)
            k1 = min((at + take) // bs, upto)
            if k0 < k1:
                shared.append((k0, k1, offset + k0 * bs - at))
        chains = self._chains
        for i, (k0, k1, a0) in enumerate(shared):
            gap = k0 - len(hashes)  # the blocks before them, by their ids: usually the one
            if gap == 1:  # holding the run's first id
                hashes.append(block_hash_at(prompt, hashes, bs, k0 - 1))
            elif gap > 1:
                extend_block_hashes(prompt, hashes, bs, k0)
            key = (hashes[-1] if hashes else ROOT_HASH, a0, k1 - k0)
            chain = chains.get(key)
            if chain is None:
                self._chain_rest(prompt, hashes, upto, shared[i:])
                return
            hashes += chain
            chains.move_to_end(key)
        if len(hashes) < upto:
            extend_block_hashes(prompt, hashes, bs, upto)

    def _chain_rest(
        self, prompt: list[int], hashes: list[int], upto: int, shared: list[tuple[int, int, int]]
    ) -> None:
        """The hashes after a chain not remembered, in one pass: past a prefix not seen before
        every hash is new. Each run's chain is remembered for the prompts that share it."""
        bs = self.kv_block_size
        assert bs is not None
        start = len(hashes)
        contents: list[int | None] = [None] * (upto - start)
        for k0, k1, a0 in shared:
            contents[k0 - start : k1 - start] = self._contents[a0 : a0 + (k1 - k0) * bs : bs]
        extend_block_hashes(prompt, hashes, bs, upto, contents)
        chains = self._chains
        for k0, k1, a0 in shared:
            chains[(hashes[k0 - 1] if k0 else ROOT_HASH, a0, k1 - k0)] = tuple(hashes[k0:k1])
        while len(chains) > _CHAINS_KEPT:
            chains.popitem(last=False)

    def _dense(self, block_id: int) -> int:
        index = self._block_index.get(block_id)
        if index is None:
            index = self._block_index[block_id] = len(self._block_index)
        return index
