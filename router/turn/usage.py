"""The token usage a worker reports for a turn, and reading it from a reply (its own module:
the compiled relay, `router.native`, cannot define msgspec Structs)."""

from __future__ import annotations

import msgspec


class Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: dict[str, int | None] | None = None

    @property
    def cached_tokens(self) -> int:
        return self.reported_cached_tokens or 0

    @property
    def reported_cached_tokens(self) -> int | None:
        return reported_cached_tokens(self.prompt_tokens_details)


def reported_cached_tokens(details: object) -> int | None:
    """The cached prompt tokens in a usage's `prompt_tokens_details`, where the engine
    reported them (vLLM with --enable-prompt-tokens-details, SGLang with
    --enable-cache-report), else None."""
    found = details.get("cached_tokens") if isinstance(details, dict) else None
    return found if isinstance(found, int) and found >= 0 else None


class _UsageCarrier(msgspec.Struct):
    usage: Usage | None = None


_decode_usage = msgspec.json.Decoder(_UsageCarrier).decode


def usage_of(payload: bytes) -> Usage | None:
    try:
        return _decode_usage(payload).usage
    except msgspec.DecodeError:
        return None
