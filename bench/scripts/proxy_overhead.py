"""Proxy overhead: the router against a direct connection to the same fast backend, one run.

Starts `bench.scripts.fast_backend` and `session-router serve` (embedded Redis: the shared
state is on), then measures with wrk (non-streaming, 1 and 32 connections) and with a streaming
client: added p50/p99 latency, requests/s ratio, added streamed TTFT, and the router's CPU per
request and per relayed chunk. Needs `wrk` on PATH (Debian package wrk).

    .venv/bin/python -m bench.scripts.proxy_overhead --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp

from bench.scripts.loadgen import cpu_seconds, free_port, run_wrk, wait_healthy

_BODY = '{"model":"fast","prompt":"hello world","max_tokens":16}'
_WRK_SCRIPT = f"""wrk.method = "POST"
wrk.body = '{_BODY}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["X-Session-ID"] = "bench-session"
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=300)
    parser.add_argument("--chunks", type=int, default=16)
    args = parser.parse_args()
    backend_port, router_port = free_port(), free_port()
    backend_url = f"http://127.0.0.1:{backend_port}"
    router_url = f"http://127.0.0.1:{router_port}"
    procs = [
        subprocess.Popen([sys.executable, "-m", "bench.scripts.fast_backend", "--port",
                          str(backend_port), "--chunks", str(args.chunks)]),
        subprocess.Popen([sys.executable, "-m", "session_router_cli", "serve", "--port",
                          str(router_port), "--mixed", backend_url, "--policy", "colocate",
                          "--log-level", "warning"], stdout=subprocess.DEVNULL),
    ]  # fmt: skip
    try:
        wait_healthy(backend_url)
        wait_healthy(router_url)
        router_pid = procs[1].pid
        with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
            script.write(_WRK_SCRIPT)
        run_wrk(router_url + "/v1/completions", 4, 2, script.name)  # warm both paths up
        run_wrk(backend_url + "/v1/completions", 4, 2, script.name)
        print(f"{'connections':>11} {'path':>7} {'p50 us':>8} {'p99 us':>8} {'req/s':>9}")
        for connections in (1, 32):
            direct = run_wrk(
                backend_url + "/v1/completions", connections, args.duration, script.name
            )
            cpu_before = cpu_seconds(router_pid)
            routed = run_wrk(
                router_url + "/v1/completions", connections, args.duration, script.name
            )
            cpu = cpu_seconds(router_pid) - cpu_before
            for name, row in (("direct", direct), ("router", routed)):
                print(f"{connections:>11} {name:>7} {row['p50_us']:>8.0f} {row['p99_us']:>8.0f} "
                      f"{row['rps']:>9.0f}")  # fmt: skip
            print(f"{'':>11} added p50 {routed['p50_us'] - direct['p50_us']:+.0f} us, "
                  f"p99 {routed['p99_us'] - direct['p99_us']:+.0f} us, "
                  f"throughput {routed['rps'] / direct['rps']:.2f}x direct, "
                  f"router CPU {cpu / routed['requests'] * 1e6:.0f} us/request")  # fmt: skip
        direct_ttft, _ = asyncio.run(_stream_ttft(backend_url, args.streams))
        cpu_before = cpu_seconds(router_pid)
        routed_ttft, frames = asyncio.run(_stream_ttft(router_url, args.streams))
        cpu = cpu_seconds(router_pid) - cpu_before
        print(f"streamed TTFT p50: direct {direct_ttft * 1e6:.0f} us, router "
              f"{routed_ttft * 1e6:.0f} us (added {(routed_ttft - direct_ttft) * 1e6:+.0f} us); "
              f"router CPU {cpu / args.streams * 1e6:.0f} us/stream, "
              f"{cpu / max(1, frames) * 1e6:.1f} us/relayed chunk")  # fmt: skip
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)


if __name__ == "__main__":
    main()
