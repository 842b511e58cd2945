"""Does the discrete-event simulator agree with a live replay? Same trace, cluster and policy.

For each policy: the live side is exactly `bench compare`'s run (`bench.compare.run_policy`: a
fresh `session-router sim-cluster` and `session-router serve` with embedded Redis as
subprocesses, the live replay, the router's stage events joined); the simulated side is
`bench simulate`'s run (`bench.simulate.run_one`) on the same slice, layout, seed and
objectives. Agreement: TTFT p50/p99 and ITL p50/p99 within 10% of live, rejected counts
within 2. With `--live-runs 2` the live side runs twice and the second live run is compared
with the first by the same rule: the live replay's own run-to-run spread, the best agreement
one can expect. Writes the runs' outputs (one report, runs labelled `live:`, `live2:` and
`des:`) and agreement.json into --out; exits 1 when the simulation disagrees. Run:

    .venv/bin/python -m experiments.des_vs_live --limit 200 --policies colocate,disaggregate
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec

from bench.compare import CompareSpec, plan, run_policy
from bench.des import SimConfig
from bench.results.outputs import write_run_outputs
from bench.results.summary import RequestResult, RunSummary, Summary
from bench.simulate import plan_runs, run_one
from bench.stack.layout import ClusterSpec, worker_roles
from bench.stack.up import run_stopping_on_sigterm
from bench.traces.model import Trace, load_trace

# the shared traces lie beside the checkout
DEFAULT_TRACE = str(
    Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
)
LATENCY_TOLERANCE = 0.10
REJECTED_TOLERANCE = 2


class Metric(msgspec.Struct, frozen=True):
    name: str
    live: float | None
    other: float | None  # the simulation's value (or the second live run's)
    relative_error: float | None
    ok: bool


class Agreement(msgspec.Struct, frozen=True):
    policy: str
    compared: str  # "des" or "live2": what was compared with the first live run
    metrics: list[Metric]
    live_rejected: int
    other_rejected: int
    ok: bool


def agreement(policy: str, compared: str, live: RunSummary, other: RunSummary) -> Agreement:
    pairs = {
        "ttft_p50_ms": (live.ttft_ms.p50, other.ttft_ms.p50),
        "ttft_p99_ms": (live.ttft_ms.p99, other.ttft_ms.p99),
        "itl_p50_ms": (live.itl_ms.p50, other.itl_ms.p50),
        "itl_p99_ms": (live.itl_ms.p99, other.itl_ms.p99),
    }
    metrics = []
    for name, (a, b) in pairs.items():
        error = abs(b - a) / a if a is not None and b is not None and a > 0 else None
        metrics.append(Metric(name, a, b, error, error is not None and error <= LATENCY_TOLERANCE))
    rejected_ok = abs(live.rejected - other.rejected) <= REJECTED_TOLERANCE
    ok = rejected_ok and all(m.ok for m in metrics)
    return Agreement(policy, compared, metrics, live.rejected, other.rejected, ok)


def note(verdict: Agreement) -> str:
    other = verdict.compared
    metrics = ", ".join(f"{m.name} live {m.live} {other} {m.other}" for m in verdict.metrics)
    return (
        f"{other} vs live, {verdict.policy}: {'agrees' if verdict.ok else 'DISAGREES'}; "
        f"{metrics}; rejected live {verdict.live_rejected} {other} {verdict.other_rejected}"
    )


def relabel(
    summary: RunSummary, results: Sequence[RequestResult], label: str
) -> tuple[RunSummary, list[RequestResult]]:
    return msgspec.structs.replace(summary, policy=label), [
        msgspec.structs.replace(r, policy=label) for r in results
    ]


async def live_run(
    trace: Trace, policy: str, args: argparse.Namespace, out: Path
) -> tuple[RunSummary, list[RequestResult]]:
    spec = CompareSpec(
        policies=(policy,), cluster=ClusterSpec.parse(args.cluster),
        prefill_workers=args.prefill_workers, rate_scale=args.rate_scale, limit=args.limit,
        first_token=args.first_token, seed=args.seed,
    )  # fmt: skip
    [stack] = plan(spec, out)
    run = await run_policy(trace, spec, stack, progress=not args.no_progress, stop=None)
    return run.summary, run.results


def des_run(
    trace: Trace, policy: str, args: argparse.Namespace
) -> tuple[RunSummary, list[RequestResult]]:
    cluster = ClusterSpec.parse(args.cluster)
    template = SimConfig(cluster=cluster, roles=tuple(worker_roles("colocate", cluster.workers)),
                         first_token=args.first_token, seed=args.seed)  # fmt: skip
    [run] = plan_runs([policy], template, args.prefill_workers)
    sliced = trace.slice(args.limit) if args.limit is not None else trace
    outcome = run_one(sliced, run, args.rate_scale)
    if outcome.failure is not None:
        raise RuntimeError(outcome.failure.describe())
    return outcome.summary, outcome.results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=DEFAULT_TRACE)
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--policies", default="colocate,disaggregate")
    parser.add_argument("--cluster", default="4xh200-sxm/llama-3.1-8b")
    parser.add_argument("--prefill-workers", type=int, default=None)
    parser.add_argument("--rate-scale", type=float, default=1.0)
    parser.add_argument("--first-token", choices=["decode", "prefill"], default="decode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-out/des-vs-live")
    parser.add_argument("--live-runs", type=int, choices=[1, 2], default=1)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    trace = load_trace(args.trace)
    runs: list[RunSummary] = []
    results: list[RequestResult] = []
    verdicts: list[Agreement] = []
    for policy in (p.strip() for p in args.policies.split(",") if p.strip()):
        try:
            sides = [
                ("live", *run_stopping_on_sigterm(live_run(trace, policy, args, out / "live")))
            ]
            if args.live_runs == 2:
                second = run_stopping_on_sigterm(live_run(trace, policy, args, out / "live2"))
                sides.append(("live2", *second))
        except (asyncio.CancelledError, KeyboardInterrupt):
            print("stopped", file=sys.stderr)
            return 130
        sides.append(("des", *des_run(trace, policy, args)))
        live = sides[0][1]
        verdicts += [agreement(policy, side, live, summary) for side, summary, _ in sides[1:]]
        for side, summary, kept in sides:
            labelled, labelled_results = relabel(summary, kept, f"{side}:{policy}")
            runs.append(labelled)
            results += labelled_results
    notes = [note(verdict) for verdict in verdicts]
    write_run_outputs(out, Summary(runs), results, f"DES vs live: {trace.name}", notes)
    (out / "agreement.json").write_bytes(msgspec.json.format(msgspec.json.encode(verdicts)))
    for verdict in verdicts:
        verdict_text = "agrees" if verdict.ok else "DISAGREES"
        print(f"{verdict.compared} vs live, {verdict.policy}: {verdict_text}", file=sys.stderr)
        for m in verdict.metrics:
            error = "-" if m.relative_error is None else f"{m.relative_error:.1%}"
            print(f"  {m.name:12s} live {m.live} {verdict.compared} {m.other} ({error})",
                  file=sys.stderr)  # fmt: skip
        print(f"  rejected     live {verdict.live_rejected} {verdict.compared} "
              f"{verdict.other_rejected}", file=sys.stderr)  # fmt: skip
    return 0 if all(v.ok for v in verdicts if v.compared == "des") else 1


if __name__ == "__main__":
    sys.exit(main())
