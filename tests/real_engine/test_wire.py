"""The router in front of real vLLM 0.32 engines, through the openai client: what crosses
the wire (prefix hits, a NIXL handoff, streams, usage, errors, load scraped)."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from typing import Any

import openai
import pytest

from router.fleet.telemetry import parse_worker_load
from tests.real_engine.conftest import MODEL, Router, engine_counters, words

StartRouter = Callable[..., Router]


def _greedy(**extra: Any) -> dict[str, Any]:
    return {"temperature": 0.0, "extra_body": {"ignore_eos": True}, **extra}


def test_colocate_second_turn_hits_the_prefix_cache(
    fleet: list[str], start_router: StartRouter
) -> None:
    router = start_router([("mixed", fleet[0])], "colocate")
    client = router.client("prefix-hits")
    history = [{"role": "user", "content": words(1, 400)}]
    first = client.chat.completions.create(model=str(MODEL), messages=history, max_tokens=8,
                                           **_greedy())  # fmt: skip
    assert first.usage is not None and first.usage.prompt_tokens > 256
    history += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                {"role": "user", "content": words(2, 20)}]  # fmt: skip
    second = client.chat.completions.create(model=str(MODEL), messages=history, max_tokens=8,
                                            **_greedy())  # fmt: skip
    details = second.usage.prompt_tokens_details if second.usage else None
    assert details is not None and details.cached_tokens
    # whole 128-token blocks of the first turn's prompt
    assert details.cached_tokens % 128 == 0 and details.cached_tokens >= 256


def test_nixl_handoff_moves_the_prompt_and_gives_the_undivided_text(
    fleet: list[str], start_router: StartRouter
) -> None:
    prefill, decode, whole = fleet
    router = start_router([("prefill", prefill), ("decode", decode)], "disaggregate")
    prompt = words(3, 700)
    before = engine_counters(decode)
    split = router.client("handoff").completions.create(
        model=str(MODEL), prompt=prompt, max_tokens=24, **_greedy()
    )
    after = engine_counters(decode)
    assert split.usage is not None
    prompt_tokens = split.usage.prompt_tokens
    # the decode engine pulled the whole prompt's KV and computed none of it
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == prompt_tokens
    assert after["local_compute"] == before["local_compute"]
    assert after["vllm:nixl_xfer_time_seconds_count"] == (
        before["vllm:nixl_xfer_time_seconds_count"] + 1
    )
    blocks = -(-prompt_tokens // 128)
    moved = after["vllm:nixl_bytes_transferred_sum"] - before["vllm:nixl_bytes_transferred_sum"]
    assert moved == blocks * 128 * 1024
    # an undivided greedy run of the same prompt on a third engine says the same
    with openai.OpenAI(base_url=f"{whole}/v1", api_key="unused", max_retries=0) as direct:
        undivided = direct.completions.create(model=str(MODEL), prompt=prompt, max_tokens=24,
                                              **_greedy())  # fmt: skip
    assert split.choices[0].text == undivided.choices[0].text
    (decision,) = router.decisions("handoff", count=1)
    assert decision["action"] == "handoff"
    assert decision["transferred_bytes"] == prompt_tokens * 1024  # the router's own count


@pytest.mark.parametrize("api", ["chat", "completions"])
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("usage", [True, False])
def test_streams_and_answers_with_usage_as_asked(
    fleet: list[str], start_router: StartRouter, api: str, stream: bool, usage: bool
) -> None:
    router = start_router([("prefill", fleet[1]), ("decode", fleet[2])],
                          "disaggregate")  # fmt: skip
    client = router.client(f"wire-{api}-{stream}-{usage}")
    options: dict[str, Any] = _greedy(max_tokens=12)
    if stream and usage:
        options["stream_options"] = {"include_usage": True}
    if api == "chat":
        messages = [{"role": "user", "content": words(4, 300)}]
        if stream:
            chunks = list(client.chat.completions.create(
                model=str(MODEL), messages=messages, stream=True, **options))  # fmt: skip
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reported = [c.usage for c in chunks if c.usage is not None]
        else:
            answer = client.chat.completions.create(model=str(MODEL), messages=messages,
                                                    **options)  # fmt: skip
            text, reported = answer.choices[0].message.content or "", [answer.usage]
    else:
        prompt = words(5, 300)
        if stream:
            chunks = list(client.completions.create(
                model=str(MODEL), prompt=prompt, stream=True, **options))  # fmt: skip
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            reported = [c.usage for c in chunks if c.usage is not None]
        else:
            answer = client.completions.create(model=str(MODEL), prompt=prompt, **options)
            text, reported = answer.choices[0].text, [answer.usage]
    assert text
    if stream and not usage:
        assert reported == []  # the router asked for usage itself and dropped it again
    else:
        assert len(reported) == 1 and reported[0] is not None
        assert reported[0].completion_tokens == 12


def test_load_is_scraped_from_the_real_metric_names(fleet: list[str]) -> None:
    with urllib.request.urlopen(f"{fleet[0]}/metrics", timeout=10) as answer:
        page = answer.read().decode()
    load = parse_worker_load(page, "vllm", now=time.time())
    assert load.prefix_queries is not None and load.prefix_hits is not None
    assert 0.0 <= load.kv_usage <= 1.0
    assert load.pulls is not None and load.pull_bytes is not None


def test_engine_errors_pass_through_with_their_status(
    fleet: list[str], start_router: StartRouter
) -> None:
    router = start_router([("mixed", fleet[0])], "colocate")
    client = router.client("errors")
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=str(MODEL), prompt=words(6, 5000), max_tokens=4)
    assert too_long.value.status_code == 400
    assert "context" in str(too_long.value).lower() or "length" in str(too_long.value).lower()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=str(MODEL), prompt="x", max_tokens=10_000)
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=4)
    assert unknown.value.status_code == 404
    body = unknown.value.body
    assert isinstance(body, dict) and {"message", "type"} <= set(body)
