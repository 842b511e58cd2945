"""Does the replay client distort what it measures? Its per-chunk cost and timestamp error.

Starts a fast local streaming server in a subprocess (an aiohttp app that streams `max_tokens`
chat chunks, in the router's exact frame format, every `--interval-ms`, each chunk's text being
the server's `perf_counter()` at the moment it wrote it), pins this client to one core and:

1. replays an open-loop trace through `bench.replay.run.replay` (the real client) whose Poisson
   arrival rate keeps about `--streams` streams in flight once ramped up, with `LagProbe` in
   the client's loop: CPU time per received chunk and loop lag (p50/p99/max);
2. starts the same number of streams at random over one stream's length through
   `bench.replay.stream.stream_request`, keeping the text, and compares every chunk's client
   timestamp with the server's write time (CLOCK_MONOTONIC is shared by processes on Linux):
   the timestamp error itself, loopback delivery included;
3. starts `--streams` requests at the same instant (a closed-loop trace's first wave) and
   reports the lag that burst causes: what simultaneous starts cost a single-core client;
4. times the per-frame classification loop alone on in-memory data (no sockets).

Run:  .venv/bin/python -m experiments.replay_client_overhead --streams 500
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from bench.replay.run import replay
from bench.replay.stream import LagProbe, StreamOutcome, read_stream, stream_request
from bench.results.summary import Objectives
from bench.traces.model import Conversation, Trace, TraceTurn
from sim.worker.protocol import DONE, ResponseFramer, usage_dict


def serve(port: int, interval_s: float) -> None:
    import uvloop

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        tokens = int(body["max_tokens"])
        framer = ResponseFramer("chat", request.headers.get("X-Request-Id", "r"), "m")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(framer.role_chunk())
        loop = asyncio.get_running_loop()
        due = loop.time()
        for _ in range(tokens):
            due += interval_s
            await asyncio.sleep(max(0.0, due - loop.time()))
            await response.write(framer.text_chunk(f" t{time.perf_counter():.7f}", None))
        await response.write(framer.usage_chunk(usage_dict(8, tokens, 0)) + DONE)
        return response

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", handle)
        app.router.add_get("/health", lambda request: _ok())
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=4096).start()
        await asyncio.Event().wait()

    uvloop.run(main())


async def _ok() -> web.Response:
    return web.Response(text="ok")


def _quantiles(values: list[float]) -> str:
    ordered = sorted(values)
    if not ordered:
        return "no samples"

    def at(q: float) -> float:
        return ordered[round(q * (len(ordered) - 1))] * 1000

    return f"p50 {at(0.5):.3f} ms, p99 {at(0.99):.3f} ms, max {ordered[-1] * 1000:.3f} ms"


def _trace(sessions: int, chunks: int, rate: float | None, streams: int) -> Trace:
    """Single-turn sessions: Poisson arrivals at `rate` per second, or all at once (closed
    loop with `streams` in flight)."""
    rng = random.Random(1)
    arrival = 0.0
    conversations = []
    for i in range(sessions):
        turn = TraceTurn(arrival_s=arrival, new_input_tokens=8, output_tokens=chunks)
        conversations.append(Conversation(f"s{i}", (turn,)))
        if rate:
            arrival += rng.expovariate(rate)
    return Trace("overhead", tuple(conversations), concurrency=None if rate else streams)


def _max_in_flight(spans: list[tuple[float, float]]) -> int:
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    peak = level = 0
    for _, step in edges:
        level += step
        peak = max(peak, level)
    return peak


async def _replay_phase(url: str, args: argparse.Namespace) -> None:
    rate = args.streams / (args.chunks * args.interval_ms / 1000)
    trace = _trace(args.sessions, args.chunks, rate, args.streams)
    probe = LagProbe(interval_s=0.002)
    probe.start()
    cpu, wall = time.process_time(), time.perf_counter()
    results = await replay(trace, url, objectives=Objectives(), policy_label="overhead")
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    await probe.stop()
    chunks = sum(len(r.chunk_times) for r in results)
    failed = sum(1 for r in results if r.status != "completed")
    peak = _max_in_flight([(r.sent_at, r.done_at or r.sent_at) for r in results])
    print(
        f"1. replay(), open loop at {rate:g} req/s: {len(results)} requests ({failed} failed), "
        f"up to {peak} streams in flight, {chunks} chunks in {wall:.1f} s "
        f"= {chunks / wall:,.0f} chunks/s"
    )
    print(
        f"   client CPU {cpu:.2f} s ({cpu / wall:.0%} of one core): "
        f"{cpu / chunks * 1e6:.1f} us per chunk, everything included (HTTP, SSE, prompts)"
    )
    print(f"   event-loop lag ({len(probe.samples)} samples): {_quantiles(probe.samples)}")


async def _one_stream(
    session: aiohttp.ClientSession, url: str, body: bytes, delay: float, outcome: StreamOutcome
) -> None:
    await asyncio.sleep(delay)
    headers = {"Content-Type": "application/json"}
    await stream_request(session, url, body, headers, "chat", True, 120.0, outcome)


async def _error_phase(url: str, args: argparse.Namespace) -> None:
    body = (b'{"messages":[{"role":"user","content":"a b c"}],"max_tokens":%d,"stream":true,'
            b'"stream_options":{"include_usage":true}}') % args.chunks  # fmt: skip
    outcomes = [StreamOutcome() for _ in range(args.streams)]
    # starts spread at random over one stream's length: chunk phases uniform, as from many
    # independent decode batches
    rng = random.Random(0)
    span = args.chunks * args.interval_ms / 1000
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(
            _one_stream(session, url + "/v1/chat/completions", body, rng.uniform(0, span), o)
            for o in outcomes
        ))  # fmt: skip
    errors: list[float] = []
    for outcome in outcomes:
        words = outcome.answer_text().split()
        errors += [at - float(word[1:]) for at, word in zip(outcome.chunk_times, words,
                                                            strict=True)]  # fmt: skip
    print(
        f"2. timestamp error (client stamp - server write time), {len(errors)} chunks of "
        f"{args.streams} streams started at random over {span:g} s: {_quantiles(errors)}"
    )


async def _burst_phase(url: str, args: argparse.Namespace) -> None:
    trace = _trace(args.streams, 4, None, args.streams)
    probe = LagProbe(interval_s=0.002)
    probe.start()
    results = await replay(trace, url, objectives=Objectives())
    await probe.stop()
    sent = sorted(r.sent_at for r in results)
    firsts = sorted(r.first_chunk_at for r in results if r.first_chunk_at is not None)
    print(
        f"3. {args.streams} requests started at once: sent over {(sent[-1] - sent[0]) * 1e3:.0f}"
        f" ms, first chunks over {(firsts[-1] - firsts[0]) * 1e3:.0f} ms; loop lag "
        f"{_quantiles(probe.samples)}"
    )


class _Canned:
    def __init__(self, reads: list[bytes]) -> None:
        self.content = self
        self._reads = reads

    async def iter_any(self) -> AsyncIterator[bytes]:
        for data in self._reads:
            yield data


async def _parse_phase(frames: int) -> None:
    framer = ResponseFramer("chat", "r", "m")
    chunk = framer.text_chunk(" word", None)
    reads = [chunk * 4] * (frames // 4) + [framer.usage_chunk(usage_dict(8, frames, 0)) + DONE]
    outcome = StreamOutcome()
    started = time.process_time()
    await read_stream(_Canned(reads), "chat", False, outcome)  # type: ignore[arg-type]
    spent = time.process_time() - started
    assert outcome.status == "completed" and len(outcome.chunk_times) == frames
    print(
        f"4. classification alone: {spent / frames * 1e6:.2f} us CPU per content frame "
        f"({frames} frames, 4 per read)"
    )


async def client(args: argparse.Namespace) -> None:
    url = f"http://127.0.0.1:{args.port}"
    async with aiohttp.ClientSession() as session:
        for _ in range(200):
            try:
                async with session.get(url + "/health") as response:
                    if response.status == 200:
                        break
            except aiohttp.ClientError:
                await asyncio.sleep(0.05)
    await _replay_phase(url, args)
    await _error_phase(url, args)
    await _burst_phase(url, args)
    await _parse_phase(200_000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--sessions", type=int, default=1500, help="requests in phase 1")
    parser.add_argument("--chunks", type=int, default=100, help="chunks per request")
    parser.add_argument("--interval-ms", type=float, default=50.0, help="server chunk interval")
    parser.add_argument("--port", type=int, default=18931)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.port, args.interval_ms / 1000)
        return
    cores = sorted(os.sched_getaffinity(0))
    server = subprocess.Popen(
        [sys.executable, "-m", "experiments.replay_client_overhead", "--serve",
         "--port", str(args.port), "--interval-ms", str(args.interval_ms)],
    )  # fmt: skip
    try:
        if len(cores) > 1:  # the server gets the other cores; this client one core
            os.sched_setaffinity(server.pid, cores[1:])
        os.sched_setaffinity(0, cores[:1])
        print(
            f"client pinned to core {cores[0]}; server (pid {server.pid}) on {cores[1:]}; "
            f"{args.chunks} chunks every {args.interval_ms:g} ms per stream"
        )
        import uvloop

        uvloop.run(client(args))
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
