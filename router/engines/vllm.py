"""vLLM: a NixlConnector handoff's legs, the prefill reply the router reads, and the metric
names its /metrics page uses (current first, then older releases' names)."""

from __future__ import annotations

from typing import Any

import msgspec

from router.engines.metrics import EngineMetrics
from router.turn.usage import reported_cached_tokens

_encode = msgspec.json.Encoder().encode

# vLLM (--scheduling-policy priority) admits lower values first.
PRIORITY_SIGN = 1

METRICS = EngineMetrics(
    running=("vllm:num_requests_running",),
    waiting=("vllm:num_requests_waiting",),
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    prefix_hits=("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    prefix_queries=("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    replica_label="engine",
    # NixlConnector's histograms, one observation per transfer, on the pulling engine
    pulls=("vllm:nixl_xfer_time_seconds_count",),
    pull_seconds=("vllm:nixl_xfer_time_seconds_sum",),
    pull_bytes=("vllm:nixl_bytes_transferred_sum",),
)

# Fields the prefill leg must not carry (vLLM's reference proxy removes them).
_PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_leg(body: dict[str, Any]) -> dict[str, Any]:
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


def decode_leg(body: dict[str, Any], transfer_params: dict[str, Any] | None) -> dict[str, Any]:
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
