"""What routing needs from a request and its body, validated once per request at the edge.

The body is decoded whole with a prebuilt decoder, so every byte a later leg re-encodes is
known to be a JSON object in UTF-8, nested at most `MAX_JSON_DEPTH` deep; the routing fields
are then converted into `RoutingFields` with their types and bounds, each error naming its
field. Everything else stays in the raw bytes that are forwarded. Fields the router sets for
its own handoffs (`ROUTER_OWNED_FIELDS`) are refused. Session and request ids from headers are
bounded and header-safe; a body's `user` that is not becomes a stable digest.
"""

from __future__ import annotations

import hashlib
import re
from typing import Annotated, Any

import msgspec

from router.errors import RouterError

_FINGERPRINT_MESSAGES = 2
_FINGERPRINT_PROMPT_CHARS = 1024

MAX_OUTPUT_TOKENS = 1 << 24  # max_tokens / max_completion_tokens: beyond any context window
PRIORITY_BOUND = 1 << 53  # |priority|: exact in JSON numbers everywhere (unix ms fit easily)
MAX_TOKEN_ID = (1 << 32) - 1
MAX_JSON_DEPTH = 128  # arrays and objects in arrays and objects; a JSON schema needs far less
MAX_ID_BYTES = 256  # session and request ids: what the router echoes in headers and stores
# Fields the router writes into legs itself (vLLM NIXL, SGLang bootstrap): a client's own would
# reach a worker unchanged in a colocated turn and make it pull KV from, or bootstrap with, a
# host of the client's choosing.
ROUTER_OWNED_FIELDS = (
    "kv_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "decode_tp_size",
    "disagg_prefill_dp_rank",
)

_ROUTER_OWNED = frozenset(ROUTER_OWNED_FIELDS)

OutputTokens = Annotated[int, msgspec.Meta(ge=1, le=MAX_OUTPUT_TOKENS)]
Priority = Annotated[int, msgspec.Meta(ge=-PRIORITY_BOUND, le=PRIORITY_BOUND)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class ContentPart(msgspec.Struct):
    """One part of a message's content (text, image_url, ...): only its text is read."""

    type: str | None = None
    text: str | None = None


class Message(msgspec.Struct):
    role: str | None = None
    content: str | list[ContentPart] | None = None


class RoutingFields(msgspec.Struct):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: OutputTokens | None = None
    max_completion_tokens: OutputTokens | None = None
    user: str | None = None
    messages: list[Message] | None = None  # chat only
    # completions only: text, texts, token ids or lists of token ids (checked after decoding)
    prompt: str | list[Any] | None = None
    n: int | None = None
    priority: Priority | None = None  # the client's own engine priority: the router keeps it

    @property
    def wants_usage(self) -> bool:
        # vLLM treats a present stream_options object as include_usage unless it says false
        return self.stream_options is not None and self.stream_options.include_usage is not False

    @property
    def output_cap(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


_decode = msgspec.json.Decoder().decode
# msgspec reports where a value is wrong as "... - at `$.messages[0].content`".
_AT_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")


def decode_routing_fields(raw: bytes, chat: bool) -> RoutingFields:
    """The routing fields of a request body; RouterError 400 naming the field otherwise."""
    return decode_turn_body(raw, chat)[0]


def decode_turn_body(raw: bytes, chat: bool) -> tuple[RoutingFields, dict[str, Any]]:
    """The routing fields of a request body and the body itself, decoded once (the legs
    re-encode it); RouterError 400 naming the field otherwise."""
    try:
        body = _decode(raw)
    except RecursionError as exc:
        raise RouterError(400, f"request body nests JSON deeper than {MAX_JSON_DEPTH}") from exc
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RouterError(400, f"Invalid JSON in request body: {exc}") from exc
    if not isinstance(body, dict):
        raise RouterError(400, "request body must be a JSON object")
    if not _ROUTER_OWNED.isdisjoint(body):
        name = next(name for name in ROUTER_OWNED_FIELDS if name in body)
        raise RouterError(
            400, f"`{name}` is set by the router for its handoffs; a request may not carry it",
            name,
        )  # fmt: skip
    whole = body
    body = dict(whole)  # what is converted: the forwarded body stays as the client sent it
    # The other endpoint's field is not read, only forwarded; a prompt is checked on its own
    # (it may hold many thousands of token ids).
    other = body.pop("prompt" if chat else "messages", None)
    prompt = None if chat else body.pop("prompt", None)
    if "stream" in body and body["stream"] is None:
        del body["stream"]  # null is false, as vLLM reads it
    try:
        fields = msgspec.convert(body, RoutingFields)
    except msgspec.ValidationError as exc:
        raise _invalid(exc) from exc
    if chat:
        if not fields.messages:
            raise RouterError(400, "messages must be a non-empty list", "messages")
    else:
        fields.prompt = _checked_prompt(prompt)
    if _too_deep(body, other):  # the other endpoint's field nests all the same
        raise RouterError(400, f"request body nests JSON deeper than {MAX_JSON_DEPTH}")
    if fields.n not in (None, 1):
        raise RouterError(400, "Only n=1 is supported.", "n")
    if fields.stream_options is not None and not fields.stream:
        raise RouterError(
            400, "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    return fields, whole


def _invalid(error: msgspec.ValidationError) -> RouterError:
    message = str(error)
    match = _AT_PATH.search(message)
    if match is None or not match["path"]:
        return RouterError(400, f"invalid request: {message}")
    path = match["path"]
    return RouterError(400, f"Invalid value for `{path}`: {message[: match.start()]}", path)


_PROMPT_TYPES: dict[type, Any] = {str: list[str], int: list[TokenId], list: list[list[TokenId]]}


def _checked_prompt(prompt: object) -> str | list[Any]:
    """A completions prompt: a text, a non-empty list of texts, of token ids, or of lists of
    token ids (OpenAI's four forms); 400 naming `prompt` otherwise."""
    if prompt is None:
        raise RouterError(400, "prompt is required", "prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise RouterError(400, "prompt must not be an empty list", "prompt")
        kind = _PROMPT_TYPES.get(type(prompt[0]))  # its first item says which form it must be
        if kind is not None:
            try:
                msgspec.convert(prompt, kind)
                return prompt
            except msgspec.ValidationError:
                pass
    raise RouterError(
        400, "prompt must be a string, or a list of strings, of token ids (integers from 0 to "
        f"{MAX_TOKEN_ID}) or of lists of token ids", "prompt",
    )  # fmt: skip


def _too_deep(body: dict[str, Any], other: object) -> bool:
    """Whether the decoded body (its fields, and `other`, one taken out of it) nests arrays
    and objects more than `MAX_JSON_DEPTH` deep, walked level by level, each value once (a
    completions prompt, checked to be one of its shallow forms, is not walked)."""
    level: list[Any] = [value for value in body.values() if type(value) in (dict, list)]
    if type(other) in (dict, list):
        level.append(other)
    for _ in range(MAX_JSON_DEPTH - 1):  # the body itself is the first level
        if not level:
            return False
        deeper: list[Any] = []
        append = deeper.append
        for node in level:
            for child in node.values() if type(node) is dict else node:
                if type(child) is dict or type(child) is list:
                    append(child)
        level = deeper
    return bool(level)


def session_identity(
    header: str | None, fields: RoutingFields, header_name: str = "X-Session-Id"
) -> str:
    """The session header (`header_name`, `--session-header`), else the body's `user`, else a
    fingerprint of the conversation's start.

    The header must be a header-safe id of at most `MAX_ID_BYTES` (400 otherwise); a `user`
    (any string, as OpenAI allows) that could not be echoed in a header as it is becomes
    "user-digest:" + its digest, the same for every turn. The fingerprint hashes the first messages
    (system prompt and first user message), which every later turn of the same conversation
    repeats, so clients that send no id still get affinity.
    """
    if header:
        return checked_header_id(header, header_name)
    if fields.user:
        session = "user:" + fields.user
        if _header_safe(session):
            return session
        return "user-digest:" + hashlib.blake2b(fields.user.encode(), digest_size=16).hexdigest()
    digest = hashlib.blake2b(digest_size=12)
    if fields.messages:
        for message in fields.messages[:_FINGERPRINT_MESSAGES]:
            digest.update((message.role or "").encode())
            digest.update(b"\x00")
            digest.update(content_text(message.content).encode())
            digest.update(b"\x01")
    else:
        digest.update(prompt_text(fields.prompt)[:_FINGERPRINT_PROMPT_CHARS].encode())
    return "fp:" + digest.hexdigest()


# visible ASCII and inner spaces: what any HTTP stack writes and reads back unchanged
_HEADER_SAFE = re.compile(r"[!-~](?:[ -~]*[!-~])?")


def _header_safe(value: str) -> bool:
    return len(value) <= MAX_ID_BYTES and _HEADER_SAFE.fullmatch(value) is not None


def checked_header_id(value: str, header: str) -> str:
    """An id a client sent in `header`, which the router echoes and keeps: at most
    `MAX_ID_BYTES` of visible ASCII (inner spaces allowed); 400 naming the header otherwise."""
    if not _header_safe(value):
        raise RouterError(
            400, f"{header} must be 1 to {MAX_ID_BYTES} visible ASCII characters", header
        )
    return value


def content_text(content: str | list[ContentPart] | None) -> str:
    if isinstance(content, str):
        return content
    if content:
        return "".join(part.text for part in content if part.text)
    return ""


def prompt_text(prompt: str | list[Any] | None) -> str:
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
        return sum(len(content_text(m.content)) for m in fields.messages), None
    prompt = fields.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return 0, len(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        return 0, sum(len(ids) for ids in prompt)
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


# W3C Trace Context: version-traceid-parentid-flags, lowercase hex; a later version may append
# fields after a dash. Version ff, and an all-zero trace or parent id, are invalid.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[ -~]*)?")
MAX_TRACESTATE_CHARS = 512  # the spec's least a vendor must propagate


def trace_headers(traceparent: str | None, tracestate: str | None) -> dict[str, str]:
    """The client's W3C `traceparent` and `tracestate`, as every leg forwards them: a malformed
    traceparent is dropped, and its tracestate with it (the spec's rule); a tracestate is kept
    only while it is at most `MAX_TRACESTATE_CHARS` of visible ASCII and spaces."""
    if traceparent is None:
        return {}
    value = traceparent.strip()
    match = _TRACEPARENT.fullmatch(value)
    if (
        match is None
        or match[1] == "ff"
        or (match[1] == "00" and match[5] is not None)
        or match[2] == "0" * 32
        or match[3] == "0" * 16
    ):
        return {}
    found = {"traceparent": value}
    if tracestate is not None:
        state = tracestate.strip()
        if state and len(state) <= MAX_TRACESTATE_CHARS and _HEADER_SAFE.fullmatch(state):
            found["tracestate"] = state
    return found
