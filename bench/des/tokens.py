"""Prompt token ids for a trace's turns, laid out as the live replay's prompts are.

The live replay sends chat messages (`bench.textgen.PromptSynth`) that the simulated worker
renders as `<|role|> content ...` plus a final `<|assistant|>`. This module builds the same
token sequence directly, without text: one tag token per message and one for the generation
prompt; content position p of turn i is word p % block_tokens of block
`turn.prefix_blocks[p // block_tokens]` when that block is known, else a token unique to this
position of this turn. Only equality matters to the engine's prefix cache, so ids are plain
integers: equal blocks give equal ids, unique positions ids nothing else has. A later turn is
the previous prompt, the previous answer's generated ids, then `<|user|>`, its new input and
`<|assistant|>`, so it extends the previous prompt exactly as the live replay's does.
"""

from __future__ import annotations

from bench.traces import Conversation
from sim.tokenizer import token_id

SYSTEM_TAG = token_id("<|system|>")
USER_TAG = token_id("<|user|>")
ASSISTANT_TAG = token_id("<|assistant|>")

# Generated ids are CRC-32 values below 2**31; block and unique ids live above them.
_BLOCK_BASE = 1 << 32
_UNIQUE_BASE = 1 << 48


class PromptBuilder:
    """Token ids of each turn's prompt; deterministic for a trace replayed in the same order."""

    def __init__(self, block_tokens: int) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self.block_tokens = block_tokens
        self._block_index: dict[int, int] = {}
        self._next_unique = _UNIQUE_BASE

    def first_prompt(self, conversation: Conversation) -> list[int]:
        """Turn 0: an optional system message, the user message, the generation prompt."""
        prompt: list[int] = []
        system = conversation.system_prefix_tokens
        if system:
            prompt.append(SYSTEM_TAG)
            self._span(conversation, 0, 0, system, prompt)
        self._user(conversation, 0, prompt)
        return prompt

    def next_prompt(
        self, conversation: Conversation, turn_index: int, previous: list[int], answer: list[int]
    ) -> list[int]:
        """Turn `turn_index` > 0: the previous prompt and answer, then the new user message."""
        prompt = previous + answer
        self._user(conversation, turn_index, prompt)
        return prompt

    def filler(self, count: int) -> list[int]:
        """A stand-in answer of `count` tokens for a turn that got none (as the replay's)."""
        first = self._next_unique
        self._next_unique = first + count
        return list(range(first, self._next_unique))

    def _user(self, conversation: Conversation, turn_index: int, out: list[int]) -> None:
        end = conversation.context_tokens(turn_index)
        start = end - conversation.turns[turn_index].new_input_tokens
        out.append(USER_TAG)
        self._span(conversation, turn_index, start, end, out)
        out.append(ASSISTANT_TAG)

    def _span(
        self, conversation: Conversation, turn_index: int, start: int, end: int, out: list[int]
    ) -> None:
        """Append the ids at content positions [start, end) of a turn (as PromptSynth._span)."""
        size = self.block_tokens
        blocks = conversation.turns[turn_index].prefix_blocks
        known_end = min(end, len(blocks) * size)
        position = start
        while position < known_end:
            index, offset = divmod(position, size)
            take = min(size - offset, known_end - position)
            base = _BLOCK_BASE + self._dense(blocks[index]) * size + offset
            out.extend(range(base, base + take))
            position += take
        if position < end:
            first = self._next_unique
            self._next_unique = first + (end - position)
            out.extend(range(first, self._next_unique))

    def _dense(self, block_id: int) -> int:
        index = self._block_index.get(block_id)
        if index is None:
            index = self._block_index[block_id] = len(self._block_index)
        return index
