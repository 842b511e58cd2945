"""The live replay client against a scripted in-process OpenAI server, and live against `up`."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from bench.replay.run import (
    filler_answer,
    join_stage_events,
    read_stage_events,
    replay,
    run_duration_s,
)
from bench.replay.stream import LagProbe
from bench.results.outputs import read_requests, rounded_times, write_run_outputs
from bench.results.summary import Objectives, Summary, percentiles, read_summary, summarise, ttft_ms
from bench.stack.layout import ClusterSpec
from bench.stack.up import LocalStack, StackSpec
from bench.traces.model import Conversation, Trace, TraceTurn
from bench.traces.textgen import chat_prompt_tokens, count_words
from bench.traces.workloads import ArrivalSpec, ThinkSpec, WorkloadSpec, generate_matrix
from tests.conftest import free_port

OBJECTIVES = Objectives()
Mode = str


class FakeOpenAI:
    """Streams `max_tokens` words `a0 a1 ...` one frame each; `mode_for(n)` scripts request n."""

    def __init__(self, mode_for: Callable[[int], Mode] = lambda n: "ok",
                 interval_s: float = 0.0) -> None:  # fmt: skip
        self.mode_for = mode_for
        self.interval_s = interval_s
        self.requests: list[tuple[str, Mapping[str, str], dict[str, Any], float]] = []
        self.inflight = 0
        self.max_inflight = 0
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        mode = self.mode_for(len(self.requests))
        self.requests.append((request.path, request.headers.copy(), body, time.perf_counter()))
        if mode in ("reject", "fail"):
            status, message = (429, "turn rejected: no placement") if mode == "reject" else (
                500, "boom")  # fmt: skip
            return web.json_response({"error": {"message": message, "code": status}},
                                     status=status)  # fmt: skip
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            return await self._stream(request, body, mode)
        finally:
            self.inflight -= 1

    async def _stream(
        self, request: web.Request, body: dict[str, Any], mode: Mode
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chat = request.path.endswith("chat/completions")
        if chat:
            role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
            await response.write(b"data: " + json.dumps(role).encode() + b"\n\n")
        if mode == "hang":
            await asyncio.sleep(3600)
        tokens = body["max_tokens"] if mode not in ("midstream", "truncated") else 2
        for i in range(tokens):
            text = f"a{i}" if i == 0 else f" a{i}"
            choice = (
                {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            )
            frame = b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"
            if mode == "split":  # one frame over two reads
                await response.write(frame[:20])
                await asyncio.sleep(0.01)
                frame = frame[20:]
            await response.write(frame)
            if self.interval_s:
                await asyncio.sleep(self.interval_s)
        if mode == "truncated":
            return response
        if mode == "midstream":
            await response.write(b'data: {"error": {"message": "worker failed", "code": 502}}'
                                 b"\n\n")  # fmt: skip
        prompt = chat_prompt_tokens(body["messages"]) if chat else count_words(body["prompt"])
        usage = {"prompt_tokens": prompt, "completion_tokens": tokens,
                 "prompt_tokens_details": {"cached_tokens": 3}}  # fmt: skip
        await response.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode()
                             + b"\n\ndata: [DONE]\n\n")  # fmt: skip
        return response


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[FakeOpenAI], Any]]:
    runners: list[web.AppRunner] = []

    async def start(fake: FakeOpenAI) -> FakeOpenAI:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", fake.handle)
        app.router.add_post("/v1/completions", fake.handle)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        fake.url = f"http://127.0.0.1:{port}"
        return fake

    yield start
    for runner in runners:
        await runner.cleanup()


def _trace(*sessions: list[TraceTurn], concurrency: int | None = None) -> Trace:
    conversations = tuple(Conversation(f"s{i}", tuple(turns)) for i, turns in enumerate(sessions))
    return Trace("t", conversations, block_tokens=16, concurrency=concurrency)


def _turn(arrival: float = 0.0, new: int = 5, out: int = 4, think: float = 0.0) -> TraceTurn:
    return TraceTurn(arrival_s=arrival, new_input_tokens=new, output_tokens=out, think_s=think,
                     klass="k")  # fmt: skip


@pytest.mark.parametrize(
    ("mode", "status", "http_status", "error", "chunks"),
    [
        ("ok", "completed", 200, "", 4),
        ("split", "completed", 200, "", 4),
        ("reject", "rejected", 429, "turn rejected: no placement", 0),
        ("fail", "error", 500, "boom", 0),
        ("midstream", "error", 200, "worker failed", 2),
        ("truncated", "error", 200, "stream ended before [DONE]", 2),
    ],
)
async def test_statuses(serve: Any, mode: Mode, status: str, http_status: int, error: str,
                        chunks: int) -> None:  # fmt: skip
    fake = await serve(FakeOpenAI(lambda n: mode))
    [result] = await replay(_trace([_turn()]), fake.url, objectives=OBJECTIVES, policy_label="p")
    assert (result.status, result.http_status, result.error) == (status, http_status, error)
    assert len(result.chunk_times) == chunks
    assert result.first_chunk_at == (result.chunk_times[0] if chunks else None)
    assert result.chunk_times == sorted(result.chunk_times)
    if status == "completed":
        # 5 words + one tag per message + the generation prompt, as the sim counts it
        assert (result.prompt_tokens, result.cached_tokens, result.completion_tokens) == (7, 3, 4)
        assert result.done_at is not None and result.done_at >= result.chunk_times[-1]


async def test_timeout_is_an_error_not_a_hang(serve: Any) -> None:
    fake = await serve(FakeOpenAI(lambda n: "hang"))
    started = time.perf_counter()
    [result] = await replay(_trace([_turn()]), fake.url, objectives=OBJECTIVES,
                            request_timeout_s=0.3)  # fmt: skip
    assert time.perf_counter() - started < 2.0
    assert (result.status, result.error) == ("error", "timed out after 0.3 s")


async def test_headers_and_body(serve: Any) -> None:
    fake = await serve(FakeOpenAI())
    slo = TraceTurn(arrival_s=0, new_input_tokens=3, output_tokens=2, ttft_slo_ms=250.0,
                    itl_slo_ms=40.0)  # fmt: skip
    results = await replay(_trace([_turn(new=10, out=3)], [slo]), fake.url, model="m",
                           objectives=Objectives(500.0, 0.5, 80.0))  # fmt: skip
    by_session = {r.session_id: r for r in results}
    seen = {h["X-Session-ID"]: (h, body) for _, h, body, _ in fake.requests}
    headers, body = seen["s0"]
    assert headers["X-Request-Id"] == by_session["s0"].request_id
    assert by_session["s0"].request_id != by_session["s1"].request_id
    # 10 words + 1 tag + 1 generation prompt = 12 tokens: 500 + 0.5 * 12
    assert (headers["X-SLO-TTFT-Ms"], headers["X-SLO-ITL-Ms"]) == ("506.000", "80.000")
    assert seen["s1"][0]["X-SLO-TTFT-Ms"] == "250.000"
    assert seen["s1"][0]["X-SLO-ITL-Ms"] == "40.000"
    assert {k: v for k, v in body.items() if k != "messages"} == {
        "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": True, "model": "m",
    }  # fmt: skip
    assert count_words(body["messages"][0]["content"]) == 10
    assert by_session["s1"].ttft_slo_ms == 250.0 and by_session["s0"].ttft_slo_ms is None


async def test_later_turn_carries_the_answer_after_its_think_time(serve: Any) -> None:
    fake = await serve(FakeOpenAI())
    session = [_turn(new=4, out=3), _turn(new=2, out=2, think=0.2)]
    first, second = await replay(_trace(session), fake.url, objectives=OBJECTIVES)
    assert first.done_at is not None and second.sent_at >= first.done_at + 0.2
    messages = fake.requests[1][2]["messages"]
    assert messages[:1] == fake.requests[0][2]["messages"]
    assert messages[1] == {"role": "assistant", "content": "a0 a1 a2"}
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert second.prompt_tokens == 4 + 3 + 2 + 3 + 1


async def test_a_turn_without_answer_is_followed_by_a_filler_of_its_size(serve: Any) -> None:
    fake = await serve(FakeOpenAI(lambda n: "reject" if n == 0 else "ok"))
    trace = _trace([_turn(out=6), _turn(out=2)])
    first, second = await replay(trace, fake.url, objectives=OBJECTIVES)
    assert (first.status, second.status) == ("rejected", "completed")
    assistant = fake.requests[1][2]["messages"][1]["content"]
    assert assistant == filler_answer(trace.conversations[0], 0)
    assert count_words(assistant) == 6


async def test_completions_api(serve: Any) -> None:
    fake = await serve(FakeOpenAI())
    session = [_turn(new=7, out=3), _turn(new=2, out=2)]
    first, second = await replay(_trace(session), fake.url, api="completions",
                                 objectives=OBJECTIVES)  # fmt: skip
    assert [path for path, *_ in fake.requests] == ["/v1/completions"] * 2
    first_prompt, second_prompt = (body["prompt"] for _, _, body, _ in fake.requests)
    assert second_prompt.startswith(first_prompt + " a0 a1 a2 ")
    assert count_words(second_prompt) == 7 + 3 + 2
    assert (first.prompt_tokens, second.prompt_tokens) == (7, 12)
    assert [len(first.chunk_times), len(second.chunk_times)] == [3, 2]


async def test_open_loop_arrivals_are_scaled(serve: Any) -> None:
    fake = await serve(FakeOpenAI())
    trace = _trace([_turn(arrival=0.0)], [_turn(arrival=0.4)], [_turn(arrival=0.8)])
    results = await replay(trace, fake.url, rate_scale=2.0, objectives=OBJECTIVES)
    offsets = [r.sent_at - results[0].sent_at for r in results]
    assert [r.session_id for r in results] == ["s0", "s1", "s2"]
    assert offsets == pytest.approx([0.0, 0.2, 0.4], abs=0.05)


async def test_closed_loop_keeps_concurrency_sessions_in_flight(serve: Any) -> None:
    fake = await serve(FakeOpenAI(interval_s=0.02))
    sessions = [[_turn(arrival=9.0), _turn(arrival=9.0)] for _ in range(5)]
    started = time.perf_counter()
    results = await replay(_trace(*sessions, concurrency=2), fake.url, objectives=OBJECTIVES)
    assert time.perf_counter() - started < 5.0  # arrivals (9 s) are ignored
    assert len(results) == 10 and {r.status for r in results} == {"completed"}
    assert fake.max_inflight == 2
    # each session's turns run in order
    for sid in {r.session_id for r in results}:
        turns = [r for r in results if r.session_id == sid]
        assert [r.turn_index for r in turns] == [0, 1]


async def test_stop_cancels_in_flight_and_accounts_for_every_request(serve: Any) -> None:
    fake = await serve(FakeOpenAI(lambda n: "ok", interval_s=0.02))
    trace = _trace([_turn(arrival=0.0, out=2)], [_turn(arrival=0.05, out=100)],
                   [_turn(arrival=0.1, out=100)], [_turn(arrival=5.0, out=2)])  # fmt: skip
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.4, stop.set)
    started = time.perf_counter()
    results = await replay(trace, fake.url, objectives=OBJECTIVES, stop=stop)
    assert time.perf_counter() - started < 1.5
    assert len(results) == len(fake.requests) == 3
    assert [(r.session_id, r.status) for r in results] == [
        ("s0", "completed"), ("s1", "error"), ("s2", "error")]  # fmt: skip
    assert all(r.error == "cancelled: the replay was stopped" for r in results[1:])
    assert all(r.done_at is not None and 0 < len(r.chunk_times) < 100 for r in results[1:])
    await asyncio.sleep(0.05)
    assert fake.inflight == 0  # the server saw the cancelled streams go away


async def test_lag_probe_sees_a_blocked_loop() -> None:
    probe = LagProbe(interval_s=0.001)
    probe.start()
    await asyncio.sleep(0.05)
    quiet = len(probe.samples)
    time.sleep(0.03)  # noqa: ASYNC251 -- a blocked loop is what the probe must see
    await asyncio.sleep(0.02)
    await probe.stop()
    assert quiet >= 10
    assert max(probe.samples[:quiet]) < 0.01
    assert 0.02 <= max(probe.samples) < 0.1
    assert probe.quantile_ms(1.0) == max(probe.samples) * 1000


def _events(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + "\n")


async def test_join_stage_events(serve: Any, tmp_path: Path) -> None:
    fake = await serve(FakeOpenAI())
    results = await replay(_trace([_turn()], [_turn()], [_turn()]), fake.url,
                           objectives=OBJECTIVES)  # fmt: skip
    a, b, _ = (r.request_id for r in results)
    path = tmp_path / "events.jsonl"
    _events(path, [
        {"request_id": a, "session_id": "s0", "action": "handoff", "transfer_start": 100.25,
         "transfer_end": 100.375, "transferred_bytes": 4096, "first_token_convention": "prefill",
         "predicted": {"ttft_ms": 321.5}, "future_field": 1},
        {"request_id": b, "session_id": "s1", "action": "recompute", "recomputed_tokens": 77,
         "first_token_convention": "prefill"},
        {"request_id": "other-run", "session_id": "x", "action": "colocate"},
    ])  # fmt: skip
    joined, matched, convention = join_stage_events(results, read_stage_events(path))
    assert (matched, convention) == (2, "prefill")
    fields = [(r.action, r.recomputed_tokens, r.transferred_bytes, r.exposed_transfer_ms)
              for r in joined]  # fmt: skip
    assert fields == [("handoff", 0, 4096, 125.0), ("recompute", 77, 0, None), (None, 0, 0, None)]
    # The policy's predicted TTFT where it made one (a baseline's decision predicts nothing).
    assert [r.predicted_ttft_ms for r in joined] == [321.5, None, None]
    assert joined[2] == results[2]


LIVE_SPEC = WorkloadSpec(
    name="live", prompt_tokens=(128, 2048), output_tokens=(16,),
    reuse=("none", "system-prefix", "multi-turn"), turns=(3,), sessions_per_class=2,
    system_prefix_tokens=512, arrival=ArrivalSpec(rate_rps=20.0),
    think=ThinkSpec(distribution="fixed", mean_s=0.1),
)  # fmt: skip


async def test_live_replay_against_up(tmp_path: Path) -> None:
    """A 20-turn trace through a real router (disaggregate) and simulated workers."""
    events = tmp_path / "events.jsonl"
    spec = StackSpec(cluster=ClusterSpec(2, "h200-sxm", "llama-3.1-8b"),
                     roles=("prefill", "decode"), policy="disaggregate", events=str(events),
                     log_dir=str(tmp_path / "logs"))  # fmt: skip
    trace = generate_matrix(LIVE_SPEC)
    assert trace.num_turns == 20
    async with LocalStack(spec) as stack:
        results = await replay(trace, stack.url, objectives=OBJECTIVES,
                               policy_label="disaggregate", model=stack.model)  # fmt: skip
    joined, matched, convention = join_stage_events(results, read_stage_events(events))
    assert (len(joined), matched, convention) == (20, 20, "decode")
    run = summarise(joined, "disaggregate", 1.0, run_duration_s(joined), "decode")
    write_run_outputs(tmp_path / "out", Summary([run]), joined, "live")

    rows = read_requests(tmp_path / "out" / "requests.jsonl")
    [saved] = read_summary(tmp_path / "out" / "summary.json").runs
    # the file keeps times to the microsecond
    assert rows == [rounded_times(r) for r in joined] and saved == run
    assert (saved.requests, saved.completed, saved.rejected, saved.errors) == (20, 20, 0, 0)
    ttfts = [t for r in joined if (t := ttft_ms(r)) is not None]
    assert (saved.ttft_ms.p50, saved.ttft_ms.p90, saved.ttft_ms.p99) == percentiles(
        ttfts, (50, 90, 99))  # fmt: skip
    assert saved.actions == {"handoff": 20} and saved.transferred_bytes > 0
    assert all(r.exposed_transfer_ms is not None for r in rows)
    by_session = {c.session_id: c for c in trace.conversations}
    for row in rows:
        conversation = by_session[row.session_id]
        turn = conversation.turns[row.turn_index]
        messages = 2 * row.turn_index + 1 + (1 if conversation.system_prefix_tokens else 0)
        # the synthesised prompt has exactly the trace's tokens; the worker adds the template
        assert row.prompt_tokens == conversation.context_tokens(row.turn_index) + messages + 1
        assert row.completion_tokens == len(row.chunk_times) == turn.output_tokens
