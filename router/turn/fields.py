"""What routing needs from a request body, decoded once per request with a prebuilt decoder.

Only routing fields are typed; everything else stays in the raw bytes that are forwarded.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from router.errors import RouterError

_FINGERPRINT_MESSAGES = 2
_FINGERPRINT_PROMPT_CHARS = 1024


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class RoutingFields(msgspec.Struct):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    user: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[Any] | None = None
    n: int | None = None
    priority: int | None = None  # the client's own engine priority: the router keeps it

    @property
    def wants_usage(self) -> bool:
        # vLLM treats a present stream_options object as include_usage unless it says false
        return self.stream_options is not None and self.stream_options.include_usage is not False

    @property
    def output_cap(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


_decode = msgspec.json.Decoder(RoutingFields).decode


def decode_routing_fields(raw: bytes, chat: bool) -> RoutingFields:
    try:
        fields = _decode(raw)
    except msgspec.ValidationError as exc:
        raise RouterError(400, f"invalid request: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise RouterError(400, f"Invalid JSON in request body: {exc}") from exc
    if chat and not fields.messages:
        raise RouterError(400, "messages must be a non-empty list", "messages")
    if not chat and fields.prompt is None:
        raise RouterError(400, "prompt is required", "prompt")
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(fields, name)
        if value is not None and value < 1:
            raise RouterError(400, f"{name} must be at least 1, got {value}.", name)
    if fields.n not in (None, 1):
        raise RouterError(400, "Only n=1 is supported.", "n")
    if fields.stream_options is not None and not fields.stream:
        raise RouterError(
            400, "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    return fields


def session_identity(header: str | None, fields: RoutingFields) -> str:
    """X-Session-ID, else the body's `user`, else a fingerprint of the conversation's start.

    The fingerprint hashes the first messages (system prompt and first user message), which
    every later turn of the same conversation repeats, so clients that send no id still get
    affinity.
    """
    if header:
        return header
    if fields.user:
        return "user:" + fields.user
    digest = hashlib.blake2b(digest_size=12)
    if fields.messages:
        for message in fields.messages[:_FINGERPRINT_MESSAGES]:
            digest.update(str(message.get("role", "")).encode())
            digest.update(b"\x00")
            digest.update(content_text(message.get("content")).encode())
            digest.update(b"\x01")
    else:
        digest.update(prompt_text(fields.prompt)[:_FINGERPRINT_PROMPT_CHARS].encode())
    return "fp:" + digest.hexdigest()


def content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], str):
            return str(prompt[0])
        return " ".join(str(token) for token in prompt[:_FINGERPRINT_PROMPT_CHARS])
    return ""


def text_size(fields: RoutingFields) -> tuple[int, int | None]:
    """(characters of prompt text, exact token count when the prompt is token ids)."""
    if fields.messages is not None:
        return sum(len(content_text(m.get("content"))) for m in fields.messages), None
    prompt = fields.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return 0, len(prompt)
    return len(prompt_text(prompt)), None


class TokenEstimator:
    """Prompt tokens from text length, calibrated from the usage workers report.

    Keeps an EWMA of tokens per character; a session's resident size is exact (from usage) so
    only the new part of a turn is ever estimated.
    """

    def __init__(self, tokens_per_char: float = 0.25, alpha: float = 0.05) -> None:
        self.tokens_per_char = tokens_per_char
        self._alpha = alpha

    def estimate(self, chars: int, exact: int | None, message_count: int = 0) -> int:
        if exact is not None:
            return exact
        return max(1, round(chars * self.tokens_per_char) + 4 * message_count)

    def observe(self, chars: int, message_count: int, prompt_tokens: int) -> None:
        if chars <= 0 or prompt_tokens <= 0:
            return
        ratio = max(0.0, prompt_tokens - 4 * message_count) / chars
        if 0.01 < ratio < 4.0:
            self.tokens_per_char += self._alpha * (ratio - self.tokens_per_char)
