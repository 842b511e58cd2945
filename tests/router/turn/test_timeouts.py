"""Deadlines on a turn's legs: a worker that accepts a request and never finishes it (while its
/metrics answers, so it stays healthy) no longer holds the turn. Before any byte reached the
client the turn is retried once elsewhere, after that it fails as a 504 (an error event and
`data: [DONE]` once the stream began), and the worker's request is cancelled: its connection
closed. Every timeout here is a fraction of a second and asserted by outcome."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import msgspec
import pytest

from router.config import RouterConfig, WorkerSpec, add_serve_options, load_config
from router.turn.legs import LegTimeouts
from tests.raw_server import RawServer, chunk
from tests.router.turn.fake_upstream import WAIT_S, Stack, spec

Mode = Literal["silent", "head", "frames"]
# every deadline short; the first byte's is its floor (no multiple of the TTFT objective)
FAST: dict[str, Any] = {"head_timeout_s": 0.2, "first_byte_timeout_s": 0.3,
                        "first_byte_ttft_multiple": 0.0, "chunk_gap_timeout_s": 0.2,
                        "request_timeout_s": 0.3}  # fmt: skip
STREAM_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
ROLE = b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'  # noqa: E501
WORD = b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":" x0"},"logprobs":null,"finish_reason":null}]}\n\n'  # noqa: E501
METRICS = (b"vllm:num_requests_running{engine=\"0\"} 0\nvllm:num_requests_waiting{engine=\"0\"} 0\n"
           b"vllm:kv_cache_usage_perc{engine=\"0\"} 0.0\n")  # fmt: skip
MODELS = b'{"object":"list","data":[{"id":"m","object":"model","owned_by":"vllm"}]}'


class NeverFinishes(RawServer):
    """A worker on 127.0.0.1 that answers GET /metrics, /v1/models and /health like vLLM but
    never finishes a generation request: `mode` "silent" sends nothing, "head" a stream's
    head only, "frames" the head, a role frame and one content frame (" x0"). It waits for
    the caller to close the connection and counts that (`cancelled`)."""

    def __init__(self, name: str, mode: Mode = "silent") -> None:
        super().__init__()
        self.name = name
        self.mode = mode
        self.posts = 0
        self.cancelled = 0
        self._cancel = asyncio.Event()

    def spec(self, role: str = "mixed") -> WorkerSpec:
        return msgspec.convert({"url": self.url, "role": role, "id": self.name}, WorkerSpec)

    async def wait_cancelled(self) -> None:
        """Until a caller closed a generation request's connection (TimeoutError past WAIT_S)."""
        async with asyncio.timeout(WAIT_S):
            await self._cancel.wait()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, path = head.split(b" ", 2)[:2]
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                if method == b"GET":
                    body = {b"/metrics": METRICS, b"/v1/models": MODELS}.get(path, b"{}")
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b"
                                 % (len(body), body))  # fmt: skip
                    continue
                self.posts += 1
                if self.mode != "silent":
                    writer.write(STREAM_HEAD)
                if self.mode == "frames":
                    writer.write(chunk(ROLE) + chunk(WORD))
                while await reader.read(4096):
                    pass  # never an answer: until the caller goes
                self.cancelled += 1
                self._cancel.set()
                return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


@pytest.fixture
async def stack(redis_url: str) -> AsyncIterator[Stack]:
    async with Stack(redis_url) as stack:
        yield stack


@pytest.fixture
async def never() -> AsyncIterator[list[NeverFinishes]]:
    started: list[NeverFinishes] = []
    yield started
    for worker in started:
        await worker.stop()


async def never_finishes(
    started: list[NeverFinishes], name: str, mode: Mode = "silent"
) -> NeverFinishes:
    worker = NeverFinishes(name, mode)
    await worker.start()
    started.append(worker)
    return worker


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5,
            **extra}  # fmt: skip


async def turn(stack: Stack, url: str, streamed: bool) -> tuple[int, list[bytes], Any]:
    """(status, the stream's non-empty lines or [], the decoded JSON reply or None)."""
    body = chat_body(stream=True) if streamed else chat_body()
    async with stack.http.post(url + "/v1/chat/completions", json=body) as response:
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            lines = [line.strip() async for line in response.content if line.strip()]
            return response.status, lines, None
        return response.status, [], await response.json()


def text_of(lines: list[bytes]) -> str:
    parts = []
    for line in lines:
        if line.startswith(b"data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                parts.append(choice.get("delta", {}).get("content") or "")
    return "".join(parts)


@pytest.mark.parametrize(
    ("mode", "streamed", "stage"),
    [("silent", False, "first_byte"), ("silent", True, "head"), ("head", True, "first_byte")],
    ids=["whole-no-answer", "stream-no-head", "stream-head-no-bytes"],
)
async def test_a_worker_that_never_answers_is_timed_out_and_the_turn_retried_on_another(
    stack: Stack, never: list[NeverFinishes], mode: Mode, streamed: bool, stage: str
) -> None:
    a = await never_finishes(never, "a", mode)  # a new session's tie goes to `a`
    b = await stack.worker("b")
    router = await stack.router([a.spec(), spec(b)], **FAST)
    status, lines, reply = await turn(stack, router.url, streamed)
    assert status == 200
    if streamed:
        assert text_of(lines) == " b0 b1 b2" and lines[-1] == b"data: [DONE]"
        assert not any(b'"error"' in line for line in lines)
    else:
        assert reply["choices"][0]["message"]["content"] == " b0 b1 b2"
    assert a.posts == 1 and len(b.received) == 1
    await a.wait_cancelled()  # the router closed the worker's request
    (event,) = await router.decisions(stack.http)
    assert event["retried"] is True and event["decode_worker"] == "b"
    assert event["outcome"] == "completed"
    errors = f'kind="timeout_{stage}",worker="a"'
    assert await router.metric(stack.http, "session_router_upstream_errors_total", errors) == 1


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "stream"])
async def test_a_timeout_with_no_other_worker_is_a_504(
    stack: Stack, never: list[NeverFinishes], streamed: bool
) -> None:
    a = await never_finishes(never, "a")
    router = await stack.router([a.spec()], **FAST)
    status, lines, reply = await turn(stack, router.url, streamed)
    assert status == 504 and lines == []
    assert reply["error"]["code"] == 504 and reply["error"]["type"] == "upstream_timeout"
    assert "worker a failed" in reply["error"]["message"]
    await a.wait_cancelled()
    (event,) = await router.decisions(stack.http)
    assert event["outcome"] == "error" and event["http_status"] == 504


async def test_a_retried_turn_that_times_out_again_is_a_504(
    stack: Stack, never: list[NeverFinishes]
) -> None:
    a = await never_finishes(never, "a")
    b = await never_finishes(never, "b")
    router = await stack.router([a.spec(), b.spec()], **FAST)
    status, _, reply = await turn(stack, router.url, streamed=False)
    assert status == 504 and reply["error"]["code"] == 504
    assert a.posts == 1 and b.posts == 1  # once elsewhere, no more
    await a.wait_cancelled()
    await b.wait_cancelled()
    (event,) = await router.decisions(stack.http)
    assert event["retried"] is True and event["http_status"] == 504


async def test_a_stream_that_stalls_after_its_first_bytes_ends_with_an_error_event_and_done(
    stack: Stack, never: list[NeverFinishes]
) -> None:
    a = await never_finishes(never, "a", "frames")
    b = await stack.worker("b")
    router = await stack.router([a.spec(), spec(b)], **FAST)
    status, lines, _ = await turn(stack, router.url, streamed=True)
    assert status == 200
    assert text_of(lines) == " x0"  # what the worker sent before it went quiet
    assert lines[-1] == b"data: [DONE]" and lines.count(b"data: [DONE]") == 1
    error = json.loads(lines[-2][6:])["error"]
    assert error["code"] == 504 and error["type"] == "upstream_timeout"
    assert b.received == []  # bytes had reached the client: no retry
    await a.wait_cancelled()
    (event,) = await router.decisions(stack.http)
    assert event["outcome"] == "error" and event["error"]
    errors = 'kind="timeout_gap",worker="a"'
    assert await router.metric(stack.http, "session_router_upstream_errors_total", errors) == 1


async def test_a_prefill_leg_that_never_answers_is_retried_on_another_prefill_worker(
    stack: Stack, never: list[NeverFinishes]
) -> None:
    a = await never_finishes(never, "a")  # the least-loaded prefill worker's tie goes to `a`
    b = await stack.worker("b")
    d = await stack.worker("d")
    router = await stack.router([a.spec("prefill"), spec(b, "prefill"), spec(d, "decode")],
                                "disaggregate", **FAST)  # fmt: skip
    status, _, reply = await turn(stack, router.url, streamed=False)
    assert status == 200 and reply["choices"][0]["message"]["content"] == " d0 d1 d2"
    assert a.posts == 1 and b.received[0].is_prefill_leg
    assert d.bodies() == [{**chat_body(), "kv_transfer_params": b.sent_params[0]}]
    await a.wait_cancelled()
    (event,) = await router.decisions(stack.http)
    assert event["retried"] is True and event["prefill_worker"] == "b"
    assert event["action"] == "handoff" and event["outcome"] == "completed"


async def test_timeouts_count_towards_ejection(stack: Stack, never: list[NeverFinishes]) -> None:
    a = await never_finishes(never, "a")
    b = await stack.worker("b")
    router = await stack.router([a.spec(), spec(b)], eject_consecutive_failures=1, **FAST)
    status, _, _ = await turn(stack, router.url, streamed=False)
    assert status == 200 and a.posts == 1
    async with stack.http.get(router.url + "/admin/workers", headers=router.admin) as response:
        rows = {row["id"]: row for row in (await response.json())["workers"]}
    assert rows["a"]["ejected"] is True and rows["a"]["ejected_for_s"] > 0
    assert rows["b"]["ejected"] is False
    # an ejected worker is offered to no policy: a new session goes straight to `b`
    status, _, _ = await turn(stack, router.url, streamed=False)
    assert status == 200 and a.posts == 1 and len(b.received) == 2


def test_the_first_byte_deadline_follows_the_ttft_objective() -> None:
    timeouts = LegTimeouts(first_byte_floor_s=2.0, first_byte_ttft_multiple=10.0, whole_s=60.0)
    assert timeouts.first_byte_s(100.0) == 2.0  # 10 x 0.1 s is under the floor
    assert timeouts.first_byte_s(1500.0) == 15.0
    assert timeouts.first_byte_s(30_000.0) == 60.0  # never past a whole answer's deadline


def test_deadline_and_ejection_options_come_from_every_source(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_serve_options(parser)
    toml = tmp_path / "router.toml"
    toml.write_text("head_timeout_s = 4.0\neject_max_percent = 20.0\n")
    args = parser.parse_args(["--mixed", "http://127.0.0.1:9", "--config", str(toml),
                              "--first-byte-timeout-s", "7", "--eject-base-s", "12"])  # fmt: skip
    environ = {"SESSION_ROUTER_CHUNK_GAP_TIMEOUT_S": "9",
               "SESSION_ROUTER_EJECT_CONSECUTIVE_FAILURES": "3"}  # fmt: skip
    config = load_config(args, environ)
    assert (config.head_timeout_s, config.first_byte_timeout_s, config.chunk_gap_timeout_s) == (
        4.0, 7.0, 9.0)  # fmt: skip
    assert (config.eject_consecutive_failures, config.eject_base_s, config.eject_max_percent) == (
        3, 12.0, 20.0)  # fmt: skip
    timeouts = LegTimeouts.of(config)
    assert (timeouts.head_s, timeouts.gap_s, timeouts.whole_s) == (4.0, 9.0, 600.0)
    defaults = RouterConfig(workers=(WorkerSpec(url="http://127.0.0.1:9"),))
    assert (defaults.first_byte_timeout_s, defaults.first_byte_ttft_multiple) == (30.0, 10.0)
    assert (defaults.eject_consecutive_failures, defaults.eject_max_percent) == (5, 50.0)
