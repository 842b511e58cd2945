"""The handoff legs exactly as PROTOCOLS.md describes vLLM's and SGLang's wire formats."""

from __future__ import annotations

import json
import random

import pytest

from router.engines import leg_body, sglang, vllm

CLIENT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
          "stream_options": {"include_usage": True}, "max_tokens": 50,
          "max_completion_tokens": 50, "min_tokens": 3, "temperature": 0.2}  # fmt: skip


def test_vllm_prefill_leg() -> None:
    leg = vllm.prefill_leg(CLIENT)
    assert leg == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False,
        "max_tokens": 1, "max_completion_tokens": 1, "temperature": 0.2,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                               "remote_engine_id": None, "remote_block_ids": None,
                               "remote_host": None, "remote_port": None},
    }  # fmt: skip
    without = vllm.prefill_leg({"prompt": "x", "max_tokens": 9})
    assert "max_completion_tokens" not in without  # only set when the client sent it


def test_vllm_decode_leg_passes_the_params_through_unchanged() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2], [3]], "opaque": {"x": 1}}
    leg = vllm.decode_leg(CLIENT, params)
    assert leg == {**CLIENT, "kv_transfer_params": params}
    assert "kv_transfer_params" not in vllm.decode_leg(CLIENT, None)


def test_sglang_legs_are_identical_with_one_room() -> None:
    prefill, decode = sglang.legs(CLIENT, "10.0.0.1", 8998, random.Random(1))
    assert prefill == decode
    assert prefill["bootstrap_host"] == "10.0.0.1" and prefill["bootstrap_port"] == 8998
    assert 0 <= prefill["bootstrap_room"] < 2**63
    assert {k: v for k, v in prefill.items() if not k.startswith("bootstrap_")} == CLIENT


def test_usage_is_requested_without_losing_client_options() -> None:
    body = leg_body.with_usage_requested({"stream": True, "stream_options": {"x": 1}})
    assert body["stream_options"] == {"x": 1, "include_usage": True}


def test_prefill_token_becomes_the_first_stream_frames() -> None:
    reply = vllm.parse_prefill_reply(
        b'{"id": "chatcmpl-7", "created": 5, "model": "m", "choices": [{"index": 0,'
        b' "message": {"role": "assistant", "content": "Hello"}}], "kv_transfer_params": {}}'
    )
    frames = vllm.first_token_frames(reply, chat=True).split(b"\n\n")
    assert frames[0].startswith(b"data: ") and b'"role":"assistant"' in frames[0]
    assert b'"delta":{"content":"Hello"}' in frames[1] and b'"id":"chatcmpl-7"' in frames[1]


@pytest.mark.parametrize(
    ("usage", "cached"),
    [
        ({"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}, 4),
        # fields an engine adds must not fail the handoff
        ({"prompt_tokens_details": {"cached_tokens": 4, "image_tokens": {"n": 1}}}, 4),
        ({"prompt_tokens": 9, "prompt_tokens_details": None}, None),
        ({"prompt_tokens": 9}, None),
        ({"prompt_tokens_details": [4]}, None),
        ({"prompt_tokens_details": {"cached_tokens": -1}}, None),
        (None, None),
    ],
)
def test_the_prefill_reply_says_what_its_worker_found_cached(
    usage: dict[str, object] | None, cached: int | None
) -> None:
    raw = json.dumps({"choices": [], "usage": usage}).encode()
    assert vllm.parse_prefill_reply(raw).cached_tokens == cached


@pytest.mark.parametrize(
    ("payload", "engine", "expected"),
    [
        (
            b'{"model":"m","stream":true}',
            "vllm",
            {"priority": 1700000002500, "model": "m", "stream": True},
        ),
        (b"{}", "vllm", {"priority": 1700000002500}),
        (b" \n{ }", "vllm", {"priority": 1700000002500}),
        # SGLang admits higher values first: the turn due first gets the highest
        (b'{"model":"m"}', "sglang", {"priority": -1700000002500, "model": "m"}),
    ],
)
def test_a_due_priority_is_spliced_into_the_body(
    payload: bytes, engine: str, expected: dict[str, object]
) -> None:
    out = leg_body.with_priority(payload, 1700000002500, engine)
    assert json.loads(out) == expected
    assert out.endswith(payload[payload.index(b"{") + 1 :])  # the rest stays byte for byte
