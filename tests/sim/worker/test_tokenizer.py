from __future__ import annotations

import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sim.worker.tokenizer import (
    VOCABULARY,
    WordGenerator,
    chat_token_ids,
    count_tokens,
    render_chat,
    token_id,
    tokenize,
)


def test_token_id_is_masked_crc32() -> None:
    assert token_id("hello") == zlib.crc32(b"hello") & 0x7FFFFFFF
    assert token_id("héllo") == zlib.crc32("héllo".encode()) & 0x7FFFFFFF
    assert all(0 <= token_id(w) < 2**31 for w in VOCABULARY)


def test_token_ids_are_stable_across_processes() -> None:
    # A fresh interpreter has a different str hash salt; ids must not depend on it.
    code = "from sim.worker.tokenizer import tokenize; print(tokenize('the quick brown fox'))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
        cwd=Path(__file__).resolve().parents[3],
    ).stdout
    assert out.strip() == str(tokenize("the quick brown fox"))


@pytest.mark.parametrize(
    ("text", "count"),
    [("", 0), ("   ", 0), ("one", 1), ("a b  c\n\td", 4), ("  lead and trail  ", 3)],
)
def test_one_token_per_whitespace_separated_word(text: str, count: int) -> None:
    assert count_tokens(text) == count
    assert tokenize(text) == [token_id(w) for w in text.split()]


def test_render_chat_template() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    assert render_chat(messages) == "<|system|> be brief <|user|> hi there <|assistant|>"
    # 2 role tags + 4 words + the generation prompt
    assert count_tokens(render_chat(messages)) == 7


def test_render_chat_content_parts_and_empty_content() -> None:
    parts: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "a b"}, {"type": "text", "text": "c"}],
        },
        {"role": "assistant", "content": None},
        {"role": "user", "content": ""},
    ]
    assert render_chat(parts) == "<|user|> a b c <|assistant|> <|user|> <|assistant|>"


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"content": "no role"}],
        [{"role": "", "content": "x"}],
        [{"role": "us er", "content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": [{"type": "text", "text": None}]}],
    ],
)
def test_render_chat_rejects_malformed_messages(messages: list[dict[str, Any]]) -> None:
    with pytest.raises(ValueError):
        render_chat(messages)


def test_multi_turn_rendering_extends_the_previous_turn_plus_answer() -> None:
    gen = WordGenerator(seed=3)
    turn1 = [{"role": "system", "content": "sys"}, {"role": "user", "content": "first question"}]
    prompt1 = tokenize(render_chat(turn1))
    answer = " ".join(gen.words("req-1", 0, 12))
    turn2 = [
        *turn1,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "second question"},
    ]
    prompt2 = tokenize(render_chat(turn2))
    answer_ids = WordGenerator.token_ids_for(answer.split())
    assert prompt2[: len(prompt1) + 12] == prompt1 + answer_ids
    assert answer_ids == tokenize(answer)


def test_word_generator_is_deterministic_and_indexable() -> None:
    a, b = WordGenerator(7), WordGenerator(7)
    words = a.words("r", 0, 50)
    assert words == b.words("r", 0, 50)
    assert a.words("r", 20, 10) == words[20:30]
    assert words != WordGenerator(8).words("r", 0, 50)
    assert words != a.words("s", 0, 50)
    assert all(w in VOCABULARY for w in words)
    key = a.request_key("r")
    assert [WordGenerator.token_id_at(key, i) for i in range(50)] == tokenize(" ".join(words))
    assert WordGenerator.token_ids_at(key, 20, 10) == tokenize(" ".join(words[20:30]))
    assert WordGenerator.token_ids_at(key, 3, 0) == []


def test_word_generator_spreads_over_the_vocabulary() -> None:
    words = WordGenerator(0).words("spread", 0, 20_000)
    assert len(set(words)) > 0.95 * len(VOCABULARY)


def test_vocabulary_is_plain_lowercase_words() -> None:
    assert 200 <= len(VOCABULARY) == len(set(VOCABULARY))
    assert all(w.isalpha() and w.islower() and w.isascii() for w in VOCABULARY)
    assert len({token_id(w) for w in VOCABULARY}) == len(VOCABULARY)


def test_token_ids_for_unknown_words_falls_back_to_crc() -> None:
    assert WordGenerator.token_ids_for(["the", "zebra"]) == [token_id("the"), token_id("zebra")]


# long enough, often, to be cached (256 characters)
_TEXT = st.lists(st.sampled_from(["the", "sea", " ", "\n", "\t", "x", "é"]), max_size=300).map(
    "".join
)
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]),
     "content": st.one_of(_TEXT, st.none(),
                          st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                          "text": _TEXT}), max_size=3))},
)  # fmt: skip


@given(st.lists(_MESSAGE, min_size=1, max_size=6))
def test_chat_token_ids_equal_the_rendered_prompts_tokens(messages: list[dict[str, Any]]) -> None:
    expected = tokenize(render_chat(messages))
    assert chat_token_ids(messages) == expected
    assert chat_token_ids(messages) == expected  # again, long messages from the cache


def test_a_resent_conversation_is_tokenised_from_the_cache() -> None:
    history = " ".join(VOCABULARY) * 4
    turn = [{"role": "user", "content": history}]
    first = chat_token_ids(turn)
    second = chat_token_ids([*turn, {"role": "assistant", "content": "ok"},
                             {"role": "user", "content": "more"}])  # fmt: skip
    assert second[: len(first) - 1] == first[:-1]  # the same ids for the resent message
    assert second[-4:] == [token_id("ok"), token_id("<|user|>"), token_id("more"),
                           token_id("<|assistant|>")]  # fmt: skip
