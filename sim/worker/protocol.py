"""vLLM's OpenAI-compatible request validation and response framing, for the simulated worker.

Only the fields the simulator acts on are interpreted; everything else in a request is accepted
and ignored, as vLLM ignores sampling fields it does not need for a given request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from sim.worker.tokenizer import chat_token_ids, tokenize

Kind = Literal["chat", "completion"]

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    413: "BadRequestError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}
_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode


class OpenAIError(Exception):
    """A request error in vLLM's shape: HTTP status plus {"error": {...}}."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    error = {
        "message": message,
        "type": _ERROR_TYPES.get(status, "BadRequestError"),
        "param": param,
        "code": status,
    }
    return _json_encode({"error": error})


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: Kind
    model: str
    prompt_token_ids: list[int]
    stream: bool
    include_usage: bool
    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    kv_transfer_params: dict[str, Any] | None
    priority: int = 0


def _int_field(body: dict[str, Any], name: str, minimum: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise OpenAIError(400, f"{name} must be an integer, got {value!r}", name)
    if minimum is not None and value < minimum:
        raise OpenAIError(400, f"{name} must be at least {minimum}, got {value}.", name)
    return value


def _prompt_ids(body: dict[str, Any], kind: Kind) -> list[int]:
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise OpenAIError(400, "messages must be a non-empty list", "messages")
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise OpenAIError(400, "each message needs a string 'role'", "messages")
        try:
            return chat_token_ids(messages)
        except (TypeError, ValueError) as exc:
            raise OpenAIError(400, f"invalid messages: {exc}", "messages") from exc
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        ids = tokenize(prompt)
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
    ):
        ids = list(prompt)
    elif isinstance(prompt, list):
        raise OpenAIError(400, "only one prompt per request is supported", "prompt")
    else:
        raise OpenAIError(400, "prompt must be a string or a list of token ids", "prompt")
    if not ids:
        raise OpenAIError(400, "The prompt cannot be empty.", "prompt")
    return ids


def parse_request(raw: bytes, kind: Kind, served_model: str) -> ParsedRequest:
    try:
        body = _json_decode(raw)
    except msgspec.DecodeError as exc:
        raise OpenAIError(400, f"Invalid JSON in request body: {exc}") from exc
    if not isinstance(body, dict):
        raise OpenAIError(400, "The request body must be a JSON object.")
    model = body.get("model", served_model)
    if model != served_model:
        raise OpenAIError(404, f"The model `{model}` does not exist.", "model")
    n = body.get("n", 1)
    if n != 1:
        raise OpenAIError(400, "Only n=1 is supported by this server.", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise OpenAIError(400, "stream must be a boolean", "stream")
    stream_options = body.get("stream_options")
    if stream_options is not None and not stream:
        raise OpenAIError(
            400, "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    max_tokens = _int_field(body, "max_tokens", 1)
    max_completion_tokens = _int_field(body, "max_completion_tokens", 1)
    if max_completion_tokens is not None:
        max_tokens = max_completion_tokens
    min_tokens = _int_field(body, "min_tokens", 0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise OpenAIError(400, "min_tokens must be less than or equal to max_tokens", "min_tokens")
    kv_params = body.get("kv_transfer_params")
    if kv_params is not None and not isinstance(kv_params, dict):
        raise OpenAIError(400, "kv_transfer_params must be an object", "kv_transfer_params")
    return ParsedRequest(
        kind=kind,
        model=served_model,
        prompt_token_ids=_prompt_ids(body, kind),
        stream=stream,
        # vLLM treats any present stream_options object as include_usage unless it says false
        include_usage=isinstance(stream_options, dict)
        and stream_options.get("include_usage", True) is not False,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=bool(body.get("ignore_eos", False)),
        kv_transfer_params=kv_params,
        priority=_int_field(body, "priority", None) or 0,
    )


class ResponseFramer:
    """Builds one request's response bodies; the per-chunk JSON is assembled from fixed parts."""

    def __init__(self, kind: Kind, request_id: str, model: str) -> None:
        self.kind = kind
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        self.response_id = prefix + request_id
        self.created = int(time.time())
        head = {
            "id": self.response_id,
            "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": self.created,
            "model": model,
        }
        self._model = model
        self._head = _json_encode(head)[:-1]  # without the closing brace
        # Chunks as vLLM 0.32 streams them: a chat chunk's choice carries `token_ids` (and
        # `stop_reason` only at the end), a completion chunk's also `stop_reason` and
        # `prompt_token_ids` throughout.
        if kind == "chat":
            self._before_text = self._head + b',"choices":[{"index":0,"delta":{"content":'
            self._after_text = b'},"logprobs":null,"finish_reason":'
            self._open_end = b',"token_ids":null}]}\n\n'
            self._final_end = b',"stop_reason":null,"token_ids":null}]}\n\n'
        else:
            self._before_text = self._head + b',"choices":[{"index":0,"text":'
            self._after_text = b',"logprobs":null,"finish_reason":'
            self._open_end = self._final_end = (
                b',"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}\n\n'
            )

    def role_chunk(self) -> bytes:
        return (
            b"data: " + self._head + b',"choices":[{"index":0,"delta":{"role":"assistant",'
            b'"content":""},"logprobs":null,"finish_reason":null}],'
            b'"prompt_token_ids":null,"prompt_text":null}\n\n'
        )

    def text_chunk(self, text: str, finish_reason: str | None) -> bytes:
        if finish_reason is None:
            reason, end = b"null", self._open_end
        else:
            reason, end = b'"' + finish_reason.encode() + b'"', self._final_end
        return b"data: " + self._before_text + _json_encode(text) + self._after_text + reason + end

    def usage_chunk(self, usage: dict[str, Any], extra: dict[str, Any] | None = None) -> bytes:
        """The last chunk: vLLM 0.32 streams a shorter usage than it answers whole (a chat's
        prompt details hold `cached_tokens` and `created_cache_tokens`, a completion's only
        `cached_tokens`), then its system fingerprint."""
        details = usage.get("prompt_tokens_details") or {}
        streamed_details: dict[str, Any] = {"cached_tokens": details.get("cached_tokens", 0)}
        if self.kind == "chat":
            streamed_details["created_cache_tokens"] = details.get("created_cache_tokens") or 0
        streamed = {key: usage[key] for key in ("prompt_tokens", "total_tokens",
                                                "completion_tokens")}  # fmt: skip
        streamed["prompt_tokens_details"] = streamed_details
        kept = {key: value for key, value in (extra or {}).items() if value is not None}
        tail = b"" if not kept else b"," + _json_encode(kept)[1:-1]
        return (
            b"data: " + self._head + b',"choices":[],"usage":' + _json_encode(streamed) + tail
            + b',"system_fingerprint":' + _json_encode(SYSTEM_FINGERPRINT) + b"}\n\n"
        )  # fmt: skip

    def full_response(
        self, text: str, finish_reason: str, usage: dict[str, Any], extra: dict[str, Any]
    ) -> bytes:
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
        else:
            choice["text"] = text
        choice.update(logprobs=None, finish_reason=finish_reason, stop_reason=None)
        if self.kind == "chat":  # vLLM 0.32 counts a chat's created cache tokens (0 here)
            details = {**usage["prompt_tokens_details"], "created_cache_tokens": 0}
            usage = {**usage, "prompt_tokens_details": details}
        body: dict[str, Any] = {
            "id": self.response_id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self._model,
            "choices": [choice],
            "usage": usage,
        }
        body.update(extra)
        return _json_encode(body)


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """A `usage` object with vLLM 0.32's fields (--enable-prompt-tokens-details)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": cached_tokens, "created_cache_tokens": None,
            "multimodal_tokens": None,
        },
        "completion_tokens_details": None,
    }  # fmt: skip


DONE = b"data: [DONE]\n\n"
SYSTEM_FINGERPRINT = "vllm-0.32.0-simulated"
