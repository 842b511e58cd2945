"""A leg's request body: the client's JSON object, decoded once into a dict and re-encoded per
leg (the router never rewrites fields it does not have to), and what every engine's legs add."""

from __future__ import annotations

from typing import Any

import msgspec

from router.engines import ENGINES

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


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
    Each engine module says which way its engine orders (`PRIORITY_SIGN`)."""
    value = ENGINES[engine].PRIORITY_SIGN * priority
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
