"""`session-router bench simulate`: compare policies on a whole trace in simulated time.

Exit status 0 when every run finished, 1 when a policy failed (the failure is printed and in
failures.json; the other runs are still written), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

_SUB = "session-router bench simulate"


def _scales(text: str) -> list[float]:
    try:
        scales = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"rate scales must be numbers, got {text!r}") from None
    if not scales or any(not s > 0 for s in scales) or len(set(scales)) != len(scales):
        raise argparse.ArgumentTypeError(f"rate scales must be distinct and > 0, got {text!r}")
    return sorted(scales)


def params_by_policy(assignments: list[str]) -> dict[str, dict[str, str]]:
    """`POLICY:KEY=VALUE` strings by policy (POLICY may itself be a `module:attr` spec)."""
    from policies import parse_param_assignments

    grouped: dict[str, list[str]] = {}
    for assignment in assignments:
        head, sep, value = assignment.partition("=")
        policy, colon, key = head.rpartition(":")
        if not sep or not colon or not policy or not key:
            raise ValueError(f"--policy-param needs POLICY:KEY=VALUE, got {assignment!r}")
        grouped.setdefault(policy, []).append(f"{key}={value}")
    return {policy: parse_param_assignments(items) for policy, items in grouped.items()}


def _template(args: argparse.Namespace) -> Any:
    from bench.des import SimConfig
    from bench.results.summary import Objectives
    from bench.stack.layout import ClusterSpec, worker_roles

    objectives = Objectives()
    if args.slo_ttft_ms is not None:
        objectives = Objectives(args.slo_ttft_ms, 0.0, objectives.itl_ms)
    if args.slo_itl_ms is not None:
        objectives = Objectives(objectives.ttft_base_ms, objectives.ttft_per_prompt_token_ms,
                                args.slo_itl_ms)  # fmt: skip
    cluster = ClusterSpec.parse(args.cluster, args.tp)
    mixed = tuple(worker_roles("colocate", cluster.workers))  # plan_runs sets each policy's
    return SimConfig(
        cluster=cluster, roles=mixed, nic_gbps=args.nic_gbps,
        spine_gbps=args.spine_gbps, scrape_interval_s=args.scrape_interval_ms / 1000,
        router_overhead_s=args.router_overhead_ms / 1000, first_token=args.first_token,
        seed=args.seed, noise_sigma=args.noise, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        chunked_prefill=args.chunked_prefill, objectives=objectives,
    )  # fmt: skip


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from bench.results.outputs import REPORT_MD
    from bench.simulate import RunOutcome, plan_runs, run_simulation, write_outputs
    from bench.traces.model import load_trace
    from policies import PolicyConfigError

    try:
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        template = _template(args)
        runs = plan_runs(policies, template, args.prefill_workers,
                         params_by_policy(args.policy_param))  # fmt: skip
        if args.jobs is not None and args.jobs < 1:
            raise ValueError("--jobs must be >= 1")
        if args.limit is not None and args.limit < 1:
            raise ValueError("--limit must be >= 1")
        trace = load_trace(args.trace)
        if args.limit is not None:
            trace = trace.slice(args.limit)
    except (ValueError, PolicyConfigError, OSError) as exc:
        print(f"{_SUB}: {exc}", file=sys.stderr)
        return 2
    scales = args.rate_scale or [1.0]
    total = len(runs) * (1 if args.find_max_goodput else len(scales))
    console = Console(stderr=True)
    progress = Progress(
        TextColumn("simulate"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.description}"), console=console, disable=args.no_progress,
    )  # fmt: skip
    task = progress.add_task("", total=total)

    def on_run(outcome: RunOutcome, submitted: int) -> None:
        run = outcome.summary
        text = f"{run.policy} @ {run.rate_scale:.4g}x: {run.slo_attainment:.1%} good"
        progress.update(task, advance=1, total=max(submitted, total), description=text)

    with progress:
        try:
            simulation = run_simulation(
                trace, runs, scales, args.find_max_goodput, args.jobs, args.goodput_tolerance,
                on_run, args.keep_all_requests,
            )  # fmt: skip
        except ValueError as exc:
            print(f"{_SUB}: {exc}", file=sys.stderr)
            return 2
    out = Path(args.out)
    write_outputs(out, trace, runs, simulation)
    _print_table(simulation)
    for failure in simulation.failures:
        print(f"{_SUB}: {failure.describe()}\n{failure.traceback}", file=sys.stderr)
    print(f"report: {out / REPORT_MD}")
    return 1 if simulation.failures else 0


def _print_table(simulation: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("policy", "rate", "requests", "rejected", "errors", "good", "goodput/s",
                  "TTFT p50", "TTFT p99", "ITL p99", "max goodput/s")  # fmt: skip

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    for run in simulation.summary.runs:
        table.add_row(
            run.policy, f"{run.rate_scale:.4g}x", str(run.requests), str(run.rejected),
            str(run.errors), f"{run.slo_attainment:.1%}", f"{run.goodput_rps:.2f}",
            ms(run.ttft_ms.p50), ms(run.ttft_ms.p99), ms(run.itl_ms.p99),
            "-" if run.max_goodput_rps is None else f"{run.max_goodput_rps:.2f}",
        )  # fmt: skip
    # piped output gets the whole table rather than the 80 columns rich assumes
    Console(width=None if sys.stdout.isatty() else 160).print(table)


def register_bench(bench: Any) -> None:
    parser = bench.add_parser(
        "simulate", help="compare placement policies on a whole trace in simulated time",
        description="Replay a trace through a discrete-event simulation of the cluster: the "
                    "simulated workers' engine, the same policies, the live router's "
                    "semantics; the same summary.json, requests.jsonl and report.",
    )  # fmt: skip
    add = parser.add_argument
    add("trace", help="trace file (native, Mooncake, Azure, BurstGPT, ShareGPT)")
    add("--policies", default="colocate,disaggregate,threshold,adaptive",
        help="comma-separated policy names")  # fmt: skip
    add("--cluster", default="8xh200-sxm/llama-3.1-8b", metavar="NxGPU/MODEL")
    add("--tp", type=int, default=1, help="tensor-parallel degree of each worker")
    add("--prefill-workers", type=int, default=None, metavar="K",
        help="prefill workers for split policies (default: a quarter, at least 1)")  # fmt: skip
    add("--nic-gbps", type=float, default=400.0, help="NIC bandwidth per worker, Gb/s")
    add("--spine-gbps", type=float, default=None, help="a spine all transfers share, Gb/s")
    rates = parser.add_mutually_exclusive_group()
    rates.add_argument("--rate-scale", type=_scales, default=None, metavar="S[,S...]",
                       help="arrival rate multipliers to sweep (default 1)")  # fmt: skip
    rates.add_argument("--find-max-goodput", action="store_true",
                       help="search each policy's highest rate with >= 90%% good")  # fmt: skip
    add("--keep-all-requests", action="store_true",
        help="with --find-max-goodput, keep every probe's per-request records (default: "
             "each search's final bracket only; summary.json has every probe)")  # fmt: skip
    add("--goodput-tolerance", type=float, default=0.05,
        help="stop the search when the bracket is narrower than this ratio")  # fmt: skip
    add("--slo-ttft-ms", type=float, default=None, metavar="MS",
        help="TTFT objective (default 1000 ms + 0.2 ms per prompt token)")  # fmt: skip
    add("--slo-itl-ms", type=float, default=None, metavar="MS",
        help="objective for the p99 of a request's inter-token gaps (default 100 ms)")  # fmt: skip
    add("--limit", type=int, default=None, metavar="N", help="only the first N turns")
    add("--policy-param", action="append", default=[], metavar="POLICY:KEY=VALUE")
    add("--seed", type=int, default=0, help="simulated workers' seed")
    add("--jobs", type=int, default=None, help=f"processes (default {os.cpu_count()})")
    add("--out", default="bench-out/simulate", help="output directory")
    add("--first-token", choices=["decode", "prefill"], default="decode")
    add("--scrape-interval-ms", type=float, default=250.0)
    add("--router-overhead-ms", type=float, default=1.0, help="router time per leg sent")
    add("--noise", type=float, default=0.02, help="engine step-time noise sigma")
    add("--chunked-prefill", type=int, default=None, metavar="N")
    add("--max-num-seqs", type=int, default=256)
    add("--max-num-batched-tokens", type=int, default=8192)
    add("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=_run)
