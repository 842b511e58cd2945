from __future__ import annotations

import pytest

from bench.traces.model import Conversation, TraceTurn
from bench.traces.textgen import (
    VOCABULARY,
    PromptSynth,
    chat_prompt_tokens,
    count_words,
)
from bench.traces.workloads import WorkloadSpec, generate_matrix
from sim.worker.tokenizer import count_tokens, render_chat, tokenize


def _conv(
    session: str, blocks: tuple[tuple[int, ...], ...], new: int, system: int = 0
) -> Conversation:
    turns = tuple(TraceTurn(0.0, new, 3, prefix_blocks=b) for b in blocks)
    return Conversation(session, turns, system_prefix_tokens=system)


def test_vocabulary_is_plain_words() -> None:
    assert len(VOCABULARY) == len(set(VOCABULARY)) == 4900
    assert all(w.isalpha() and w.islower() and len(w) == 4 for w in VOCABULARY)


def test_exact_counts_and_multi_turn_extension() -> None:
    synth = PromptSynth(block_tokens=4)
    conv = _conv("s", ((1, 2, 3), (1, 2, 4, 5)), new=5, system=3)
    first = synth.messages_for(conv, 0)
    assert [m["role"] for m in first] == ["system", "user"]
    assert [count_words(m["content"]) for m in first] == [3, 5]
    second = synth.messages_for(conv, 1, first, "the actual answer")
    assert second[:2] == first
    assert second[2] == {"role": "assistant", "content": "the actual answer"}
    assert second[3]["role"] == "user" and count_words(second[3]["content"]) == 5
    # Content positions: system 0-2, user 3-7, answer (3 nominal tokens) 8-10, user 11-15.
    words = synth.block_words
    assert first[0]["content"].split() == list(words(1)[:3])
    assert first[1]["content"].split() == [words(1)[3], *words(2)[:4]]
    assert second[3]["content"].split() == [words(4)[3], *words(5)[:4]]
    # Prompt tokens the sim worker reports: content words plus one tag per message and one more.
    assert chat_prompt_tokens(first) == count_tokens(render_chat(first)) == 3 + 5 + 2 + 1
    assert chat_prompt_tokens(second) == count_tokens(render_chat(second)) == 3 + 5 + 3 + 5 + 5
    # The rendering of turn 1 extends turn 0's, so prefix caching hits across turns.
    assert tokenize(render_chat(second))[: count_tokens(render_chat(first))] == tokenize(
        render_chat(first)
    )


def test_shared_blocks_give_shared_text_across_sessions() -> None:
    synth = PromptSynth(block_tokens=4)
    a = synth.messages_for(_conv("a", ((7, 8, 9),), new=12), 0)[0]["content"].split()
    b = synth.messages_for(_conv("b", ((7, 8, 10),), new=12), 0)[0]["content"].split()
    assert a[:8] == b[:8]
    assert a[8:] != b[8:]
    # A fresh instance (another process) gives the same words, even after cache eviction.
    other = PromptSynth(block_tokens=4, cache_blocks=1)
    assert other.messages_for(_conv("a", ((7, 8, 9),), new=12), 0)[0]["content"].split() == a


def test_positions_past_known_blocks_are_per_session() -> None:
    synth = PromptSynth(block_tokens=4)
    a = synth.user_text(_conv("a", ((7,),), new=10), 0).split()
    b = synth.user_text(_conv("b", ((7,),), new=10), 0).split()
    assert len(a) == len(b) == 10
    assert a[:4] == b[:4] == list(synth.block_words(7))
    assert a[4:] != b[4:]
    assert synth.user_text(_conv("a", ((7,),), new=10), 0).split() == a


def test_completion_prompt() -> None:
    synth = PromptSynth(block_tokens=4)
    conv = _conv("s", ((1, 2, 3), (1, 2, 4, 5)), new=5, system=3)
    first = synth.prompt_for_completion(conv, 0)
    assert count_words(first) == 8
    second = synth.prompt_for_completion(conv, 1, first, "an answer of six words here")
    assert second.startswith(first + " an answer of six words here ")
    assert count_words(second) == 8 + 6 + 5


def test_zero_new_input_and_no_system() -> None:
    synth = PromptSynth(block_tokens=4)
    conv = _conv("s", ((), ()), new=0)
    first = synth.messages_for(conv, 0)
    assert first == [{"role": "user", "content": ""}]
    assert chat_prompt_tokens(first) == count_tokens(render_chat(first)) == 2
    assert synth.prompt_for_completion(conv, 1, "x", "") == "x"


def test_later_turn_needs_history() -> None:
    synth = PromptSynth()
    conv = _conv("s", ((), ()), new=2)
    with pytest.raises(ValueError, match="previous"):
        synth.messages_for(conv, 1)
    with pytest.raises(ValueError, match="previous"):
        synth.prompt_for_completion(conv, 1)


def test_generated_matrix_counts_are_exact() -> None:
    trace = generate_matrix(
        WorkloadSpec(
            prompt_tokens=(700,),
            output_tokens=(50,),
            reuse=("system-prefix", "multi-turn"),
            turns=(3,),
            sessions_per_class=2,
            system_prefix_tokens=1024,
        )
    )
    synth = PromptSynth(trace.block_tokens)
    system_texts = set()
    for conv in trace.conversations:
        messages = synth.messages_for(conv, 0)
        answers = []
        for i in range(1, len(conv.turns)):
            answer = " ".join(["ok"] * conv.turns[i - 1].output_tokens)
            answers.append(answer)
            messages = synth.messages_for(conv, i, messages, answer)
        last = len(conv.turns) - 1
        content = sum(count_words(m["content"]) for m in messages)
        assert content == conv.context_tokens(last)
        if conv.system_prefix_tokens:
            system_texts.add(messages[0]["content"])
    assert len(system_texts) == 1


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError):
        PromptSynth(block_tokens=0)
