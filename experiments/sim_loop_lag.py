"""How far one `sim-cluster` process's event loop lags its engines' step schedule.

Starts `session-router sim-cluster` (4 workers by default) as a subprocess, drives N concurrent
streaming requests per worker from this process, then reads each worker's schedule-lag sample
(GET /sim/schedule-lag) and prints p50/p99/max. Run:

    .venv/bin/python -m experiments.sim_loop_lag --workers 4 --streams 64 --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import aiohttp

from bench.stack.up import free_port_block


async def _stream_forever(session: aiohttp.ClientSession, url: str, stop: float, seq: int) -> int:
    done = 0
    while time.monotonic() < stop:
        body = {"prompt": f"stream {seq} turn {done} " + "word " * 500, "max_tokens": 256,
                "stream": True, "ignore_eos": True}  # fmt: skip
        async with session.post(url + "/v1/completions", json=body) as response:
            async for _ in response.content:
                pass
        done += 1
    return done


async def _wait_healthy(session: aiohttp.ClientSession, urls: list[str]) -> None:
    deadline = time.monotonic() + 30
    for url in urls:
        while True:
            try:
                async with session.get(url + "/health") as response:
                    if response.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not come up")
            await asyncio.sleep(0.05)


async def run(urls: list[str], streams: int, seconds: float) -> None:
    workers = len(urls)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await _wait_healthy(session, urls)
        for url in urls:
            async with session.get(url + "/sim/schedule-lag?reset=1") as response:
                await response.read()
        stop = time.monotonic() + seconds
        counts = await asyncio.gather(
            *(_stream_forever(session, url, stop, i) for url in urls for i in range(streams))
        )
        print(f"{workers} workers x {streams} streams for {seconds:.0f} s: "
              f"{sum(counts)} requests completed")  # fmt: skip
        for url in urls:
            async with session.get(url + "/sim/schedule-lag") as response:
                lag = await response.json()
            p50, p99, top = (lag[k] * 1e3 for k in ("p50_s", "p99_s", "max_s"))
            print(f"{url}: steps={lag['count']} schedule lag p50={p50:.3f} ms "
                  f"p99={p99:.3f} ms max={top:.3f} ms")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    base = free_port_block("127.0.0.1", args.workers)
    proc = subprocess.Popen(
        [sys.executable, "-m", "session_router_cli", "sim-cluster", "--base-port", str(base),
         "--workers", str(args.workers)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    urls = [f"http://127.0.0.1:{base + i}" for i in range(args.workers)]
    try:
        asyncio.run(run(urls, args.streams, args.seconds))
    finally:
        proc.terminate()
        proc.wait(timeout=10)


if __name__ == "__main__":
    main()
