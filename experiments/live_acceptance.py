"""Acceptance of `adaptive` (issue 3), live: max goodput searches through the real router.

The live counterpart of `experiments.acceptance`: for each recorded trace, every variant
gets a max-goodput search (90% good) with `bench compare`'s machinery, each probe a fresh
simulated cluster, router and embedded Redis in real time replaying `--span-s` seconds of the
trace's scaled arrivals (a fixed number of turns replayed ever faster would become one burst
the cluster absorbs whole). Verdicts as in the simulator's acceptance: adaptive's
max goodput against the best baseline's, 1.2x on multi-turn traces and the multi-turn mix,
else 1.0x.

`--classes` adds classes of the simulator acceptance's default workload matrix (generated
sessions; max goodput is then the arrival rate of the highest passing probe). `--at` probes
each variant at the given rate scales instead of searching, with why each request that was
not good missed: for looking into a verdict (e.g. with `--scheduling-policy fcfs`, engines
that ignore the deadlines adaptive sends).

A live probe runs the workers, router and client on this machine in real time, so only what
the machine can carry is measured here: small clusters, the recorded traces and the matrix's
long-prompt classes (its short-prompt ones stream hundreds of thousands of tokens per second
on 8 GPUs, the simulator's job). `--variants` picks labels (e.g. the split and threshold the
simulator found best) to keep a run within minutes; `--screen` instead searches adaptive first
and probes each baseline once, at adaptive's max goodput over the workload's needs, searching
only the baselines that pass there (a baseline that fails there is beaten by construction).

    .venv/bin/python -m experiments.live_acceptance --traces azure-conv \\
        --cluster 2xh200-sxm/llama-3.1-8b --span-s 20 --out bench-out/live-acceptance
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path

import msgspec

from bench.compare import CompareSpec, plan, run_policy
from bench.des.goodput import GoodputSearch, goodput_search
from bench.results.summary import MissCauses, RunSummary
from bench.simulate import GOODPUT_TARGET
from bench.stack.layout import ClusterSpec
from bench.stack.up import StackSpec, run_stopping_on_sigterm
from bench.traces.model import load_trace
from experiments.acceptance import default_matrix, ints, names, reused
from experiments.acceptance_grid import variants
from experiments.acceptance_verdicts import render, rps_text, verdict
from experiments.acceptance_workloads import (
    TRACES,
    Measured,
    Offered,
    Source,
    TraceSource,
    Variant,
    Verdict,
    Workload,
    matrix_workloads,
    needs_of,
    nonstationary_workloads,
    offered_rps,
)


def spec_of(variant: Variant, cluster: ClusterSpec, tolerance: float) -> CompareSpec:
    """The one-policy live comparison whose probes search `variant`'s max goodput."""
    params = {variant.policy: variant.params} if variant.params else {}
    return CompareSpec(
        policies=(variant.policy,), cluster=cluster, policy_params=params,
        prefill_workers=None if variant.mixed else variant.prefill_workers,
        goodput_tolerance=tolerance,
    )  # fmt: skip


class Probe(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One fixed-rate probe of `--at`: attainment, why the rest missed, TTFT p90."""

    workload: str
    variant: str
    rate_scale: float
    turns: int
    rps: float
    attainment: float
    misses: MissCauses
    ttft_p90_ms: float | None


def stack_of(spec: CompareSpec, out: Path, scheduling: str) -> StackSpec:
    """The one stack a variant's probes start, its engines scheduling as `scheduling` says."""
    if scheduling not in ("priority", "fcfs"):
        raise ValueError(f"scheduling must be priority or fcfs, got {scheduling!r}")
    (stack,) = plan(spec, out)
    return msgspec.structs.replace(stack, scheduling_policy=scheduling)


async def _run_at(
    source: Source, label: str, spec: CompareSpec, stack: StackSpec,
    scale: float,
) -> tuple[RunSummary, int, float]:  # fmt: skip
    """One probe, a fresh stack replaying `source` at `scale`: its summary, turns and
    arrival rate (turns over their scaled span); told on stderr."""
    trace = source.at(scale)
    run = await run_policy(trace, msgspec.structs.replace(spec, rate_scale=scale), stack,
                           False, None)  # fmt: skip
    rps = trace.num_turns * scale / max(trace.duration_s, 1e-9)
    print(f"  {label} @ {scale:.4g}x ({trace.num_turns} turns, {rps:.3g}/s): "
          f"{run.summary.slo_attainment:.1%} good; {'; '.join(run.notes)}", file=sys.stderr,
          flush=True)  # fmt: skip
    return run.summary, trace.num_turns, rps


async def probe_at(
    workload: Workload, variant: Variant, spec: CompareSpec, scales: Sequence[float],
    stack: StackSpec,
) -> list[Probe]:  # fmt: skip
    """`variant` replaying `workload` at each of `scales`, a fresh stack each."""
    probes = []
    for scale in scales:
        summary, turns, rps = await _run_at(workload.source, variant.label, spec, stack, scale)
        probes.append(Probe(workload.name, variant.label, scale, turns, rps,
                            summary.slo_attainment, summary.misses or MissCauses(),
                            summary.ttft_ms.p90))  # fmt: skip
    return probes


def render_probes(probes: Sequence[Probe], command: str) -> str:
    lines = [
        "# Live probes at fixed rates", "", f"Command: `{command}`", "",
        "| workload | variant | rate | turns | arrivals/s | good | TTFT late (foreseen) "
        "| ITL p99 over | rejected | failed | TTFT p90 ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for p in probes:
        m = p.misses
        lines.append(
            f"| {p.workload} | {p.variant} | {p.rate_scale:.4g}x | {p.turns} | {p.rps:.3g} "
            f"| {p.attainment:.1%} | {m.ttft_late} ({m.ttft_late_foreseen}) | {m.itl_over} "
            f"| {m.rejected} | {m.failed} | "
            f"{'-' if p.ttft_p90_ms is None else f'{p.ttft_p90_ms:.0f}'} |"
        )
    return "\n".join(lines) + "\n"


Run = Callable[[Source, str, CompareSpec, StackSpec, float],
              Awaitable[tuple[RunSummary, int, float]]]  # fmt: skip


async def screen(
    source: Source, variant: Variant, spec: CompareSpec, stack: StackSpec,
    adaptive: Measured, needs: float, run: Run = _run_at,
) -> Measured | None:  # fmt: skip
    """One probe of a baseline at adaptive's highest passing scale over `needs`: where it
    fails there, its screened `Measured` (adaptive beats it by construction); None where it
    passes (it needs a search) or adaptive passed nowhere."""
    if adaptive.best_scale is None:
        return None
    scale = adaptive.best_scale / needs
    summary, turns, rps = await run(source, variant.label, spec, stack, scale)
    if summary.slo_attainment >= GOODPUT_TARGET:
        return None
    probes = [Offered(scale, summary.slo_attainment, turns, rps)]
    return Measured(
        label=variant.label, best_scale=None, failing_scale=scale,
        max_goodput_rps=_rps_at(source, probes, scale), probes=probes, best=None,
        failing=summary, screened=True,
    )  # fmt: skip


def _rps_at(source: Source, probes: list[Offered], scale: float) -> float:
    """A probe scale's arrival rate: a trace's by scale (every variant replays the same windows,
    but a window's own rate is no measure when the trace's density varies along it: a short
    window can be a burst); a matrix class's, its probe's (generated sessions arrive at one
    steady rate, as in the simulator's search)."""
    if isinstance(source, TraceSource):
        whole = source.trace
        return scale * whole.num_turns / max(whole.duration_s, 1e-9)
    return offered_rps(probes, scale)


async def search(
    source: Source, variant: Variant, spec: CompareSpec, start: float,
    stack: StackSpec,
) -> Measured:  # fmt: skip
    """`variant`'s live max goodput (0 when no probe passed), each probe a fresh stack
    replaying `source`: a trace's highest passing scale times the whole trace's mean arrival
    rate; a matrix class's arrival rate in its highest passing probe."""
    searcher = goodput_search(GOODPUT_TARGET, start=start, tolerance=spec.goodput_tolerance)
    probes: list[Offered] = []
    summaries: dict[float, RunSummary] = {}
    scale = next(searcher)
    while True:
        summary, turns, rps = await _run_at(source, variant.label, spec, stack, scale)
        attainment = summary.slo_attainment
        probes.append(Offered(scale, attainment, turns, rps))
        summaries[scale] = summary
        try:
            scale = searcher.send(attainment)
        except StopIteration as done:
            found: GoodputSearch = done.value
            break
    best = found.best_scale
    rps = 0.0 if best is None else _rps_at(source, probes, best)
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
    add("--classes", default="", help="matrix classes (experiments.acceptance's default matrix)")
    add(
        "--nonstationary",
        default="",
        help="non-stationary workloads: mix-shift, ramp-shift, returning-burst, stitched",
    )
    add("--phased-rate", type=float, default=1.0,
        help="the non-stationary workloads' sessions/s at scale 1")  # fmt: skip
    add("--cluster", default="4xh200-sxm/llama-3.1-8b")
    add("--span-s", type=float, default=20.0, help="seconds of scaled arrivals a probe replays")
    add("--min-turns", type=int, default=200, help="turns a probe replays at least")
    add("--start", type=float, default=4.0, help="rate scale the searches start at")
    add("--splits", type=ints, default=(1, 2), help="disaggregate prefill workers")
    # not the matrix prompt sizes themselves: the router estimates a prompt's tokens from its
    # text, so a threshold equal to a class's size splits that class's turns at random
    add("--thresholds", type=ints, default=(256, 1024, 2048, 8192))
    add("--variants", default="", help="comma-separated labels to search (default all)")
    add("--tolerance", type=float, default=0.1, help="search bracket ratio")
    add("--at", type=floats, default=(), help="probe these rate scales instead of searching")
    add("--screen", action="store_true",
        help="search adaptive first, then probe each baseline once at adaptive's max goodput "
        "(over the workload's needs) and search only those that pass there")  # fmt: skip
    add("--scheduling-policy", choices=("priority", "fcfs"), default="priority",
        help="the engines' (priority: they admit by the deadlines adaptive sends)")  # fmt: skip
    add("--reuse", type=Path, metavar="JSON",
        help="take the searches and screens an earlier live-acceptance.json holds")  # fmt: skip
    add("--out", type=Path, default=Path("bench-out/live-acceptance"))
    return parser


def workloads(args: argparse.Namespace) -> list[Workload]:
    """The traces, matrix classes and non-stationary workloads the options name, in that
    order."""
    files = dict(TRACES)
    out = []
    for name in names(args.traces):
        if name not in files:
            raise SystemExit(f"unknown trace {name!r}; known: {', '.join(files)}")
        trace = load_trace(args.traces_dir / files[name])
        out.append(
            Workload(name, TraceSource(trace, args.min_turns, args.span_s), needs_of(trace, name))
        )
    classes = {w.name: w for w in matrix_workloads(default_matrix(), args.min_turns, args.span_s)}
    out += _named("class", classes, args.classes)
    if names(args.nonstationary):  # the stitched one reads every trace
        built = nonstationary_workloads(args.traces_dir, args.min_turns, args.span_s,
                                        args.phased_rate)  # fmt: skip
        out += _named("non-stationary workload", {w.name: w for w in built}, args.nonstationary)
    return out


def _named(kind: str, known: dict[str, Workload], text: str) -> list[Workload]:
    """The workloads of `known` that `text` names (comma-separated), in its order."""
    wanted = names(text)
    for name in wanted:
        if name not in known:
            raise SystemExit(f"unknown {kind} {name!r}; known: {', '.join(known)}")
    return [known[name] for name in wanted]


def floats(text: str) -> tuple[float, ...]:
    return tuple(float(part) for part in names(text))


def _stacks(
    args: argparse.Namespace,
) -> Iterator[tuple[Workload, Variant, CompareSpec, StackSpec]]:
    """Each workload the options name, with each chosen variant's spec and stack."""
    cluster = ClusterSpec.parse(args.cluster)
    # a split keeps a decode worker: K = 1 .. workers - 1 (the default 1, 2 on 2 workers is 1)
    splits = [k for k in args.splits if 0 < k < cluster.workers]
    contenders = chosen(variants(splits, args.thresholds), args.variants)
    if args.screen:  # the baselines are screened against adaptive's search
        contenders.sort(key=lambda v: v.label != "adaptive")
    for workload in workloads(args):
        for variant in contenders:
            spec = spec_of(variant, cluster, args.tolerance)
            out = args.out / workload.name / variant.label.replace(" ", "-").replace("=", "")
            yield workload, variant, spec, stack_of(spec, out, args.scheduling_policy)


async def _probes(args: argparse.Namespace) -> list[Probe]:
    probes = []
    for workload, variant, spec, stack in _stacks(args):
        probes += await probe_at(workload, variant, spec, args.at, stack)
    return probes


def _verdicts(measured: dict[str, tuple[Workload, list[Measured]]]) -> list[Verdict]:
    """The verdicts of the workloads with adaptive and at least one baseline measured."""
    return [
        verdict(workload, found)
        for workload, found in measured.values()
        if any(m.label == "adaptive" for m in found) and any(m.label != "adaptive" for m in found)
    ]


async def _main(
    args: argparse.Namespace, known: dict[str, dict[str, Measured]],
    checkpoint: Callable[[list[Verdict]], object],
) -> list[Verdict]:  # fmt: skip
    """Every variant's search (or screen) of every workload; `checkpoint` gets the verdicts so
    far after each, so a run stopped midway keeps what it measured (see `--reuse`)."""
    measured: dict[str, tuple[Workload, list[Measured]]] = {}
    for workload, variant, spec, stack in _stacks(args):
        started = time.monotonic()
        so_far = measured.setdefault(workload.name, (workload, []))[1]
        adaptive = next((m for m in so_far if m.label == "adaptive"), None)
        found = known.get(workload.name, {}).get(variant.label)
        if found is not None:
            so_far.append(found)
            print(f"{workload.name} / {variant.label}: {rps_text(found)} req/s (reused)",
                  file=sys.stderr, flush=True)  # fmt: skip
            continue
        if args.screen and adaptive is not None:
            found = await screen(workload.source, variant, spec, stack, adaptive, workload.needs)
        if found is None:
            start = args.start
            if args.screen and adaptive is not None and adaptive.best_scale is not None:
                start = adaptive.best_scale / workload.needs  # it passed there: search up
            found = await search(workload.source, variant, spec, start, stack)
        so_far.append(found)
        print(f"{workload.name} / {variant.label}: {rps_text(found)} req/s "
              f"({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip
        checkpoint(_verdicts(measured))
    return _verdicts(measured)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    started = time.monotonic()
    command = "python -m experiments.live_acceptance " + " ".join(argv or sys.argv[1:])
    if args.at:
        try:
            probes = run_stopping_on_sigterm(_probes(args))
        except (asyncio.CancelledError, KeyboardInterrupt):
            print("stopped", file=sys.stderr)
            return 130
        args.out.mkdir(parents=True, exist_ok=True)
        encoded = msgspec.json.format(msgspec.json.encode(probes))
        (args.out / "live-probes.json").write_bytes(encoded)
        (args.out / "live-probes.md").write_text(text := render_probes(probes, command), "utf-8")
        print(text)
        return 0
    known = reused(args.reuse, remeasure="") if args.reuse is not None else {}

    def write(verdicts: list[Verdict], final: bool) -> str:
        notes = [
            f"Live: simulated workers ({args.cluster}), the router and the replay client in "
            f"real time on this machine; each probe a fresh stack replaying {args.span_s:g} s "
            f"of the trace's scaled arrivals (at least {args.min_turns} turns), as the "
            "simulator's acceptance does; adaptive and colocate on mixed workers, the splitting "
            "baselines on K prefill + the rest decode workers.",
            f"Search tolerance {args.tolerance:g}. {time.monotonic() - started:.0f} s wall "
            f"clock{'' if final else '; not finished: the searches so far'}.",
        ]
        args.out.mkdir(parents=True, exist_ok=True)
        encoded = msgspec.json.format(msgspec.json.encode(verdicts))
        (args.out / "live-acceptance.json").write_bytes(encoded)
        text = render(verdicts, command, notes)
        (args.out / "live-acceptance.md").write_text(text, "utf-8")
        return text

    try:
        verdicts = run_stopping_on_sigterm(_main(args, known, lambda so_far: write(so_far, False)))
    except (asyncio.CancelledError, KeyboardInterrupt):
        print(f"stopped; what was measured is in {args.out} (--reuse takes it up)",
              file=sys.stderr)  # fmt: skip
        return 130
    print(write(verdicts, True))
    return 0 if all(v.passed for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
