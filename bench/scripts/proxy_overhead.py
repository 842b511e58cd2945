"""Proxy overhead: the router against a direct connection to the same fast backend, one run.

Starts `bench.scripts.fast_backend` and `session-router serve` (embedded Redis: the shared
state is on), then measures with wrk (non-streaming, 1 and 32 connections) and with a streaming
client: added p50/p99 latency, requests/s ratio, added streamed TTFT, and each proxy's CPU per
request and per relayed chunk. Then `--paced-streams` streams at once, each frame `--pace-ms`
after the last as a decoding engine sends them (one frame per read, as in production): frames
relayed per second and CPU per relayed frame. Needs `wrk` on PATH (Debian package wrk).

`--policies colocate,adaptive` runs one router per placement policy, each measured the same
way, so their CPU per request and throughput compare within one run. Reference routers run in
the same run, against the same backend, with `--reference NAME=COMMAND`, where COMMAND may use
{port}, {backend} and {aux_port} (a second free port); e.g. the Rust routers from PyPI (`pip
install vllm-router sglang-router` into a separate venv):

    --reference "vllm-router=VENV/bin/vllm-router --port {port} --worker-urls {backend}
                 --policy round_robin --log-level warning --prometheus-port {aux_port}"

The requests/s ratio depends on what the backend costs per request: the 32-connection runs are
CPU-bound on a small machine, so against a backend far cheaper than a real server any proxy
looks slow. `--work-us 0,150` repeats everything with the backend spending that much CPU per
request (a real API server tokenises, schedules and detokenises; vLLM's costs milliseconds).
Each proxy's ratio is against the mean of the direct runs just before and after it.

    .venv/bin/python -m bench.scripts.proxy_overhead --duration 8 --work-us 0,150
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import aiohttp

from bench.scripts.loadgen import cpu_seconds, free_port, run_wrk, wait_healthy

_BODY = '{"model":"fast","prompt":"hello world","max_tokens":16}'
_PACED_BODY = '{"model":"fast","prompt":"hello world","max_tokens":16,"stream":true,"pace_ms":%g}'
_WRK_SCRIPT = """wrk.method = "POST"
wrk.body = '%s'
wrk.headers["Content-Type"] = "application/json"
sent = 0
request = function()
  sent = sent + 1
  wrk.headers["X-Session-ID"] = "bench-" .. (sent %% %d)
  return wrk.format()
end
"""


async def _stream_ttft(url: str, n: int) -> tuple[float, int]:
    """Median time to the first streamed frame over n sequential streams, and frames seen."""
    body = {"model": "fast", "prompt": "hello", "max_tokens": 16, "stream": True}
    samples: list[float] = []
    frames = 0
    async with aiohttp.ClientSession() as session:
        for _ in range(n):
            started = time.perf_counter()
            first = None
            async with session.post(
                url + "/v1/completions", json=body, headers={"X-Session-ID": "bench-stream"}
            ) as response:
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        frames += 1
                        if first is None:
                            first = time.perf_counter() - started
            samples.append(first or 0.0)
    return statistics.median(samples), frames


@contextmanager
def _processes(commands: list[list[str]]) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for cmd in commands]  # fmt: skip
    try:
        yield procs
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def _after_healthy(backend: str, commands: list[list[str]]) -> list[list[str]]:
    """`commands`, once the backend answers: some routers give up on a worker that is down."""
    wait_healthy(backend, timeout_s=60)
    return commands


def _row(name: str, row: dict[str, float]) -> str:
    return f"{name:>22} {row['p50_us']:>8.0f} {row['p99_us']:>8.0f} {row['rps']:>9.0f}"


def _relay_rates(args: argparse.Namespace, url: str, pid: int, script: str) -> tuple[float, float]:
    """Frames relayed per second and CPU us per frame of `pid`, over paced concurrent streams."""
    run_wrk(url + "/v1/completions", args.paced_streams, 2, script)  # the pool grows first
    cpu_before = cpu_seconds(pid)
    run = run_wrk(url + "/v1/completions", args.paced_streams, args.duration, script)
    cpu = cpu_seconds(pid) - cpu_before
    frames = run["requests"] * (args.chunks + 2)  # the content frames, usage and [DONE]
    return frames / args.duration, cpu / frames * 1e6


def _measure_relay(
    args: argparse.Namespace, backend: str, proxies: dict[str, str], pids: dict[str, int],
    backend_pid: int, script: str,
) -> None:  # fmt: skip
    """Many streams at once, each frame `--pace-ms` after the last, as a decoding engine sends
    them: what relaying costs per frame, apart from the per-request work of the runs above."""
    print(f"\n{args.paced_streams} paced streams at once ({args.chunks} frames, "
          f"{args.pace_ms:g} ms apart):")  # fmt: skip
    rate, cpu = _relay_rates(args, backend, backend_pid, script)
    print(f"{'direct':>22} {rate:>9.0f} frames/s; the backend's CPU {cpu:.1f} us/frame")
    for name, url in proxies.items():
        rate, cpu = _relay_rates(args, url, pids[name], script)
        print(f"{name:>22} {rate:>9.0f} frames/s; CPU {cpu:.1f} us/relayed frame")


def _measure(args: argparse.Namespace, work_us: float, script: str, paced: str) -> None:
    backend_port = free_port()
    backend = f"http://127.0.0.1:{backend_port}"
    proxies: dict[str, str] = {}
    commands = [
        [sys.executable, "-m", "bench.scripts.fast_backend", "--port", str(backend_port),
         "--chunks", str(args.chunks), "--work-us", str(work_us)],
    ]  # fmt: skip
    policies = args.policies.split(",")
    for policy in policies:
        # one router per policy, each measured against the direct runs beside it
        router_port = free_port()
        name = "session-router" if len(policies) == 1 else f"session-router/{policy}"
        proxies[name] = f"http://127.0.0.1:{router_port}"
        commands.append([sys.executable, "-m", "session_router_cli", "serve", "--port",
                         str(router_port), "--mixed", backend, "--policy", policy,
                         "--log-level", "warning"])  # fmt: skip
    for reference in args.reference:
        name, _, template = reference.partition("=")
        port = free_port()
        proxies[name] = f"http://127.0.0.1:{port}"
        aux = free_port()  # e.g. a router's own metrics listener
        commands.append(shlex.split(template.format(port=port, backend=backend, aux_port=aux)))
    with (
        _processes(commands[:1]) as backend_procs,
        _processes(_after_healthy(backend, commands[1:])) as procs,
    ):
        pids = {name: procs[i].pid for i, name in enumerate(proxies)}
        for name, url in proxies.items():
            try:
                wait_healthy(url, timeout_s=60)
            except RuntimeError as exc:
                raise SystemExit(f"{name} did not come up: {exc}") from exc
        for url in (backend, *proxies.values()):
            run_wrk(url + "/v1/completions", 4, 2, script)  # warm every path up
        print(f"\nbackend work {work_us:g} us/request")
        print(f"{'connections / path':>22} {'p50 us':>8} {'p99 us':>8} {'req/s':>9}")
        for connections in (1, 32):
            direct = run_wrk(backend + "/v1/completions", connections, args.duration, script)
            print(_row(f"{connections} direct", direct))
            for name, url in proxies.items():
                cpu_before = cpu_seconds(pids[name])
                routed = run_wrk(url + "/v1/completions", connections, args.duration, script)
                cpu = cpu_seconds(pids[name]) - cpu_before
                after = run_wrk(backend + "/v1/completions", connections, args.duration, script)
                rps = (direct["rps"] + after["rps"]) / 2
                p50 = (direct["p50_us"] + after["p50_us"]) / 2
                p99 = (direct["p99_us"] + after["p99_us"]) / 2
                print(_row(f"{connections} {name}", routed))
                print(f"{'':>22} added p50 {routed['p50_us'] - p50:+.0f} us, "
                      f"p99 {routed['p99_us'] - p99:+.0f} us, throughput "
                      f"{routed['rps'] / rps:.2f}x direct, "
                      f"CPU {cpu / routed['requests'] * 1e6:.0f} us/request")  # fmt: skip
                print(_row(f"{connections} direct", after))
                direct = after
        direct_ttft, _ = asyncio.run(_stream_ttft(backend, args.streams))
        for name, url in proxies.items():
            cpu_before = cpu_seconds(pids[name])
            routed_ttft, frames = asyncio.run(_stream_ttft(url, args.streams))
            cpu = cpu_seconds(pids[name]) - cpu_before
            print(f"{name}: streamed TTFT p50 direct {direct_ttft * 1e6:.0f} us, proxied "
                  f"{routed_ttft * 1e6:.0f} us (added {(routed_ttft - direct_ttft) * 1e6:+.0f} "
                  f"us); CPU {cpu / args.streams * 1e6:.0f} us/stream, "
                  f"{cpu / max(1, frames) * 1e6:.1f} us/relayed chunk")  # fmt: skip
        if args.paced_streams:
            _measure_relay(args, backend, proxies, pids, backend_procs[0].pid, paced)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=300)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--sessions", type=int, default=1,
                        help="session ids cycled through (1: every commit coalesces)")  # fmt: skip
    parser.add_argument("--work-us", default="0", help="comma-separated backend CPU per request")
    parser.add_argument("--policies", "--policy", default="colocate",
                        help="the router's placement policies, comma-separated: one router "
                        "each, in the same run (decisions cost CPU)")  # fmt: skip
    parser.add_argument(
        "--paced-streams",
        type=int,
        default=128,
        help="streams at once in the paced relay run (0: skip it)",
    )
    parser.add_argument("--pace-ms", type=float, default=10.0,
                        help="gap between a paced stream's frames")  # fmt: skip
    parser.add_argument("--reference", action="append", default=[], metavar="NAME=COMMAND",
                        help="another router to measure in the same run")  # fmt: skip
    args = parser.parse_args()
    for reference in args.reference:
        if "=" not in reference:
            parser.error(f"--reference wants NAME=COMMAND, got {reference!r}")
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(_WRK_SCRIPT % (_BODY, args.sessions))
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as paced:
        paced.write(_WRK_SCRIPT % (_PACED_BODY % args.pace_ms, args.sessions))
    for work in args.work_us.split(","):
        _measure(args, float(work), script.name, paced.name)


if __name__ == "__main__":
    main()
