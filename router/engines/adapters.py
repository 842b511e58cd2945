"""Engine adapters: how a handoff's legs are written for vLLM (NixlConnector) and SGLang.

Bodies are the client's JSON object, decoded once into a dict and re-encoded per leg; the
router never rewrites fields it does not have to.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec

from router.turn.usage import reported_cached_tokens

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode

# Fields the prefill leg must not carry (vLLM's reference proxy removes them).
_PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")


def decode_body(raw: bytes) -> dict[str, Any]:
    body = _decode(raw)
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    return body


def encode_body(body: dict[str, Any]) -> bytes:
    return _encode(body)


def with_priority(payload: bytes, priority: int, engine: str) -> bytes:
    """A request body (a JSON object without `priority`) asking an engine with priority
    scheduling to admit it as `priority` says, lower first; spliced in, not re-encoded.
    SGLang admits higher values first unless told otherwise, so it gets the negation."""
    value = -priority if engine == "sglang" else priority
    start = payload.index(b"{") + 1
    comma = b"" if payload[start:].lstrip().startswith(b"}") else b","
    return b'%b"priority":%d%b%b' % (payload[:start], value, comma, payload[start:])


def with_usage_requested(body: dict[str, Any]) -> dict[str, Any]:
    """The same streaming request, asking the worker for a final usage chunk.

    The router needs exact token counts for every turn; when the client did not ask for usage
    the relay drops that chunk again before it reaches the client.
    """
    out = dict(body)
    options = dict(out.get("stream_options") or {})
    options["include_usage"] = True
    out["stream_options"] = options
    return out


def vllm_prefill_leg(body: dict[str, Any]) -> dict[str, Any]:
    """NixlConnector prefill leg: non-streaming, one token, asks the worker to hold the KV."""
    leg = {key: value for key, value in body.items() if key not in _PREFILL_DROPPED}
    leg["stream"] = False
    leg["max_tokens"] = 1
    if "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    leg["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return leg


def vllm_decode_leg(body: dict[str, Any], transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The client's own request plus the prefill worker's `kv_transfer_params` (opaque).

    Without params (the prefill ended for another reason than the length cap) the decode
    worker gets a plain request and prefills locally.
    """
    leg = dict(body)
    if transfer_params:
        leg["kv_transfer_params"] = transfer_params
    else:
        leg.pop("kv_transfer_params", None)
    return leg


def sglang_legs(
    body: dict[str, Any], prefill_host: str, bootstrap_port: int | None, rng: random.Random
) -> tuple[dict[str, Any], dict[str, Any]]:
    """SGLang bootstrap: the same body to both servers, with one random 63-bit room."""
    room = rng.getrandbits(63)
    leg = dict(body)
    leg["bootstrap_host"] = prefill_host
    leg["bootstrap_port"] = bootstrap_port
    leg["bootstrap_room"] = room
    return leg, dict(leg)


class PrefillReply(msgspec.Struct):
    """What the router reads from a non-streaming prefill leg's reply."""

    kv_transfer_params: dict[str, Any] | None = None
    id: str = ""
    created: int = 0
    model: str = ""
    choices: list[dict[str, Any]] = []
    usage: dict[str, Any] | None = None  # loose: an engine's extra fields must not fail it

    @property
    def cached_tokens(self) -> int | None:
        """The prompt tokens the prefill worker found cached, None where it did not say."""
        return reported_cached_tokens((self.usage or {}).get("prompt_tokens_details"))


_decode_prefill = msgspec.json.Decoder(PrefillReply).decode


def parse_prefill_reply(raw: bytes) -> PrefillReply:
    return _decode_prefill(raw)


def first_token_frames(reply: PrefillReply, chat: bool) -> bytes:
    """The prefill leg's token as the client's first stream frames (`--first-token prefill`)."""
    choice = reply.choices[0] if reply.choices else {}
    if chat:
        message = choice.get("message") or {}
        text = message.get("content") or ""
        head = {"id": reply.id, "object": "chat.completion.chunk", "created": reply.created,
                "model": reply.model}  # fmt: skip
        role = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]}  # fmt: skip
        token = {**head, "choices": [{"index": 0, "delta": {"content": text},
                                      "logprobs": None, "finish_reason": None}]}  # fmt: skip
        return b"data: " + _encode(role) + b"\n\ndata: " + _encode(token) + b"\n\n"
    text = choice.get("text") or ""
    frame = {"id": reply.id, "object": "text_completion", "created": reply.created,
             "model": reply.model, "choices": [{"index": 0, "text": text, "logprobs": None,
                                                "finish_reason": None}]}  # fmt: skip
    return b"data: " + _encode(frame) + b"\n\n"
