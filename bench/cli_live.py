"""Command-line wiring of the live bench: `bench replay`, `bench compare`, `up` and `demo`.

Ctrl-C (or SIGTERM) during `replay`, `compare` or `demo` stops sending new requests, cancels
those in flight and still writes what was measured; a second Ctrl-C abandons the run.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.results.summary import Objectives

if TYPE_CHECKING:
    from bench.stack.up import RealEngines
    from bench.traces.model import Trace
    from policies.types import Role

_SUB = "session-router"


def _objectives(args: argparse.Namespace) -> Objectives:
    """--slo-ttft-ms makes the TTFT objective a fixed number (no per-token allowance)."""
    base = Objectives()
    if args.slo_ttft_ms is not None:
        base = Objectives(ttft_base_ms=args.slo_ttft_ms, ttft_per_prompt_token_ms=0.0,
                          itl_ms=base.itl_ms)  # fmt: skip
    if args.slo_itl_ms is not None:
        base = Objectives(base.ttft_base_ms, base.ttft_per_prompt_token_ms, args.slo_itl_ms)
    return base


def _load(path: str, command: str) -> Trace:
    from bench.traces.model import load_trace

    try:
        return load_trace(path)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{_SUB} bench {command}: cannot load {path}: {exc}") from exc


def _run(main: Callable[[asyncio.Event], Awaitable[int]]) -> int:
    """Run `main(stop)` on uvloop; the first SIGINT/SIGTERM sets `stop`, a second cancels."""
    import uvloop

    async def wrapper() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None

        def on_signal() -> None:
            if stop.is_set():
                task.cancel()
                return
            stop.set()
            print("\nstopping: no new requests; writing what was measured (Ctrl-C again to "
                  "abandon)", file=sys.stderr, flush=True)  # fmt: skip

        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, on_signal)
        try:
            return await main(stop)
        except asyncio.CancelledError:
            return 130
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)

    return uvloop.run(wrapper())


def _add_slo_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--slo-ttft-ms", type=float, default=None, metavar="MS",
                        help="TTFT objective (default 1000 ms + 0.2 ms/prompt token)")  # fmt: skip
    parser.add_argument("--slo-itl-ms", type=float, default=None, metavar="MS",
                        help="objective for the p99 of a request's inter-token gaps "
                             "(default 100 ms)")  # fmt: skip
    parser.add_argument("--api", choices=["chat", "completions"], default="chat")
    parser.add_argument("--no-progress", action="store_true", help="no live progress bar")


# -- bench replay -----------------------------------------------------------------------------
async def _replay_main(args: argparse.Namespace, stop: asyncio.Event) -> int:
    import aiohttp
    import msgspec
    from rich.console import Console

    from bench.compare import comparison_table
    from bench.replay.run import (
        fetch_stage_events,
        join_stage_events,
        read_stage_events,
        replay,
        run_duration_s,
    )
    from bench.replay.stream import LagProbe
    from bench.results.outputs import REPORT_MD, write_run_outputs
    from bench.results.summary import Summary, summarise
    from router.obs.events import StageEvents

    trace = _load(args.trace, "replay")
    objectives = _objectives(args)
    probe = LagProbe()
    events: list[StageEvents] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        probe.start()
        try:
            results = await replay(
                trace,
                args.target,
                rate_scale=args.rate_scale,
                limit=args.limit,
                objectives=objectives,
                api=args.api,
                policy_label=args.label,
                model=args.model,
                progress=not args.no_progress,
                session=session,
                stop=stop,
                request_timeout_s=args.request_timeout_s,
                api_key=args.api_key,
            )
        finally:
            await probe.stop()
        if args.router_events:
            events = read_stage_events(args.router_events)
        elif args.admin_token:
            events = await fetch_stage_events(session, args.target, args.admin_token, len(results))
    joined, matched, convention = join_stage_events(results, events)
    label = args.label or next((e.policy for e in events if e.policy), "") or "live"
    joined = [msgspec.structs.replace(r, policy=label) for r in joined]
    run = summarise(
        joined,
        label,
        args.rate_scale,
        run_duration_s(joined),
        convention or args.first_token,
        objectives=objectives,
    )
    notes = [
        f"trace {trace.name!r}: {len(results)} requests sent to {args.target} at rate scale "
        f"{args.rate_scale:g} through the {args.api} API",
        f"router stage events joined for {matched} of {len(results)} requests",
        f"client event-loop lag p99 {probe.quantile_ms(0.99):.2f} ms",
    ]
    if stop.is_set():
        notes.append(
            "stopped early by a signal: requests in flight were cancelled and count as errors"
        )
    out = Path(args.out)
    summary = Summary([run])
    write_run_outputs(out, summary, joined, f"bench replay: {trace.name}", notes)
    console = Console()
    console.print(comparison_table(summary, "bench replay"))
    console.print(f"report: {out / REPORT_MD}")
    return 130 if stop.is_set() else 0


def _replay_command(args: argparse.Namespace) -> int:
    return _run(lambda stop: _replay_main(args, stop))


# -- bench compare ----------------------------------------------------------------------------
def _params_by_policy(assignments: list[str]) -> dict[str, dict[str, str]]:
    from policies import parse_param_assignments

    grouped: dict[str, list[str]] = {}
    for assignment in assignments:
        policy, sep, rest = assignment.partition(":")
        if not sep or not policy or "=" not in rest:
            raise ValueError(f"--policy-param needs POLICY:KEY=VALUE, got {assignment!r}")
        grouped.setdefault(policy, []).append(rest)
    return {policy: parse_param_assignments(items) for policy, items in grouped.items()}


async def _compare_main(args: argparse.Namespace, stop: asyncio.Event) -> int:
    from rich.console import Console

    from bench.compare import CompareSpec, compare, comparison_table, plan
    from bench.results.outputs import REPORT_MD
    from bench.stack.layout import ClusterSpec

    try:
        real = _real_engines(args) if args.engine == "vllm" else None
        cluster = ClusterSpec.parse(args.cluster)
        if real is not None and args.cluster == DEFAULT_COMPARE_CLUSTER:
            cluster = ClusterSpec(3, "cpu", "tiny-llama")
        spec = CompareSpec(
            policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
            cluster=cluster,
            real=real,
            prefill_workers=args.prefill_workers,
            rate_scale=args.rate_scale,
            limit=args.limit,
            first_token=args.first_token,
            objectives=_objectives(args),
            api=args.api,
            policy_params=_params_by_policy(args.policy_param),
            seed=args.seed,
            find_max_goodput=args.find_max_goodput,
            goodput_tolerance=args.goodput_tolerance,
        )
        out = Path(args.out)
        plan(spec, out)  # every name and parameter checked before anything starts
    except ValueError as exc:
        raise SystemExit(f"{_SUB} bench compare: {exc}") from exc
    trace = _load(args.trace, "compare")
    summary = await compare(trace, spec, out, progress=not args.no_progress, stop=stop)
    console = Console()
    console.print(comparison_table(summary))
    console.print(f"report: {out / REPORT_MD}")
    return 130 if stop.is_set() else 0


def _compare_command(args: argparse.Namespace) -> int:
    return _run(lambda stop: _compare_main(args, stop))


# -- up and demo ------------------------------------------------------------------------------
DEFAULT_COMPARE_CLUSTER = "4xh200-sxm/llama-3.1-8b"


def _real_engines(args: argparse.Namespace) -> RealEngines:
    """Real vLLM engines from `--model` (a folder; default the tiny model) and `--vllm-venv`,
    both checked before anything starts."""
    from bench.stack.up import RealEngines
    from bench.vllm.install import DEFAULT_CACHE, DEFAULT_VENV

    model_dir = Path(args.model or DEFAULT_CACHE / "tiny-llama-seed0").resolve()
    if not (model_dir / "config.json").exists():
        raise ValueError(f"no model at {model_dir} (`make real-engines` builds one)")
    venv = Path(args.vllm_venv or DEFAULT_VENV)
    if not (venv / "bin" / "vllm").exists():
        raise ValueError(f"no vLLM in {venv}: run `make real-engines`")
    return RealEngines(model_dir=str(model_dir), venv=str(venv), work_dir=args.engine_dir,
                       num_gpu_blocks=args.num_gpu_blocks,
                       max_num_seqs=args.max_num_seqs)  # fmt: skip


def _up_roles(args: argparse.Namespace, policy: str) -> list[Role]:
    """`--prefill/--decode/--mixed` as given, else the bench's layout for the policy."""
    from bench.compare import roles_for

    counts = (args.prefill, args.decode, args.mixed)
    if any(count is not None for count in counts):
        prefill, decode, mixed = (count or 0 for count in counts)
        if min(prefill, decode, mixed) < 0 or prefill + decode + mixed < 1:
            raise ValueError("--prefill, --decode and --mixed must add up to at least 1 worker")
        if (prefill == 0) != (decode == 0) and mixed == 0:
            raise ValueError("a split fleet needs both --prefill and --decode workers")
        roles: list[Role] = ["prefill"] * prefill
        return roles + ["decode"] * decode + ["mixed"] * mixed
    workers = args.workers if args.workers is not None else (2 if args.engine == "vllm" else 4)
    return roles_for(policy, workers, args.prefill_workers)


def _up_command(args: argparse.Namespace) -> int:
    import uvloop

    from bench.stack.layout import ClusterSpec
    from bench.stack.up import StackSpec, policy_params, run_up
    from policies import available_policies, parse_param_assignments

    policy = args.policy or ("adaptive" if "adaptive" in available_policies() else "colocate")
    try:
        roles = _up_roles(args, policy)
        real = None
        if args.engine == "vllm":
            real = _real_engines(args)
            cluster = ClusterSpec(len(roles), args.gpu or "cpu", "tiny-llama", args.tp)
        else:
            cluster = ClusterSpec(len(roles), args.gpu or "h200-sxm",
                                  args.model or "llama-3.1-8b", args.tp)  # fmt: skip
        params = policy_params(policy, parse_param_assignments(args.policy_param), cluster)
        spec = StackSpec(
            cluster=cluster,
            roles=tuple(roles),
            policy=policy,
            policy_params=tuple(sorted(params.items())),
            host=args.host,
            port=args.port,
            worker_base_port=args.worker_base_port,
            first_token=args.first_token,
            admin_token=args.admin_token,
            events=args.events,
            seed=args.seed,
            scheduling_policy=args.scheduling_policy,
            engine=args.engine,
            real=real,
            log_dir=args.engine_dir if real is not None else None,
        )
    except ValueError as exc:
        raise SystemExit(f"{_SUB} up: {exc}") from exc
    return uvloop.run(run_up(spec))


def _demo_command(args: argparse.Namespace) -> int:
    from bench.demo import run_demo

    if not args.rate_scale > 0:
        raise SystemExit(f"{_SUB} demo: --rate-scale must be > 0")
    return _run(
        lambda stop: run_demo(
            Path(args.out), args.rate_scale, not args.no_progress, stop, live=not args.simulated
        )
    )


def register_bench(bench: Any) -> None:
    replay = bench.add_parser(
        "replay", help="replay a trace against a live OpenAI-compatible endpoint",
        description="Replay a trace (any supported format) against a router or worker and "
                    "write summary.json, requests.jsonl and a report.",
    )  # fmt: skip
    add = replay.add_argument
    add("trace", help="trace file (native, Mooncake, Azure, BurstGPT, ShareGPT)")
    add("--target", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    add("--limit", type=int, default=None, help="replay only the first N turns")
    add("--rate-scale", type=float, default=1.0, help="arrival rate multiplier (2: twice as fast)")
    _add_slo_options(replay)
    add("--out", default="bench-out/replay", help="output directory")
    add("--admin-token", default=None, help="join stage events from GET /admin/decisions")
    add("--router-events", default=None, metavar="FILE",
        help="join stage events from the router's --events file")  # fmt: skip
    add("--label", default="", help="run name (default: the router's policy, else 'live')")
    add("--model", default=None, help="the request's model field")
    add("--first-token", choices=["decode", "prefill"], default="decode",
        help="convention to report when no router events are joined")  # fmt: skip
    add("--api-key", default=None, help="sent as a bearer token")
    add("--request-timeout-s", type=float, default=600.0)
    replay.set_defaults(run=_replay_command)

    compare = bench.add_parser(
        "compare", help="compare placement policies live on a local simulated cluster",
        description="For each policy: a fresh simulated cluster and router, the same trace; "
                    "one report for all runs.",
    )  # fmt: skip
    add = compare.add_argument
    add("trace", help="trace file (any supported format)")
    add("--policies", default="colocate,disaggregate,threshold,adaptive",
        help="comma-separated policy names")  # fmt: skip
    add(
        "--cluster",
        default=DEFAULT_COMPARE_CLUSTER,
        metavar="NxGPU/MODEL",
        help="simulated cluster (default %(default)s; with --engine vllm: 3xcpu/tiny-llama)",
    )
    _add_engine_options(compare)
    add("--prefill-workers", type=int, default=None, metavar="K",
        help="prefill workers for split policies (default: a quarter, at least 1)")  # fmt: skip
    add("--rate-scale", type=float, default=1.0,
        help="arrival rate multiplier (--find-max-goodput: where its search starts)")  # fmt: skip
    add("--find-max-goodput", action="store_true",
        help="search each policy's highest rate with >= 90%% good (fresh stacks)")  # fmt: skip
    add("--goodput-tolerance", type=float, default=0.1,
        help="stop the search when the bracket is narrower than this ratio")  # fmt: skip
    add("--limit", type=int, default=None, help="replay only the first N turns")
    add("--first-token", choices=["decode", "prefill"], default="decode")
    add("--policy-param", action="append", default=[], metavar="POLICY:KEY=VALUE")
    add("--seed", type=int, default=0, help="simulated workers' seed")
    add("--out", default="bench-out/compare", help="output directory")
    _add_slo_options(compare)
    compare.set_defaults(run=_compare_command)


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--engine", choices=["sim", "vllm"], default="sim",
        help="simulated workers or real vLLM engines (default: %(default)s)")  # fmt: skip
    add("--model", default=None,
        help="simulated: a model preset (default llama-3.1-8b); real: the model folder "
             "(default: the tiny model `make real-engines` builds)")  # fmt: skip
    add("--vllm-venv", default=None, help="real engines' virtualenv (default: .venv-vllm)")
    add("--engine-dir", default="bench-out/engines",
        help="real engines' caches and logs (default: %(default)s)")  # fmt: skip
    add(
        "--num-gpu-blocks",
        type=int,
        default=None,
        help="real engines: KV blocks per engine (vLLM's --num-gpu-blocks-override)",
    )
    add("--max-num-seqs", type=int, default=None, help="real engines: running sequences cap")


def register_top(subparsers: Any) -> None:
    up = subparsers.add_parser(
        "up", help="run workers (simulated, or real vLLM engines) and a router until Ctrl-C",
        description="A local cluster and a router with embedded Redis: simulated workers "
                    "(--engine sim), or real vLLM engines with NIXL handoffs between them "
                    "(--engine vllm, after `make real-engines`).",
    )  # fmt: skip
    add = up.add_argument
    _add_engine_options(up)
    add("--prefill", type=int, default=None, metavar="N", help="prefill workers")
    add("--decode", type=int, default=None, metavar="N", help="decode workers")
    add("--mixed", type=int, default=None, metavar="N", help="mixed (whole-turn) workers")
    add("--workers", type=int, default=None,
        help="without --prefill/--decode/--mixed: this many, laid out for the policy "
             "(default: 4 simulated, 2 real)")  # fmt: skip
    add(
        "--prefill-workers",
        type=int,
        default=None,
        metavar="K",
        help="with --workers, prefill workers when the policy splits (default: a quarter)",
    )
    add("--policy", default=None, help="default: adaptive if available, else colocate")
    add("--policy-param", action="append", default=[], metavar="KEY=VALUE")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000, help="router port (default: %(default)s)")
    add("--worker-base-port", type=int, default=None, help="default: a free block")
    add("--gpu", default=None,
        help="hardware preset for the simulator and the policy's priors "
             "(default: h200-sxm simulated, cpu real)")  # fmt: skip
    add("--tp", type=int, default=1)
    add("--scheduling-policy", choices=["fcfs", "priority"], default="priority",
        help="the workers' scheduling policy (default: %(default)s)")  # fmt: skip
    add("--first-token", choices=["decode", "prefill"], default="decode")
    add("--admin-token", default=None, help="default: a random token, printed")
    add("--events", default=None, metavar="FILE", help="the router's stage events file")
    add("--seed", type=int, default=0)
    up.set_defaults(run=_up_command)

    demo = subparsers.add_parser(
        "demo", help="colocation, the best fixed split and adaptive on a load that changes "
                     "(`make demo`)",
    )  # fmt: skip
    add = demo.add_argument
    add("--out", default="bench-out/demo", help="output directory")
    add(
        "--rate-scale",
        type=float,
        default=1.0,
        help="multiplies the demo trace's arrival rate (default 1: fixed placements break)",
    )
    add("--simulated", action="store_true",
        help="run the three in the discrete-event simulator (under a minute) instead of live "
             "against simulated workers and a router (about three and a half minutes on two "
             "otherwise idle cores)")  # fmt: skip
    add("--no-progress", action="store_true")
    demo.set_defaults(run=_demo_command)
