from __future__ import annotations

import pytest

from router.errors import RouterError
from router.turn.fields import TokenEstimator, decode_routing_fields, session_identity, text_size


def test_session_identity_prefers_header_then_user_then_fingerprint() -> None:
    chat = decode_routing_fields(
        b'{"messages": [{"role": "system", "content": "be brief"},'
        b' {"role": "user", "content": "hi"}], "user": "alice"}', chat=True)  # fmt: skip
    assert session_identity("abc", chat) == "abc"
    assert session_identity(None, chat) == "user:alice"
    anonymous = decode_routing_fields(
        b'{"messages": [{"role": "system", "content": "be brief"},'
        b' {"role": "user", "content": "hi"}]}', chat=True)  # fmt: skip
    later_turn = decode_routing_fields(
        b'{"messages": [{"role": "system", "content": "be brief"},'
        b' {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},'
        b' {"role": "user", "content": "more"}]}', chat=True)  # fmt: skip
    other = decode_routing_fields(
        b'{"messages": [{"role": "system", "content": "be brief"},'
        b' {"role": "user", "content": "bye"}]}', chat=True)  # fmt: skip
    fingerprint = session_identity(None, anonymous)
    assert fingerprint.startswith("fp:")
    assert session_identity(None, later_turn) == fingerprint  # the same conversation
    assert session_identity(None, other) != fingerprint


@pytest.mark.parametrize(
    ("raw", "chat", "param"),
    [
        (b"{oops", True, None),
        (b'{"messages": []}', True, "messages"),
        (b'{"max_tokens": 5}', False, "prompt"),
        (b'{"prompt": "x", "max_tokens": 0}', False, "max_tokens"),
        (b'{"prompt": "x", "max_completion_tokens": -1}', False, "max_completion_tokens"),
        (b'{"prompt": "x", "n": 2}', False, "n"),
        (b'{"prompt": "x", "stream_options": {"include_usage": true}}', False, "stream_options"),
        (b'{"prompt": "x", "stream": "yes"}', False, "stream"),
    ],
)
def test_invalid_requests_are_400_naming_the_field(
    raw: bytes, chat: bool, param: str | None
) -> None:
    with pytest.raises(RouterError) as error:
        decode_routing_fields(raw, chat)
    assert error.value.status == 400 and error.value.param == param


def test_usage_wish_and_output_cap() -> None:
    fields = decode_routing_fields(
        b'{"prompt": "x", "stream": true, "stream_options": {}, "max_tokens": 9,'
        b' "max_completion_tokens": 7}', chat=False)  # fmt: skip
    assert fields.wants_usage and fields.output_cap == 7
    off = decode_routing_fields(
        b'{"prompt": "x", "stream": true, "stream_options": {"include_usage": false}}', False
    )
    assert not off.wants_usage


def test_text_size_and_calibrated_estimates() -> None:
    fields = decode_routing_fields(b'{"prompt": [1, 2, 3, 4]}', chat=False)
    assert text_size(fields) == (0, 4)
    chat = decode_routing_fields(
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "abcd"}]}]}', True
    )
    assert text_size(chat) == (4, None)
    estimator = TokenEstimator(tokens_per_char=0.25, alpha=0.5)
    assert estimator.estimate(400, None) == 100
    assert estimator.estimate(0, 17) == 17
    estimator.observe(400, 0, 200)  # the workers say 0.5 tokens per character
    assert estimator.tokens_per_char == pytest.approx(0.375)
