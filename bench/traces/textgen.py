"""Prompt text for replaying a trace: exact token counts under the sim tokenizer.

The sim tokenizer counts one token per whitespace-separated word, so a message of n words
costs n content tokens. Text is laid out over the conversation's content positions (system
prefix, then each turn's new input after the history): position p of turn i takes word
p % block_tokens of block `turn.prefix_blocks[p // block_tokens]`, so prompts naming the same
block at the same place get the same words and prefix caches hit across sessions. Positions
past the known blocks take words drawn from (session id, turn index), unique to that turn.
A block's words depend on its id only. Answers are not synthesised: a later turn's messages
are the previous messages, the assistant's actual answer (from the replay) and the new user
message, so every prompt extends the previous one.

Chat template overhead: the sim worker renders each message as `<|role|> content`, joined by
spaces, then a final `<|assistant|>`: `TEMPLATE_TOKENS_PER_MESSAGE` (1) per message plus
`TEMPLATE_TOKENS_PER_PROMPT` (1). Message contents carry exactly the trace's token counts;
`chat_prompt_tokens` adds the template to give the prompt_tokens the worker reports. The
/v1/completions prompt (`prompt_for_completion`) has no template: its count is exact.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from bench.traces.model import Conversation, TraceTurn

TEMPLATE_TOKENS_PER_MESSAGE = 1
TEMPLATE_TOKENS_PER_PROMPT = 1

_ONSETS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
# 4,900 pronounceable lowercase words (consonant-vowel-consonant-vowel), no whitespace.
VOCABULARY: tuple[str, ...] = tuple(
    a + b + c + d for a in _ONSETS for b in _VOWELS for c in _ONSETS for d in _VOWELS
)

Message = dict[str, str]


def count_words(text: str) -> int:
    return len(text.split())


def chat_prompt_tokens(messages: Sequence[Message]) -> int:
    """Tokens the sim worker counts for `messages`: content words plus the chat template."""
    words = sum(count_words(m["content"]) for m in messages)
    return words + TEMPLATE_TOKENS_PER_MESSAGE * len(messages) + TEMPLATE_TOKENS_PER_PROMPT


def _join(*parts: str) -> str:
    return " ".join(part for part in parts if part)


class PromptSynth:
    """Deterministic prompt text for a trace's conversations (see the module docstring)."""

    def __init__(self, block_tokens: int = 512, cache_blocks: int = 8192) -> None:
        if block_tokens < 1 or cache_blocks < 1:
            raise ValueError("block_tokens and cache_blocks must be >= 1")
        self.block_tokens = block_tokens
        self._cache_blocks = cache_blocks
        self._blocks: dict[int, tuple[str, ...]] = {}

    def block_words(self, block_id: int) -> tuple[str, ...]:
        """The `block_tokens` words of a block; the same for the same id, in any process."""
        words = self._blocks.get(block_id)
        if words is None:
            if len(self._blocks) >= self._cache_blocks:
                self._blocks.clear()
            rng = random.Random(f"block:{block_id}")
            words = tuple(rng.choices(VOCABULARY, k=self.block_tokens))
            self._blocks[block_id] = words
        return words

    def _span(
        self, conversation: Conversation, turn_index: int, turn: TraceTurn, start: int, end: int
    ) -> str:
        """The words at content positions [start, end) of a turn's prompt."""
        size = self.block_tokens
        blocks = turn.prefix_blocks
        known_end = min(end, len(blocks) * size)
        words: list[str] = []
        position = start
        while position < known_end:
            index, offset = divmod(position, size)
            take = min(size - offset, known_end - position)
            words.extend(self.block_words(blocks[index])[offset : offset + take])
            position += take
        if position < end:
            rng = random.Random(f"turn:{conversation.session_id}:{turn_index}:{position}")
            words.extend(rng.choices(VOCABULARY, k=end - position))
        return " ".join(words)

    def system_text(self, conversation: Conversation) -> str:
        """The system prompt: exactly `system_prefix_tokens` words ('' when there is none)."""
        first = conversation.turns[0]
        return self._span(conversation, 0, first, 0, conversation.system_prefix_tokens)

    def user_text(self, conversation: Conversation, turn_index: int) -> str:
        """Turn `turn_index`'s new user input: exactly `new_input_tokens` words."""
        turn = conversation.turns[turn_index]
        end = conversation.context_tokens(turn_index)
        return self._span(conversation, turn_index, turn, end - turn.new_input_tokens, end)

    def messages_for(
        self,
        conversation: Conversation,
        turn_index: int,
        previous_messages: Sequence[Message] = (),
        previous_answer: str = "",
    ) -> list[Message]:
        """OpenAI chat messages for a turn.

        Turn 0: an optional system message, then the user message. A later turn: a copy of
        `previous_messages` (what the previous turn sent), the assistant's `previous_answer`
        and the new user message.
        """
        if turn_index == 0:
            messages: list[Message] = []
            system = self.system_text(conversation)
            if system:
                messages.append({"role": "system", "content": system})
        elif not previous_messages:
            raise ValueError("a later turn needs the previous turn's messages")
        else:
            messages = [dict(m) for m in previous_messages]
            messages.append({"role": "assistant", "content": previous_answer})
        messages.append({"role": "user", "content": self.user_text(conversation, turn_index)})
        return messages

    def prompt_for_completion(
        self,
        conversation: Conversation,
        turn_index: int,
        previous_prompt: str = "",
        previous_answer: str = "",
    ) -> str:
        """A /v1/completions prompt: the previous prompt, its answer and the new input."""
        user = self.user_text(conversation, turn_index)
        if turn_index == 0:
            return _join(self.system_text(conversation), user)
        if not previous_prompt:
            raise ValueError("a later turn needs the previous turn's prompt")
        return _join(previous_prompt, previous_answer, user)
