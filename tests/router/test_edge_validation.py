"""Validation at the edge, in process: request bodies, objective and id headers, the API key
and the content type. Every bad input is a RouterError with a 4xx naming what was wrong."""

from __future__ import annotations

import hashlib
import json

import pytest

from router.app import bearer_matches, is_json_media_type
from router.errors import RouterError
from router.turn.fields import (
    MAX_ID_BYTES,
    MAX_JSON_DEPTH,
    MAX_OUTPUT_TOKENS,
    PRIORITY_BOUND,
    ROUTER_OWNED_FIELDS,
    checked_header_id,
    decode_routing_fields,
    session_identity,
    text_size,
)
from router.turn.pipeline import MAX_OBJECTIVE_MS, objective_ms

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def chat(**extra: object) -> bytes:
    return json.dumps({**CHAT, **extra}).encode()


def refused(raw: bytes, chat: bool = True) -> RouterError:
    with pytest.raises(RouterError) as error:
        decode_routing_fields(raw, chat)
    assert error.value.status == 400 and error.value.message
    return error.value


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        # a content part's text that is no string (was a 500 computing the prompt's size)
        (chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
         "messages[0].content[0].text"),
        (chat(messages=[{"role": "user", "content": [{"type": "text", "text": ["x"]}]}]),
         "messages[0].content[0].text"),
        (chat(messages=[{"role": "user", "content": ["plain"]}]), "messages[0].content[0]"),
        (chat(messages=[{"role": "user", "content": {"text": "x"}}]), "messages[0].content"),
        (chat(messages=["hi"]), "messages[0]"),
        (chat(messages=[None]), "messages[0]"),
        (chat(messages=[{"role": 3, "content": "x"}]), "messages[0].role"),
        (chat(messages={"role": "user"}), "messages"),
        (chat(stream="yes"), "stream"),
        (chat(stream=1), "stream"),
        (chat(stream=True, stream_options=[]), "stream_options"),
        (chat(stream=True, stream_options={"include_usage": "yes"}),
         "stream_options.include_usage"),
        (chat(max_tokens=0), "max_tokens"),
        (chat(max_tokens=MAX_OUTPUT_TOKENS + 1), "max_tokens"),
        (chat(max_tokens=10**30), "max_tokens"),
        (chat(max_tokens=1.5), "max_tokens"),
        (chat(max_tokens="5"), "max_tokens"),
        (chat(max_completion_tokens=-1), "max_completion_tokens"),
        (chat(priority=PRIORITY_BOUND + 1), "priority"),
        (chat(priority=-PRIORITY_BOUND - 1), "priority"),
        (chat(priority=True), "priority"),
        (chat(priority="high"), "priority"),
        (chat(user=7), "user"),
        (chat(model=["m"]), "model"),
        (chat(n=2), "n"),
        (chat(n="1"), "n"),
        *[(chat(**{name: None}), name) for name in ROUTER_OWNED_FIELDS],
        (chat(kv_transfer_params={"remote_host": "169.254.169.254", "remote_port": 80}),
         "kv_transfer_params"),
    ],
)  # fmt: skip
def test_bad_chat_fields_are_400_naming_the_field(raw: bytes, param: str) -> None:
    assert refused(raw).param == param


@pytest.mark.parametrize(
    ("prompt", "param"),
    [
        (None, "prompt"),
        (5, "prompt"),
        ({"text": "x"}, "prompt"),
        ([], "prompt"),
        ([1, "a"], "prompt"),
        (["a", 1], "prompt"),
        ([True, False], "prompt"),
        ([1.5], "prompt"),
        ([-1], "prompt"),
        ([2**32], "prompt"),
        ([[1, 2], ["a"]], "prompt"),
        ([None], "prompt"),
        ([{"a": 1}], "prompt"),
    ],
)
def test_bad_prompts_are_400_naming_prompt(prompt: object, param: str) -> None:
    assert refused(json.dumps({"prompt": prompt}).encode(), chat=False).param == param


@pytest.mark.parametrize(
    ("prompt", "size"),
    [("four", (4, None)), (["abc", "de"], (3, None)), ([1, 2, 3], (0, 3)),
     ([[1, 2], [3]], (0, 3))],
)  # fmt: skip
def test_each_prompt_form_is_accepted_and_sized(prompt: object, size: object) -> None:
    fields = decode_routing_fields(json.dumps({"prompt": prompt}).encode(), chat=False)
    assert text_size(fields) == size


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"[]",
        b'"text"',
        b"null",
        b"{oops",
        b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',  # not UTF-8
        b'{"messages": [{"role": "user", "content": "x"}], "extra": "\xff"}',  # in any field
        b'{"messages": [{"role": "user", "content": "x"}], "extra": 1e400}',  # no double
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',  # a lone surrogate
        '{"messages": [{"role": "user", "content": "x"}]}'.encode("utf-16"),
        ('{"messages": [{"role": "user", "content": "x"}], "x": ' + nested(10_000) + "}").encode(),
        ('{"messages": [{"role": "user", "content": "x"}], "x": ' + nested(500) + "}").encode(),
        ('{"messages": [{"role": "user", "content": "x"}], "x": '
         + nested(MAX_JSON_DEPTH) + "}").encode(),
        ('{"messages": ' + nested(10_000) + "}").encode(),
    ],
)  # fmt: skip
def test_bodies_that_are_no_json_object_are_400(raw: bytes) -> None:
    assert refused(raw).param is None


def test_nesting_up_to_the_limit_and_brackets_in_text_are_fine() -> None:
    deep = json.loads(nested(MAX_JSON_DEPTH - 1))
    fields = decode_routing_fields(chat(tools=deep), True)
    assert fields.messages is not None and len(fields.messages) == 1
    text = "[" * 5000 + "{" * 5000  # brackets inside strings nest nothing
    fields = decode_routing_fields(chat(messages=[{"role": "user", "content": text}]), True)
    assert text_size(fields) == (10_000, None)
    many = [{"role": "user", "content": [{"type": "text", "text": "x"}]}] * 200
    assert text_size(decode_routing_fields(chat(messages=many), True)) == (200, None)


def test_content_parts_without_text_count_nothing() -> None:
    fields = decode_routing_fields(chat(messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                     {"type": "text", "text": "abc"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "t"}]},
    ]), True)  # fmt: skip
    assert text_size(fields) == (3, None)


def test_nulls_read_as_absent() -> None:
    fields = decode_routing_fields(
        chat(stream=None, stream_options=None, max_tokens=None, user=None, n=None, model=None),
        True,
    )
    assert fields.stream is False and fields.output_cap is None and fields.user is None


def test_bounds_are_inclusive() -> None:
    fields = decode_routing_fields(
        chat(max_tokens=MAX_OUTPUT_TOKENS, max_completion_tokens=1, priority=-PRIORITY_BOUND),
        True,
    )
    assert (fields.max_tokens, fields.output_cap, fields.priority) == (
        MAX_OUTPUT_TOKENS, 1, -PRIORITY_BOUND)  # fmt: skip


# -- session and request ids ----------------------------------------------------------------


def test_a_user_that_is_not_header_safe_becomes_a_stable_digest() -> None:
    for user in ("日本語", "a\r\nX-Evil: 1", "a\x00b", "u" * 20_000, "padded ", "tab\there"):
        fields = decode_routing_fields(chat(user=user), True)
        session = session_identity(None, fields)
        assert (
            session == "user-digest:" + hashlib.blake2b(user.encode(), digest_size=16).hexdigest()
        )
        assert session == session_identity(None, decode_routing_fields(chat(user=user), True))
        session.encode("ascii")  # echoed as X-Session-Id: visible ASCII only
    plain = decode_routing_fields(chat(user="alice@example.com"), True)
    assert session_identity(None, plain) == "user:alice@example.com"
    longest = "u" * (MAX_ID_BYTES - len("user:"))
    assert session_identity(None, decode_routing_fields(chat(user=longest), True)) == (
        "user:" + longest
    )
    too_long = decode_routing_fields(chat(user=longest + "u"), True)
    assert session_identity(None, too_long).startswith("user-digest:")


@pytest.mark.parametrize(
    "value", ["x" * (MAX_ID_BYTES + 1), "日本", "caf\xe9", "a\x00b", "a\x7fb", "a\tb", " a", "a "]
)
def test_unsafe_session_and_request_id_headers_are_400_naming_the_header(value: str) -> None:
    fields = decode_routing_fields(chat(), True)
    with pytest.raises(RouterError) as error:
        session_identity(value, fields)
    assert error.value.status == 400 and error.value.param == "X-Session-Id"
    with pytest.raises(RouterError) as error:
        checked_header_id(value, "X-Request-Id")
    assert error.value.status == 400 and error.value.param == "X-Request-Id"


def test_safe_ids_are_kept_as_sent() -> None:
    fields = decode_routing_fields(chat(user="bob"), True)
    for value in (
        "a",
        "conv 42/turn-7",
        "x" * MAX_ID_BYTES,
        "550e8400-e29b-41d4-a716-446655440000",
    ):
        assert session_identity(value, fields) == value
        assert checked_header_id(value, "X-Request-Id") == value
    assert session_identity("", fields) == "user:bob"  # an empty header is no header


# -- objectives --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    ["nan", "NaN", "inf", "-inf", "Infinity", "1e309", "0", "-1", "-0", "", " ", "5ms", "0x10",
     str(MAX_OBJECTIVE_MS + 1), "1" * 400],
)  # fmt: skip
def test_objective_headers_must_be_finite_positive_and_bounded(value: str) -> None:
    for header in ("X-SLO-TTFT-Ms", "X-SLO-ITL-Ms"):
        with pytest.raises(RouterError) as error:
            objective_ms(value, header, 100.0)
        assert error.value.status == 400 and error.value.param == header
        assert len(error.value.message) < 200  # the value is quoted cut short


def test_objective_headers_within_bounds_are_taken() -> None:
    assert objective_ms(None, "X-SLO-TTFT-Ms", 123.0) == 123.0
    assert objective_ms("250.5", "X-SLO-TTFT-Ms", 1.0) == 250.5
    assert objective_ms(" 20 ", "X-SLO-ITL-Ms", 1.0) == 20.0
    assert objective_ms(str(MAX_OBJECTIVE_MS), "X-SLO-ITL-Ms", 1.0) == MAX_OBJECTIVE_MS


# -- API key and content type ----------------------------------------------------------------


def test_bearer_matches_only_the_key() -> None:
    key = b"s3cret"
    assert bearer_matches("Bearer s3cret", key)
    assert bearer_matches("bearer s3cret", key) and bearer_matches("BEARER  s3cret ", key)
    wrong = [None, "", "s3cret", "Bearer", "Bearer ", "Bearer s3cre", "Bearer s3cret2",
             "Basic s3cret", "Token s3cret", "Bearer S3CRET", "Bearer s3cr\xe9t"]  # fmt: skip
    for header in wrong:
        assert not bearer_matches(header, key), header
    assert bearer_matches("Bearer cl\xc3\xa9", "clé".encode())  # UTF-8 bytes as sent


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("application/json", True),
        ("Application/JSON", True),
        ("application/json; charset=utf-8", True),
        ('application/json;charset="UTF-8"', True),
        ("application/json; boundary=x", True),
        ("application/json; charset=latin-1", False),
        ("text/plain", False),
        ("application/x-www-form-urlencoded", False),
        ("multipart/form-data; boundary=x", False),
        ("application/jsonx", False),
        ("", False),
        (None, False),
    ],
)
def test_json_media_types(value: str | None, ok: bool) -> None:
    assert is_json_media_type(value) is ok
