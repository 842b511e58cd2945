"""How fast the discrete-event simulator replays a whole trace, in requests per CPU second.

Loads the trace (timed apart), simulates it once for one policy and prints requests and events
per CPU second of the simulation, how many engine steps ran (and how many of them without an
event of their own: mostly those fast-forwarded as `sim.engine.decode_run.DecodeRun`s), and how much
of the CPU time the engine itself took (`Engine.begin_step` + `finish_step`, `DecodeRun.plan`
+ `advance`, timed around each call, so that share is slightly overstated). With
`--profile FILE` the run is profiled with cProfile and the top functions by own time are
printed. With `--workers 64,256,512` it reports per fleet size instead: the cluster grown to
that many workers and the trace replicated to fill it (one copy per `--cluster`'s worth of
workers, each with its own sessions and prefix blocks, arriving together). Run:

    .venv/bin/python -m bench.scripts.des_speed \\
        --trace ../shared/traces/mooncake_synthetic_trace.jsonl --policy colocate
    .venv/bin/python -m bench.scripts.des_speed --policy adaptive --workers 64,256,512
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from bench.des import SimConfig, SimResult, simulate
from bench.stack.layout import ClusterSpec, worker_roles
from bench.traces.model import Conversation, Trace, load_trace
from policies import create_policy
from sim.engine.decode_run import DecodeRun
from sim.engine.engine import Engine

# the shared traces lie beside the checkout
DEFAULT_TRACE = str(
    Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
)


class EngineTimer:
    """Adds up the CPU time spent inside the engine's step calls and its decode runs'."""

    _TIMED = ((Engine, "begin_step"), (Engine, "finish_step"), (DecodeRun, "plan"),
              (DecodeRun, "advance"))  # fmt: skip

    def __init__(self) -> None:
        self.seconds = 0.0
        self._saved: list[tuple[type, str, Any]] = []

    def __enter__(self) -> EngineTimer:
        clock = time.process_time

        def timed(call: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any) -> Any:
                started = clock()
                try:
                    return call(*args)
                finally:
                    self.seconds += clock() - started

            return wrapper

        for owner, name in self._TIMED:
            # the class attribute as defined (a classmethod stays one), restored on exit
            self._saved.append((owner, name, owner.__dict__[name]))
            setattr(owner, name, timed(getattr(owner, name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, attribute in self._saved:
            setattr(owner, name, attribute)


def replicated(trace: Trace, copies: int) -> Trace:
    """`copies` of `trace` arriving together, each with its own sessions and prefix blocks."""
    if copies <= 1:
        return trace
    blocks = 1 + max((b for c in trace.conversations for t in c.turns for b in t.prefix_blocks),
                     default=0)  # fmt: skip
    conversations: list[Conversation] = []
    for copy in range(copies):
        for conversation in trace.conversations:
            turns = tuple(
                msgspec.structs.replace(t, prefix_blocks=tuple(b + copy * blocks
                                                               for b in t.prefix_blocks))
                for t in conversation.turns
            )  # fmt: skip
            session = f"{conversation.session_id}~{copy}"
            conversations.append(msgspec.structs.replace(conversation, session_id=session,
                                                         turns=turns))  # fmt: skip
    name = f"{trace.name} x{copies}"
    return msgspec.structs.replace(trace, name=name, conversations=tuple(conversations))


def run(trace: Trace, policy: str, config: SimConfig, rate_scale: float) -> SimResult:
    return simulate(trace, create_policy(policy), config, rate_scale, policy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=DEFAULT_TRACE)
    parser.add_argument("--policy", default="colocate")
    parser.add_argument("--cluster", default="8xh200-sxm/llama-3.1-8b")
    parser.add_argument("--rate-scale", type=float, default=1.0)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--noise", type=float, default=0.02, help="engine step-time noise")
    parser.add_argument("--engine-share", action="store_true",
                        help="also time the engine share (a second run)")  # fmt: skip
    parser.add_argument("--profile", metavar="FILE", help="cProfile the run into FILE")
    parser.add_argument("--workers", help="fleet sizes (e.g. 64,256,512): a report for each")
    args = parser.parse_args()
    if args.workers:
        per_size(args)
        return

    started = time.process_time()
    trace = load_trace(args.trace)
    if args.limit is not None:
        trace = trace.slice(args.limit)
    load_s = time.process_time() - started
    cluster = ClusterSpec.parse(args.cluster)
    roles = tuple(worker_roles(args.policy, cluster.workers))
    config = SimConfig(cluster=cluster, roles=roles, noise_sigma=args.noise)

    wall = time.perf_counter()
    if args.profile:
        profiler = cProfile.Profile()
        result = profiler.runcall(run, trace, args.policy, config, args.rate_scale)
        profiler.dump_stats(args.profile)
        pstats.Stats(args.profile).sort_stats("tottime").print_stats(20)
    else:
        result = run(trace, args.policy, config, args.rate_scale)
    wall = time.perf_counter() - wall
    stats = result.stats
    report: dict[str, object] = {
        "trace": trace.name,
        "policy": args.policy,
        "cluster": str(cluster),
        "rate_scale": args.rate_scale,
        "requests": len(result.results),
        "events": stats.events,
        "engine_steps": stats.steps,
        "steps_without_heap": stats.inline_steps,
        "virtual_s": round(stats.virtual_s, 3),
        "trace_load_cpu_s": round(load_s, 3),
        "cpu_s": round(stats.cpu_s, 3),
        "wall_s": round(wall, 3),
        "requests_per_cpu_s": round(len(result.results) / stats.cpu_s, 1),
        "events_per_cpu_s": round(stats.events / stats.cpu_s),
        "profiled": bool(args.profile),
    }
    if args.engine_share:
        with EngineTimer() as timer:
            again = run(trace, args.policy, config, args.rate_scale)
        report["engine_cpu_s"] = round(timer.seconds, 3)
        report["engine_share_of_cpu"] = round(timer.seconds / again.stats.cpu_s, 3)
    print(msgspec.json.encode(report).decode())


def per_size(args: argparse.Namespace) -> None:
    """One line per fleet size: the cluster grown to it, the trace replicated to fill it."""
    trace = load_trace(args.trace)
    base = ClusterSpec.parse(args.cluster)
    for size in (int(n) for n in args.workers.split(",")):
        cluster = ClusterSpec(size, base.gpu, base.model, base.tp)
        scaled = replicated(trace, max(1, size // base.workers))
        if args.limit is not None:
            scaled = scaled.slice(args.limit)
        roles = tuple(worker_roles(args.policy, cluster.workers))
        config = SimConfig(cluster=cluster, roles=roles, noise_sigma=args.noise)
        result = run(scaled, args.policy, config, args.rate_scale)
        stats = result.stats
        print(msgspec.json.encode({
            "policy": args.policy, "cluster": str(cluster), "trace": scaled.name,
            "requests": len(result.results), "cpu_s": round(stats.cpu_s, 3),
            "requests_per_cpu_s": round(len(result.results) / stats.cpu_s, 1),
            "events_per_cpu_s": round(stats.events / stats.cpu_s),
        }).decode(), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
