"""Acceptance of `adaptive` (issue 3), live: max goodput searches through the real router.

The live counterpart of `bench.scripts.acceptance`: for each recorded trace, every variant
gets a max-goodput search (90% good) with `bench compare`'s machinery, each probe a fresh
simulated cluster, router and embedded Redis in real time replaying `--span-s` seconds of the
trace's scaled arrivals (a fixed number of turns replayed ever faster would become one burst
the cluster absorbs whole). Verdicts as in the simulator's acceptance: adaptive's
max goodput against the best baseline's, 1.2x on multi-turn traces and the multi-turn mix,
else 1.0x.

`--classes` adds classes of the simulator acceptance's default workload matrix (generated
sessions; max goodput is then the arrival rate of the highest passing probe).

A live probe runs the workers, router and client on this machine in real time, so only what
the machine can carry is measured here: small clusters, the recorded traces and the matrix's
long-prompt classes (its short-prompt ones stream hundreds of thousands of tokens per second
on 8 GPUs, the simulator's job). `--variants` picks labels (e.g. the split and threshold the
simulator found best) to keep a run within minutes.

    .venv/bin/python -m bench.scripts.live_acceptance --traces azure-conv \\
        --cluster 2xh200-sxm/llama-3.1-8b --span-s 20 --out bench-out/live-acceptance
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec

from bench.compare import CompareSpec, plan, run_policy
from bench.des.goodput import GoodputSearch, goodput_search
from bench.layout import ClusterSpec
from bench.metrics import RunSummary
from bench.scripts.acceptance import default_matrix, ints, names, render, verdict
from bench.scripts.acceptance_workloads import (
    TRACES,
    MatrixSource,
    Measured,
    Offered,
    TraceSource,
    Variant,
    Verdict,
    Workload,
    matrix_workloads,
    needs_of,
    offered_rps,
    variants,
)
from bench.simulate import GOODPUT_TARGET
from bench.traces import load_trace


def spec_of(variant: Variant, cluster: ClusterSpec, tolerance: float) -> CompareSpec:
    """The one-policy live comparison whose probes search `variant`'s max goodput."""
    params = {variant.policy: variant.params} if variant.params else {}
    return CompareSpec(
        policies=(variant.policy,), cluster=cluster, policy_params=params,
        prefill_workers=None if variant.mixed else variant.prefill_workers,
        goodput_tolerance=tolerance,
    )  # fmt: skip


async def search(
    source: TraceSource | MatrixSource, variant: Variant, spec: CompareSpec, start: float,
    out: Path,
) -> Measured:  # fmt: skip
    """`variant`'s live max goodput (0 when no probe passed), each probe a fresh stack
    replaying `source`: a trace's highest passing scale times the whole trace's mean arrival
    rate; a matrix class's arrival rate in its highest passing probe."""
    (stack,) = plan(spec, out)
    searcher = goodput_search(GOODPUT_TARGET, start=start, tolerance=spec.goodput_tolerance)
    probes: list[Offered] = []
    summaries: dict[float, RunSummary] = {}
    scale = next(searcher)
    while True:
        trace = source.at(scale)
        run = await run_policy(trace, msgspec.structs.replace(spec, rate_scale=scale), stack,
                               False, None)  # fmt: skip
        attainment = run.summary.slo_attainment
        rps = trace.num_turns * scale / max(trace.duration_s, 1e-9)
        probes.append(Offered(scale, attainment, trace.num_turns, rps))
        summaries[scale] = run.summary
        print(f"  {variant.label} @ {scale:.4g}x ({trace.num_turns} turns, {rps:.3g}/s): "
              f"{attainment:.1%} good; {'; '.join(run.notes)}", file=sys.stderr,
              flush=True)  # fmt: skip
        try:
            scale = searcher.send(attainment)
        except StopIteration as done:
            found: GoodputSearch = done.value
            break
    best = found.best_scale
    if best is None:
        rps = 0.0
    elif isinstance(source, TraceSource):
        # By scale: every variant replays the same windows, but a window's own arrival rate
        # is no measure when the trace's density varies along it (a short window can be a
        # burst); generated sessions arrive at one steady rate, as in the simulator's search
        whole = source.trace
        rps = best * whole.num_turns / max(whole.duration_s, 1e-9)
    else:
        rps = offered_rps(probes, best)
    return Measured(
        label=variant.label, best_scale=best, failing_scale=found.failing_scale,
        max_goodput_rps=rps,
        probes=probes, best=summaries.get(best) if best is not None else None,
        failing=summaries.get(found.failing_scale) if found.failing_scale is not None else None,
    )  # fmt: skip


def chosen(all_variants: list[Variant], labels: str) -> list[Variant]:
    """The variants named in `labels` (comma-separated; empty: all), adaptive always."""
    wanted = set(names(labels))
    known = {v.label for v in all_variants}
    unknown = wanted - known
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {sorted(known)}")
    return [v for v in all_variants if not wanted or v.label in wanted or v.label == "adaptive"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="adaptive's acceptance figures, live")
    add = parser.add_argument
    add("--traces-dir", type=Path, default=Path("/work/shared/traces"))
    add(
        "--traces",
        default="azure-conv,azure-code",
        help="names: " + ", ".join(n for n, _ in TRACES),
    )
    add("--classes", default="", help="matrix classes (bench.scripts.acceptance's default matrix)")
    add("--cluster", default="4xh200-sxm/llama-3.1-8b")
    add("--span-s", type=float, default=20.0, help="seconds of scaled arrivals a probe replays")
    add("--min-turns", type=int, default=200, help="turns a probe replays at least")
    add("--start", type=float, default=4.0, help="rate scale the searches start at")
    add("--splits", type=ints, default=(1, 2), help="disaggregate prefill workers")
    add("--thresholds", type=ints, default=(256, 1024, 4096))
    add("--variants", default="", help="comma-separated labels to search (default all)")
    add("--tolerance", type=float, default=0.1, help="search bracket ratio")
    add("--out", type=Path, default=Path("bench-out/live-acceptance"))
    return parser


def workloads(args: argparse.Namespace) -> list[Workload]:
    """The traces and matrix classes the options name, in that order."""
    files = dict(TRACES)
    out = []
    for name in names(args.traces):
        if name not in files:
            raise SystemExit(f"unknown trace {name!r}; known: {', '.join(files)}")
        trace = load_trace(args.traces_dir / files[name])
        out.append(Workload(name, TraceSource(trace, args.min_turns, args.span_s), needs_of(trace)))
    classes = {w.name: w for w in matrix_workloads(default_matrix(), args.min_turns, args.span_s)}
    for name in names(args.classes):
        if name not in classes:
            raise SystemExit(f"unknown class {name!r}; known: {', '.join(classes)}")
        out.append(classes[name])
    return out


async def _main(args: argparse.Namespace) -> list[Verdict]:
    cluster = ClusterSpec.parse(args.cluster)
    contenders = chosen(variants(args.splits, args.thresholds, split=False), args.variants)
    verdicts = []
    for workload in workloads(args):
        measured = []
        for variant in contenders:
            started = time.monotonic()
            label = variant.label.replace(" ", "-").replace("=", "")
            spec = spec_of(variant, cluster, args.tolerance)
            found = await search(workload.source, variant, spec, args.start,
                                 args.out / workload.name / label)  # fmt: skip
            measured.append(found)
            print(f"{workload.name} / {variant.label}: {found.max_goodput_rps:.3g} req/s "
                  f"({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip
        verdicts.append(verdict(workload, measured))
    return verdicts


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    started = time.monotonic()
    verdicts = asyncio.run(_main(args))
    command = "python -m bench.scripts.live_acceptance " + " ".join(argv or sys.argv[1:])
    notes = [
        f"Live: simulated workers ({args.cluster}), the router and the replay client in real "
        f"time on this machine; each probe a fresh stack replaying {args.span_s:g} s of the "
        f"trace's scaled arrivals (at least {args.min_turns} turns), as the simulator's "
        "acceptance does; adaptive and colocate on mixed workers, the splitting baselines on "
        "K prefill + the rest decode workers.",
        f"Search tolerance {args.tolerance:g}. {time.monotonic() - started:.0f} s wall clock.",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    encoded = msgspec.json.format(msgspec.json.encode(verdicts))
    (args.out / "live-acceptance.json").write_bytes(encoded)
    (args.out / "live-acceptance.md").write_text(text := render(verdicts, command, notes), "utf-8")
    print(text)
    return 0 if all(v.passed for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
