"""Redis cost per turn: commands and server CPU, with one router replica and with several.

Starts a Redis server of its own (TCP, nothing persisted), simulated workers, and each
`--replicas` count of routers sharing that Redis, replays the first `--limit` turns of a trace
(its sessions dealt round-robin to the replicas) and reads Redis's INFO commandstats and INFO
cpu before and after. An idle window first (routers up, no turns) measures what the routers
cost Redis without turns (load scrapes, heartbeats), which is taken out of the per-turn
figures. From the CPU per turn comes the rate one Redis primary carries: its main thread is one
core.

    python -m bench.scripts.redis_cost --trace ../shared/traces/mooncake_synthetic_trace.jsonl \\
        --limit 300 --replicas 1 4 --out bench-out/redis-cost
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import redis.asyncio as aioredis

from bench.replay.run import replay
from bench.results.summary import Objectives
from bench.stack.layout import ClusterSpec, worker_roles
from bench.stack.redis_cluster import LocalCluster, free_ports
from bench.stack.up import free_port_block
from bench.traces.model import Trace, load_trace
from router.state.embedded_redis import redis_server_binary
from sim.engine.presets import deployment_from_names

_CLI = (sys.executable, "-m", "session_router_cli")


class Window(msgspec.Struct, frozen=True):
    """Redis's counters over one window: calls and microseconds per command, CPU seconds."""

    seconds: float
    calls: dict[str, int]
    usec: dict[str, int]
    cpu_s: float  # used_cpu_user + used_cpu_sys of the whole server
    cpu_main_s: float  # the main thread's (used_cpu_*_main_thread), where reported


def merged(windows: Sequence[Window]) -> Window:
    """Several servers' windows (a cluster's primaries) as one: counts and CPU added."""
    calls: Counter[str] = Counter()
    usec: Counter[str] = Counter()
    for window in windows:
        calls.update(window.calls)
        usec.update(window.usec)
    return Window(
        seconds=max(w.seconds for w in windows), calls=dict(calls), usec=dict(usec),
        cpu_s=sum(w.cpu_s for w in windows), cpu_main_s=sum(w.cpu_main_s for w in windows),
    )  # fmt: skip


def marginal(load: Window, idle: Window, turns: int) -> float:
    """Main-thread CPU seconds per turn over the idle rate (never below zero)."""
    scale = load.seconds / idle.seconds if idle.seconds > 0 else 0.0
    return max(0.0, load.cpu_main_s - scale * idle.cpu_main_s) / max(1, turns)


class Run(msgspec.Struct, frozen=True):
    replicas: int
    turns_ok: int
    turns_sent: int
    statuses: dict[str, int]
    idle: list[Window]  # one per server: a standalone Redis, or each cluster primary
    load: list[Window]

    def per_turn(self) -> dict[str, Any]:
        """Each command's calls and microseconds per turn, and the CPU per turn, with the idle
        rate taken out (never below zero); per server, and where the first one saturates."""
        idle, load = merged(self.idle), merged(self.load)
        scale = load.seconds / idle.seconds if idle.seconds > 0 else 0.0
        turns = max(1, self.turns_ok)
        commands = {}
        for name in sorted(set(load.calls) | set(idle.calls)):
            calls = load.calls.get(name, 0) - scale * idle.calls.get(name, 0)
            usec = load.usec.get(name, 0) - scale * idle.usec.get(name, 0)
            commands[name] = {"calls": max(0.0, calls) / turns, "usec": max(0.0, usec) / turns}
        pairs = zip(self.load, self.idle, strict=True)
        per_server = [marginal(busy, quiet, turns) for busy, quiet in pairs]
        busiest = max(per_server)
        return {
            "replicas": self.replicas,
            "servers": len(self.load),
            "turns": self.turns_ok,
            "commands_per_turn": sum(c["calls"] for c in commands.values()),
            "command_usec_per_turn": sum(c["usec"] for c in commands.values()),
            "main_thread_cpu_ms_per_turn": marginal(load, idle, turns) * 1e3,
            "server_cpu_ms_per_turn": [cpu * 1e3 for cpu in per_server],
            "idle_commands_per_s": sum(idle.calls.values()) / max(idle.seconds, 1e-9),
            "idle_cpu_ratio": idle.cpu_main_s / max(idle.seconds, 1e-9),
            # one core per server: its main thread runs every command; the busiest saturates
            "turns_per_s_at_saturation": 1.0 / busiest if busiest > 0 else None,
            "by_command": commands,
        }


async def read_window_start(client: aioredis.Redis) -> tuple[float, dict[str, Any]]:
    await client.config_resetstat()
    return time.monotonic(), await client.info("cpu")


async def read_window_end(
    client: aioredis.Redis, started: float, cpu_before: dict[str, Any]
) -> Window:
    stats = await client.info("commandstats")
    cpu = await client.info("cpu")
    calls: dict[str, int] = {}
    usec: dict[str, int] = {}
    for key, value in stats.items():
        name = key.removeprefix("cmdstat_")
        calls[name] = int(value["calls"])
        usec[name] = int(value["usec"])

    def delta(*names: str) -> float:
        return sum(float(cpu.get(n, 0.0)) - float(cpu_before.get(n, 0.0)) for n in names)

    return Window(
        seconds=time.monotonic() - started,
        calls=calls,
        usec=usec,
        cpu_s=delta("used_cpu_user", "used_cpu_sys"),
        cpu_main_s=delta("used_cpu_user_main_thread", "used_cpu_sys_main_thread")
        or delta("used_cpu_user", "used_cpu_sys"),
    )


def deal(trace: Trace, parts: int) -> list[Trace]:
    """The trace's sessions dealt round-robin into `parts` traces (arrivals kept)."""
    return [
        msgspec.structs.replace(trace, conversations=trace.conversations[i::parts])
        for i in range(parts)
    ]


class Children:
    """Child processes started here, all stopped on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.processes: list[asyncio.subprocess.Process] = []

    async def start(self, name: str, args: Sequence[str]) -> asyncio.subprocess.Process:
        log = (self.log_dir / f"{name}.log").open("ab")
        process = await asyncio.create_subprocess_exec(
            *args, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        log.close()
        self.processes.append(process)
        return process

    async def stop(self) -> None:
        for process in reversed(self.processes):
            if process.returncode is None:
                process.terminate()
        for process in self.processes:
            try:
                await asyncio.wait_for(process.wait(), 15)
            except TimeoutError:
                process.kill()
                await process.wait()
        self.processes.clear()


async def wait_ready(http: aiohttp.ClientSession, urls: Sequence[str], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    for url in urls:
        while True:
            try:
                async with http.get(url) as response:
                    if response.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not ready within {within_s} s")
            await asyncio.sleep(0.1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def measure(args: argparse.Namespace, replicas: int, trace: Trace, log_dir: Path) -> Run:
    children = Children(log_dir)
    cluster = ClusterSpec.parse(args.cluster)
    roles = worker_roles(args.policy, cluster.workers)
    kv_bytes = deployment_from_names(cluster.gpu, cluster.model, cluster.tp).kv_bytes_per_token
    redis_ports = free_ports(max(1, args.cluster_primaries))
    base = free_port_block("127.0.0.1", cluster.workers)
    worker_urls = [f"http://127.0.0.1:{base + i}" for i in range(cluster.workers)]
    ports = [free_port() for _ in range(replicas)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    servers = [aioredis.Redis(host="127.0.0.1", port=port) for port in redis_ports]
    local_cluster: LocalCluster | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="redis-cost-") as data:
            if args.cluster_primaries:
                local_cluster = LocalCluster(args.redis_server, redis_ports, Path(data))
                await asyncio.to_thread(local_cluster.start)
                redis_url = local_cluster.url
            else:
                await children.start("redis", [
                    args.redis_server, "--port", str(redis_ports[0]), "--bind", "127.0.0.1",
                    "--save", "", "--appendonly", "no", "--dir", data,
                ])  # fmt: skip
                redis_url = f"redis://127.0.0.1:{redis_ports[0]}/0"
            await children.start("workers", [
                *_CLI, "sim-cluster", "--base-port", str(base), "--workers",
                str(cluster.workers), "--gpu", cluster.gpu, "--model", cluster.model,
                "--tp", str(cluster.tp), "--seed", "0",
            ])  # fmt: skip
            prefix = f"cost-{uuid.uuid4().hex[:8]}"
            for index, port in enumerate(ports):
                serve = [*_CLI, "serve", "--port", str(port), "--redis", redis_url,
                         "--redis-prefix", prefix, "--policy", args.policy,
                         "--kv-bytes-per-token", str(kv_bytes)]  # fmt: skip
                for role, url in zip(roles, worker_urls, strict=True):
                    serve += [f"--{role}", url]
                await children.start(f"router-{index}", serve)
            async with aiohttp.ClientSession() as http:
                await wait_ready(http, [f"{u}/health" for u in worker_urls], 60)
                await wait_ready(http, [f"{u}/ready" for u in urls], 60)
            await asyncio.sleep(2.0)  # first scrapes and model lists settle
            marks = [await read_window_start(server) for server in servers]
            await asyncio.sleep(args.idle_s)
            idle = [await read_window_end(s, *m) for s, m in zip(servers, marks, strict=True)]
            objectives = Objectives()  # the bench's defaults: Redis's cost does not depend on them
            marks = [await read_window_start(server) for server in servers]
            parts = deal(trace, replicas)
            results = await asyncio.gather(*(
                replay(part, url, objectives=objectives, policy_label=args.policy)
                for part, url in zip(parts, urls, strict=True)
            ))  # fmt: skip
            await asyncio.sleep(1.0)  # the last commits are written after the answers
            load = [await read_window_end(s, *m) for s, m in zip(servers, marks, strict=True)]
    finally:
        for server in servers:
            await server.aclose()
        await children.stop()
        if local_cluster is not None:
            await asyncio.to_thread(local_cluster.stop)
    flat = [r for part in results for r in part]
    ok = sum(1 for r in flat if r.status == "completed")
    statuses = Counter(str(r.status) for r in flat)
    return Run(replicas=replicas, turns_ok=ok, turns_sent=len(flat), statuses=dict(statuses),
               idle=idle, load=load)  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| replicas | servers | turns | commands/turn | Redis CPU ms/turn (per server) "
        "| idle commands/s | turns/s at saturation |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        rate = row["turns_per_s_at_saturation"]
        servers = " + ".join(f"{cpu:.3f}" for cpu in row["server_cpu_ms_per_turn"])
        lines.append(
            f"| {row['replicas']} | {row['servers']} | {row['turns']} "
            f"| {row['commands_per_turn']:.1f} | {row['main_thread_cpu_ms_per_turn']:.3f}"
            f"{f' ({servers})' if row['servers'] > 1 else ''} "
            f"| {row['idle_commands_per_s']:.0f} | {'-' if rate is None else f'{rate:,.0f}'} |"
        )
    top = max(rows, key=lambda r: r["commands_per_turn"])
    lines += [
        "",
        f"commands per turn ({top['replicas']} replicas; those run inside Lua "
        "scripts are counted as well as the EVALSHA):",
        "",
    ]
    for name, cost in sorted(top["by_command"].items(), key=lambda kv: -kv[1]["calls"]):
        if cost["calls"] >= 0.01:
            lines.append(f"- `{name}`: {cost['calls']:.2f} calls, {cost['usec']:.1f} us")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--trace", required=True, help="trace file (any format bench reads)")
    parser.add_argument("--limit", type=int, default=300, help="turns replayed (default 300)")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 4],
                        help="router replica counts to measure (default 1 4)")  # fmt: skip
    parser.add_argument("--cluster", default="4xh200-sxm/llama-3.1-8b",
                        help="simulated workers (default 4xh200-sxm/llama-3.1-8b)")  # fmt: skip
    parser.add_argument("--policy", default="adaptive", help="placement policy (default adaptive)")
    parser.add_argument("--rate-scale", type=float, default=1.0,
                        help="arrivals sped up by this factor (default 1)")  # fmt: skip
    parser.add_argument("--idle-s", type=float, default=10.0,
                        help="idle window first, per replica count (default 10)")  # fmt: skip
    parser.add_argument("--redis-server", default=shutil.which("redis-server") or "",
                        help="the server to measure (default redis-server on PATH, else the "
                        "embedded Valkey)")  # fmt: skip
    parser.add_argument("--cluster-primaries", type=int, default=0,
                        help="a local Redis Cluster of this many primaries instead of one "
                        "Redis (default 0: one Redis)")  # fmt: skip
    parser.add_argument("--out", default="bench-out/redis-cost", help="output directory")
    args = parser.parse_args(argv)
    if args.cluster_primaries < 0:
        parser.error("--cluster-primaries must be >= 0")
    if not args.redis_server:
        args.redis_server = redis_server_binary()
    return args


async def main_async(args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    trace = load_trace(args.trace).slice(args.limit)
    if args.rate_scale != 1.0:
        trace = trace.scaled(args.rate_scale)
    rows = []
    for replicas in args.replicas:
        run = await measure(args, replicas, trace, out)
        rows.append(run.per_turn())
        (out / f"run-{replicas}.json").write_bytes(msgspec.json.encode(run))
        print(f"{replicas} replica(s): {run.turns_ok}/{run.turns_sent} turns completed "
              f"{run.statuses}", flush=True)  # fmt: skip
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = asyncio.run(main_async(args, out))
    version = os.path.basename(args.redis_server)
    report = table(rows)
    (out / "summary.json").write_text(json.dumps({"server": version, "rows": rows}, indent=2))
    (out / "report.md").write_text(report + "\n")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
