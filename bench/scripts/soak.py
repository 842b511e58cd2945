"""Soak: steady multi-turn streaming load through the router for a given time, with the
router's resident memory and open file descriptors sampled every `--sample-s` seconds.

Starts simulated workers and a router (`session-router up`'s stack), keeps `--sessions`
conversations streaming (each `--turns` turns, then a new session takes its place), and
writes a report: the samples, the first-to-last growth after a warm-up, requests by outcome.
Flat RSS and fds over a long run show every cache is bounded; every new session adds to the
per-session caches until they reach their bounds (the local view's `session_cache_size`,
100,000 sessions, and session TTL; adaptive's per-session tables, `MAX_TRACKED_REQUESTS`), so
`--session-pool N` keeps the population of sessions steady, as returning users do.

    python -m bench.scripts.soak --minutes 30 --out bench-out/soak
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from bench.stack.layout import ClusterSpec, worker_roles
from bench.stack.up import LocalStack, StackSpec, policy_params


@dataclass
class Sample:
    at_s: float
    rss_kib: int
    open_fds: int
    requests: int


@dataclass
class Soak:
    samples: list[Sample] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)

    @property
    def requests(self) -> int:
        return sum(self.outcomes.values())


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _conversation(
    http: aiohttp.ClientSession, url: str, model: str, turns: int, soak: Soak,
    ids: itertools.count[int], population: int,
) -> None:  # fmt: skip
    """Sessions one after another, each `turns` streamed turns carrying the earlier answers;
    with a `population`, session ids come back (users who return and start over)."""
    while True:
        n = next(ids)
        session = f"soak-{n % population if population else n}"
        messages: list[dict[str, str]] = [{"role": "system", "content": "You are terse. " * 20}]
        for turn in range(turns):
            messages.append({"role": "user", "content": f"question {turn} " * 30})
            body = {"model": model, "messages": messages, "stream": True, "max_tokens": 32}
            answer = []
            try:
                async with http.post(f"{url}/v1/chat/completions", json=body,
                                     headers={"X-Session-Id": session}) as response:  # fmt: skip
                    async for line in response.content:
                        if line.startswith(b"data: {"):
                            answer.append(line)
                    outcome = str(response.status)
            except (TimeoutError, aiohttp.ClientError) as exc:
                outcome = type(exc).__name__
            soak.outcomes[outcome] += 1
            messages.append({"role": "assistant", "content": f"answer of {len(answer)} frames"})


async def soak(
    minutes: float, sessions: int, turns: int, sample_s: float, population: int = 0
) -> Soak:
    cluster = ClusterSpec(4, "h200-sxm", "llama-3.1-8b")
    params = policy_params("adaptive", {}, cluster)
    spec = StackSpec(cluster, tuple(worker_roles("adaptive", 4, 1)), "adaptive",
                     tuple(params.items()), log_dir=tempfile.mkdtemp(prefix="soak-"))  # fmt: skip
    result = Soak()
    async with LocalStack(spec) as stack:
        pid = stack.router_pid
        assert pid is not None
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            ids = itertools.count()
            clients = [asyncio.create_task(_conversation(http, stack.url, stack.model, turns,
                                                         result, ids, population))
                       for _ in range(sessions)]  # fmt: skip
            started = time.monotonic()
            try:
                while (elapsed := time.monotonic() - started) < minutes * 60:
                    result.samples.append(Sample(round(elapsed, 1), rss_kib(pid), open_fds(pid),
                                                 result.requests))  # fmt: skip
                    await asyncio.sleep(min(sample_s, max(0.0, minutes * 60 - elapsed)))
                result.samples.append(Sample(round(time.monotonic() - started, 1), rss_kib(pid),
                                             open_fds(pid), result.requests))  # fmt: skip
            finally:
                for client in clients:
                    client.cancel()
                await asyncio.gather(*clients, return_exceptions=True)
    return result


def report(result: Soak, warmup_s: float) -> str:
    steady = [s for s in result.samples if s.at_s >= warmup_s] or result.samples
    first, last = steady[0], steady[-1]
    rate = (last.requests - first.requests) / max(1e-9, last.at_s - first.at_s)
    lines = [
        "# Soak",
        "",
        f"{result.requests} requests; outcomes: {dict(sorted(result.outcomes.items()))}",
        f"after {warmup_s:.0f} s of warm-up, from {first.at_s:.0f} s to {last.at_s:.0f} s "
        f"({rate:.1f} requests/s): RSS {first.rss_kib} -> {last.rss_kib} KiB "
        f"({last.rss_kib - first.rss_kib:+d} KiB, max {max(s.rss_kib for s in steady)}), "
        f"open fds {first.open_fds} -> {last.open_fds} (max {max(s.open_fds for s in steady)})",
        "",
        "| t (s) | RSS (KiB) | open fds | requests |",
        "|---:|---:|---:|---:|",
    ]
    lines += [f"| {s.at_s:.0f} | {s.rss_kib} | {s.open_fds} | {s.requests} |"
              for s in result.samples]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--sessions", type=int, default=16, help="conversations at once")
    parser.add_argument("--turns", type=int, default=6, help="turns per conversation")
    parser.add_argument(
        "--session-pool",
        type=int,
        default=0,
        help="distinct session ids, reused in turn (0: every session new)",
    )
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=Path("bench-out/soak"))
    args = parser.parse_args(argv)
    result = asyncio.run(
        soak(args.minutes, args.sessions, args.turns, args.sample_s, args.session_pool)
    )
    args.out.mkdir(parents=True, exist_ok=True)
    text = report(result, args.warmup_s)
    (args.out / "report.md").write_text(text)
    samples = [asdict(s) for s in result.samples]
    data = {"samples": samples, "outcomes": result.outcomes}
    (args.out / "samples.json").write_text(json.dumps(data, indent=1))
    print(text)
    return 0 if set(result.outcomes) <= {"200"} else 1


if __name__ == "__main__":
    sys.exit(main())
