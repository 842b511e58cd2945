"""StreamRelay: what reaches the client and what the router learns, however the worker's
bytes are cut into reads (whole content frames take the fast path, the rest are read)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.http import StreamWriter, UpstreamBodyError, UpstreamResponse
from router.turn.relay import StreamRelay, answer_usage

ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'


def content(text: str) -> bytes:
    return b'data: {"choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n' % text.encode()


USAGE = (b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,'
         b'"prompt_tokens_details":{"cached_tokens":4}}}\n\n')  # fmt: skip
DONE = b"data: [DONE]\n\n"
ERROR = b'data: {"error":{"message":"engine died"}}\n\n'
TOKENS = [content("a"), content("b"), content("[DONE] is text"), content("c")]


class _Upstream:
    def __init__(self, reads: list[bytes], fail: Exception | None = None) -> None:
        self._reads, self._fail = reads, fail

    async def _gen(self) -> AsyncIterator[bytes]:
        for data in self._reads:
            await asyncio.sleep(0)
            yield data
        if self._fail is not None:
            raise self._fail

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._gen()


class _Client:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.ended = False

    async def write(self, data: bytes) -> None:
        assert not self.ended
        self.writes.append(data)

    async def end(self, last: bytes = b"") -> None:
        self.writes.append(last)
        self.ended = True


async def relay(
    reads: list[bytes], fail: Exception | None = None, **options: Any
) -> tuple[bytes, Any, _Client]:
    client = _Client()
    relay = StreamRelay(cast(StreamWriter, client), **{"forward_usage": False, **options})
    result = await relay.run(cast(UpstreamResponse, _Upstream(reads, fail)))
    return b"".join(client.writes), result, client


def cut(stream: bytes, points: list[int]) -> list[bytes]:
    edges = [0, *sorted(set(points)), len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(edges) if b > a]


@pytest.mark.parametrize(
    ("name", "reads", "options", "expected", "frames", "completed", "error"),
    [
        ("usage kept from the client", [ROLE, *TOKENS, USAGE, DONE], {},
         ROLE + b"".join(TOKENS) + DONE, 4, True, None),
        ("usage forwarded when asked", [ROLE, *TOKENS, USAGE + DONE], {"forward_usage": True},
         ROLE + b"".join(TOKENS) + USAGE + DONE, 4, True, None),
        ("frames several to a read", [ROLE + TOKENS[0] + TOKENS[1], TOKENS[2] + TOKENS[3],
                                      USAGE + DONE], {},
         ROLE + b"".join(TOKENS) + DONE, 4, True, None),
        ("the prefill leg's token already sent", [ROLE, *TOKENS, USAGE, DONE],
         {"drop_first_content": True}, b"".join(TOKENS[1:]) + DONE, 4, True, None),
        ("a late role frame is not content", [ROLE, TOKENS[0], ROLE, TOKENS[1], DONE], {},
         ROLE + TOKENS[0] + ROLE + TOKENS[1] + DONE, 2, True, None),
        ("empty frames dropped", [TOKENS[0], b"\n\n" + TOKENS[1], TOKENS[3] + b"\n\n", DONE],
         {}, TOKENS[0] + TOKENS[1] + TOKENS[3] + DONE, 3, True, None),
        ("an error frame from the worker", [TOKENS[0], TOKENS[1] + ERROR, DONE], {},
         TOKENS[0] + TOKENS[1] + ERROR + DONE, 2, True, "worker reported an error mid-stream"),
    ],
)  # fmt: skip
async def test_relay_forwards_and_learns(
    name: str,
    reads: list[bytes],
    options: dict[str, Any],
    expected: bytes,
    frames: int,
    completed: bool,
    error: str | None,
) -> None:
    out, result, client = await relay(reads, **options)
    assert out == expected, name
    assert (result.frames, result.completed, result.error) == (frames, completed, error)
    assert client.ended
    assert result.first_token_at is not None and result.last_token_at >= result.first_token_at
    if USAGE in b"".join(reads):
        assert result.usage is not None
        assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (7, 3)
        assert result.usage.cached_tokens == 4


@pytest.mark.parametrize(
    ("reads", "fail", "error"),
    [
        ([ROLE, TOKENS[0], TOKENS[1]], None, "worker closed the stream before it finished"),
        ([ROLE, TOKENS[0]], UpstreamBodyError("reset"), "worker stream failed: reset"),
    ],
)
async def test_a_stream_that_breaks_off_ends_with_an_error_event(
    reads: list[bytes], fail: Exception | None, error: str
) -> None:
    out, result, client = await relay(reads, fail)
    assert out.startswith(b"".join(reads))
    tail = out[len(b"".join(reads)) :]
    assert b'"error"' in tail and tail.endswith(DONE)
    assert result.error == error and not result.completed
    assert not client.ended  # the caller ends the response


@pytest.mark.parametrize(
    "fail", [UpstreamBodyError("reset"), TimeoutError()], ids=["reset", "timeout"]
)
async def test_a_worker_connection_that_breaks_after_done_leaves_the_answer_whole(
    fail: Exception,
) -> None:
    out, result, client = await relay([ROLE, TOKENS[0], DONE, b": trailing comment\n\n"], fail)
    assert out == ROLE + TOKENS[0] + DONE and client.ended
    assert result.completed and result.error is None and result.timed_out is None


STREAM = ROLE + b"".join(TOKENS) + USAGE + DONE


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), max_size=12))
def test_the_relayed_bytes_do_not_depend_on_how_reads_cut_the_stream(points: list[int]) -> None:
    whole, whole_result, _ = asyncio.run(relay([STREAM]))
    out, result, _ = asyncio.run(relay(cut(STREAM, points)))
    assert out == whole == ROLE + b"".join(TOKENS) + DONE
    assert (result.frames, result.completed, result.usage) == (
        whole_result.frames,
        whole_result.completed,
        whole_result.usage,
    )


@pytest.mark.parametrize(
    ("body", "cached"),
    [
        (b'{"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":4}}}', 4),
        (b'{"usage":{"prompt_tokens":9,"prompt_tokens_details":null}}', None),
        (b'{"usage":{"prompt_tokens":9}}', None),
        (b'{"choices":[]}', None),
        (USAGE.replace(b":4}", b":7}") + b"data: [DONE]\n\n", 7),
        (b'data: {"choices":[{"text":"a"}]}\n\n' + USAGE, 4),  # no [DONE] after it
        (b'data: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\n', None),
        (b"not json", None),
    ],
    ids=["json", "json-unreported", "json-no-details", "json-no-usage", "stream", "stream-cut",
         "stream-no-usage", "garbage"],
)  # fmt: skip
def test_a_whole_answers_usage_reports_its_cached_tokens(body: bytes, cached: int | None) -> None:
    usage = answer_usage(body)
    assert (usage.reported_cached_tokens if usage is not None else None) == cached
