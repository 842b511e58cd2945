"""Acceptance of `adaptive` (issue 3): its max goodput against the best baseline, per workload.

Workloads: the Mooncake trace, both Azure 2023 traces, each class of a workload matrix
(`bench.traces.workloads`) and its multi-turn classes interleaved ("mixed-multi-turn"). Every
variant gets a max-goodput search (`bench.des.goodput`, 90% good) on the same GPUs: colocate,
round-robin, disaggregate at each of `--splits` prefill workers, threshold at each of
`--thresholds`, adaptive with default parameters (on mixed workers; on the default split for
reference). Colocate is searched first, the others start at its answer; one process pool.

A finite trace replayed ever faster becomes one burst the cluster absorbs whole, so every probe
replays `--span-s` seconds of (scaled) arrivals: a trace's turns within span x scale seconds
(at least `--limit`), or the generated sessions starting within the span (at least
`--class-turns` turns). Max goodput = the arrival rate of the highest passing probe.

A workload passes when adaptive reaches `needs` x the best baseline: 1.2 on mixed multi-turn
workloads (a trace with multi-turn sessions, the interleaved classes), else 1.0 (a single
class, one prompt length, answer length and reuse mode, is not a mix).
Outputs in `--out`: acceptance.md (verdicts, then every variant's max goodput) and
acceptance.json (per workload and variant: the probes, the summary of the best passing one).
Run: `.venv/bin/python -m experiments.acceptance --jobs 2 --out bench-out/acceptance`.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path

import msgspec

from bench.des import SimConfig
from bench.des.goodput import Search, goodput_search
from bench.hindsight import threshold_candidates
from bench.results.summary import RunSummary
from bench.simulate import GOODPUT_TARGET, PolicyRun, plan_runs, run_one
from bench.stack.layout import ClusterSpec, default_prefill_workers, worker_roles
from bench.traces.workloads import WorkloadSpec
from experiments.acceptance_grid import next_variants
from experiments.acceptance_verdicts import render, verdict
from experiments.acceptance_workloads import (
    REPLICA_SEED_STRIDE,
    Measured,
    Offered,
    Source,
    Variant,
    Verdict,
    Workload,
    fixed_variants,
    matrix_workloads,
    nonstationary_workloads,
    offered_rps,
    trace_workloads,
)

_SOURCES: dict[str, Source] = {}


def _init(sources: dict[str, Source]) -> None:
    _SOURCES.update(sources)


def _probe(
    workload: str, run: PolicyRun, scale: float, replicas: int = 1
) -> tuple[RunSummary, Offered, str | None]:
    """`replicas` replays at `scale`, each with its own seeds: the first's summary, and the
    attainment pooled over all (an edge rate's verdict rests on more than one draw); where a
    replay fails, its summary and attainment and the failure."""
    source = _SOURCES[workload]
    summaries: list[RunSummary] = []
    turns, rps = 0, 0.0
    for replica in range(replicas):
        trace = source.at(scale, replica)
        if replica == 0:
            turns = trace.num_turns
            rps = turns * scale / trace.duration_s if trace.duration_s > 0 else 0.0
        seed = run.config.seed + REPLICA_SEED_STRIDE * replica
        seeded = msgspec.structs.replace(run, config=msgspec.structs.replace(run.config, seed=seed))
        outcome = run_one(trace, seeded, scale)
        if outcome.failure is not None:
            attained = outcome.summary.slo_attainment
            offered = Offered(scale, attained, turns, rps, replicas)
            return outcome.summary, offered, outcome.failure.describe()
        summaries.append(outcome.summary)
    requests = sum(s.requests for s in summaries)
    pooled = sum(s.good for s in summaries) / requests if requests else 0.0
    return summaries[0], Offered(scale, pooled, turns, rps, replicas), None


class _Search:
    """One (workload, variant) search: its probes and the summaries of the passing ones."""

    def __init__(self, workload: str, variant: Variant, run: PolicyRun, known: Measured | None):
        self.workload, self.variant, self.run, self.result = workload, variant, run, known
        self.search: Search | None = None
        self.probes: list[Offered] = []
        self.summaries: dict[float, RunSummary] = {}

    def start(self, scale: float, tolerance: float) -> float:
        self.search = search = goodput_search(GOODPUT_TARGET, start=scale, tolerance=tolerance)
        return next(search)

    def advance(self, summary: RunSummary, offered: Offered, failure: str | None) -> float | None:
        """Feed one probe; the next scale, or None once `result` is set."""
        assert self.search is not None
        self.probes.append(offered)
        if failure is not None:
            self.search.close()
            self.result = Measured(self.variant.label, None, None, 0.0, self.probes, None, failure)
            return None
        self.summaries[offered.rate_scale] = summary
        try:
            return self.search.send(offered.attainment)
        except StopIteration as stop:
            best, failing = stop.value.best_scale, stop.value.failing_scale
            rps = offered_rps(self.probes, best)
            found = self.summaries.get(best) if best is not None else None
            short = self.summaries.get(failing) if failing is not None else None
            self.result = Measured(self.variant.label, best, failing, rps, self.probes, found,
                                   failing=short)  # fmt: skip
            return None


OnProbe = Callable[[str, str, Offered, int, int], None]  # workload, label, probe, done, open


def measure(
    workloads: Sequence[Workload],
    contenders: Sequence[Variant] | Mapping[str, Sequence[Variant]], template: SimConfig,
    jobs: int, tolerance: float = 0.05, on_probe: OnProbe | None = None,
    known: Mapping[str, Mapping[str, Measured]] | None = None, replicas: int = 1,
) -> dict[str, list[Measured]]:  # fmt: skip
    """Every variant's max-goodput search on every workload (`contenders`: the same for all,
    or by workload name), by workload, in variant order; `known` results (by workload, then
    label) are kept, not searched again; each probe pools `replicas` replays (`_probe`)."""
    known = known or {}
    chosen = {w.name: (contenders[w.name] if isinstance(contenders, Mapping) else contenders)
              for w in workloads}  # fmt: skip
    plans = {v.label: _plan(v, template) for vs in chosen.values() for v in vs}
    searches = {
        w.name: [_Search(w.name, v, plans[v.label], known.get(w.name, {}).get(v.label))
                 for v in chosen[w.name]]
        for w in workloads
    }  # fmt: skip
    sources = {w.name: w.source for w in workloads}
    context = multiprocessing.get_context("forkserver")
    pending: dict[Future[tuple[RunSummary, Offered, str | None]], _Search] = {}
    done = 0
    with ProcessPoolExecutor(jobs, context, _init, (sources,)) as pool:

        def submit(search: _Search, scale: float) -> None:
            pending[pool.submit(_probe, search.workload, search.run, scale, replicas)] = search

        def start_open(group: list[_Search]) -> None:
            """The first open search alone while none is done; then all the others, from the
            highest scale a finished one reached."""
            if any(s.search is not None and s.result is None for s in group):
                return
            open_ = [s for s in group if s.search is None and s.result is None]
            reached = [s.result.best_scale for s in group if s.result and s.result.best_scale]
            for search in open_ if any(s.result for s in group) else open_[:1]:
                submit(search, search.start(max(reached, default=1.0), tolerance))

        for group in searches.values():
            start_open(group)
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                search = pending.pop(future)
                summary, offered, failure = future.result()
                done += 1
                following = search.advance(summary, offered, failure)
                if on_probe is not None:
                    on_probe(search.workload, search.variant.label, offered, done, len(pending))
                if following is None:
                    start_open(searches[search.workload])
                else:
                    submit(search, following)
    return {name: [s.result for s in group if s.result] for name, group in searches.items()}


def tune(
    workloads: Sequence[Workload], fixed: Sequence[Variant], thresholds: Mapping[str, list[int]],
    template: SimConfig, jobs: int, tolerance: float = 0.05, on_probe: OnProbe | None = None,
    known: Mapping[str, Mapping[str, Measured]] | None = None, replicas: int = 1,
    exhaustive: bool = False,
) -> dict[str, list[Measured]]:  # fmt: skip
    """The `fixed` variants and the split grid (`acceptance_grid`) on every workload: each
    split family's K searched coarse to fine (or every K with `exhaustive`), in rounds, each
    round's searches starting where the earlier ones reached. By workload: `fixed` in order,
    then the split variants in the order searched, then the `known` ones no round asked for
    (a reused grid keeps every K it measured)."""
    workers = template.cluster.workers
    results = {w.name: dict((known or {}).get(w.name, {})) for w in workloads}
    order: dict[str, list[Variant]] = {w.name: list(fixed) for w in workloads}
    round_ = {w.name: list(fixed) for w in workloads}
    for w in workloads:
        round_[w.name] += next_variants([], thresholds[w.name], workers, exhaustive)
    while any(round_.values()):
        for name, vs in round_.items():
            order[name] += [v for v in vs if v not in order[name]]
        measured = measure(workloads, round_, template, jobs, tolerance, on_probe, results,
                           replicas)  # fmt: skip
        for name, ms in measured.items():
            results[name].update((m.label, m) for m in ms)
        round_ = {w.name: next_variants(list(results[w.name].values()), thresholds[w.name],
                                        workers, exhaustive)
                  for w in workloads}  # fmt: skip
    out = {}
    for name, vs in order.items():
        labels = [v.label for v in vs]
        labels += [label for label in results[name] if label not in labels]  # known, not asked
        out[name] = [results[name][label] for label in labels if label in results[name]]
    return out


def _plan(variant: Variant, template: SimConfig) -> PolicyRun:
    params = {variant.policy: variant.params} if variant.params else None
    # A split unless mixed, even for a policy that bench.stack.layout puts on mixed workers.
    split = variant.prefill_workers or default_prefill_workers(template.cluster.workers)
    (run,) = plan_runs([variant.policy], template, split, params)
    mixed = msgspec.structs.replace(run.config, roles=template.roles)  # as colocate's
    return msgspec.structs.replace(run, config=mixed) if variant.mixed else run


def names(text: str) -> list[str]:
    """The comma-separated names in `text`, stripped, empty ones left out."""
    return [name.strip() for name in text.split(",") if name.strip()]


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in names(text))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="adaptive's acceptance figures (issue 3)")
    add = parser.add_argument
    add("--traces-dir", type=Path, default=Path("/work/shared/traces"))
    add("--limit", type=int, default=1500, help="at least this many turns of each trace")
    add("--span-s", type=float, default=30.0, help="seconds of arrivals each probe replays")
    add("--cluster", default="8xh200-sxm/llama-3.1-8b")
    add(
        "--chunked-prefill",
        type=int,
        metavar="N",
        help="engines chunk prefills at N tokens a step (vLLM V1 on an H200: 8192); default off",
    )
    add("--max-num-batched-tokens", type=int, default=8192, help="engines' token budget a step")
    add("--max-num-seqs", type=int, default=256, help="engines' running requests at most")
    add("--scheduling-policy", choices=("fcfs", "priority"), default="priority",
        help="the engines' (vLLM's --scheduling-policy); requests without a due time keep "
             "arrival order under priority too")  # fmt: skip
    add("--thresholds", type=ints, default=(),
        help="threshold's candidates (default: per workload, the boundaries between its "
             "prompt classes and the powers of two 256..65536, those no turn tells apart "
             "dropped)")  # fmt: skip
    add("--exhaustive-k", action="store_true",
        help="search every K of each split family (default: coarse to fine)")  # fmt: skip
    add("--phased-rate", type=float, default=1.0,
        help="the non-stationary workloads' sessions/s at scale 1")  # fmt: skip
    add("--prompts", type=ints, default=(512, 4096, 16384), help="matrix prompt tokens")
    add("--outputs", type=ints, default=(64, 512), help="matrix output tokens")
    add("--reuse", default="none,system-prefix,multi-turn", help="matrix reuse modes")
    add("--turns", type=int, default=4, help="turns of a multi-turn session")
    add("--class-turns", type=int, default=400, help="at least this many turns per class")
    add("--session-rate", type=float, default=1.0, help="matrix sessions/s at scale 1")
    add("--think-s", type=float, default=2.0, help="mean think time between turns")
    add("--seed", type=int, default=0)
    add("--only", default="", help="comma-separated workload names (default all)")
    add("--baselines", type=Path, metavar="JSON", help="reuse an acceptance.json's results")
    add("--remeasure", default="adaptive", help="labels --baselines searches again")
    add(
        "--adaptive-split",
        action="store_true",
        help="also adaptive on the default fixed split (for reference, not judged)",
    )
    add("--tolerance", type=float, default=0.05, help="search bracket ratio")
    add("--replicas", type=int, default=1,
        help="replays per probe, each with its own seeds (matrix sessions, engine noise); "
             "the attainment is pooled over them")  # fmt: skip
    add("--jobs", type=int, default=2)
    add("--out", type=Path, default=Path("bench-out/acceptance"))
    return parser


def matrix_spec(args: argparse.Namespace) -> WorkloadSpec:
    """The matrix the options describe (msgspec validates the reuse modes)."""
    return msgspec.convert({
        "name": "matrix", "prompt_tokens": args.prompts, "output_tokens": args.outputs,
        "reuse": args.reuse.split(","), "turns": [args.turns], "seed": args.seed,
        "arrival": {"process": "poisson", "rate_rps": args.session_rate},
        "think": {"distribution": "exponential", "mean_s": args.think_s},
    }, WorkloadSpec)  # fmt: skip


def default_matrix() -> WorkloadSpec:
    """The matrix this script measures when given no matrix options."""
    return matrix_spec(_parser().parse_args([]))


def workloads_of(args: argparse.Namespace) -> list[Workload]:
    workloads = trace_workloads(args.traces_dir, args.limit, args.span_s)
    workloads += matrix_workloads(matrix_spec(args), args.class_turns, args.span_s)
    workloads += nonstationary_workloads(args.traces_dir, args.limit, args.span_s,
                                         args.phased_rate)  # fmt: skip
    only = set(names(args.only))
    return [w for w in workloads if not only or w.name in only]


def reused(path: Path, remeasure: str, replicas: int = 1) -> dict[str, dict[str, Measured]]:
    """The measurements of an earlier run by workload and label, less those to `remeasure`;
    ValueError where one pooled another number of replays a probe than `replicas` (its
    verdicts would weigh unlike measurements)."""
    done = msgspec.json.decode(path.read_bytes(), type=list[Verdict])
    again = set(remeasure.split(","))
    kept = {v.workload: {m.label: m for m in v.measured if m.label not in again} for v in done}
    for workload, measured in kept.items():
        for m in measured.values():
            other = next((p.replicas for p in m.probes if p.replicas != replicas), None)
            if other is not None:
                raise ValueError(
                    f"{path}: {workload} / {m.label} was measured with {other} replays a "
                    f"probe; pass --replicas {other} or remeasure it"
                )
    return kept


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.replicas < 1:
        parser.error("--replicas must be at least 1")
    cluster = ClusterSpec.parse(args.cluster)
    template = SimConfig(
        cluster=cluster, roles=tuple(worker_roles("colocate", cluster.workers)),
        chunked_prefill=args.chunked_prefill, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        scheduling_policy=args.scheduling_policy,
    )  # fmt: skip
    workloads = workloads_of(args)
    started = time.monotonic()

    def on_probe(workload: str, label: str, p: Offered, done: int, open_: int) -> None:
        print(f"[{time.monotonic() - started:5.0f}s] {done} probes, {open_} open: {workload} / "
              f"{label} @ {p.rate_scale:.4g}x ({p.turns} turns, {p.rps:.3g}/s): {p.attainment:.1%}"
              " good", file=sys.stderr, flush=True)  # fmt: skip

    thresholds = {w.name: list(args.thresholds) or threshold_candidates(w.source.at(8.0))
                  for w in workloads}  # fmt: skip
    known = None
    if args.baselines is not None:
        try:
            known = reused(args.baselines, args.remeasure, args.replicas)
        except ValueError as exc:
            parser.error(str(exc))
    results = tune(
        workloads,
        fixed_variants(args.adaptive_split),
        thresholds,
        template,
        args.jobs,
        args.tolerance,
        on_probe,
        known,
        args.replicas,
        args.exhaustive_k,
    )
    verdicts = [verdict(w, results[w.name]) for w in workloads]
    command = "python -m experiments.acceptance " + " ".join(argv or sys.argv[1:])
    notes = [
        f"Discrete-event simulator, {cluster}: colocate and adaptive on {cluster.workers} mixed "
        "workers (adaptive places each turn whole or split on any of them), round-robin (and "
        "adaptive (fixed split), not judged) on K = "
        f"{default_prefill_workers(cluster.workers)} prefill + the rest decode workers, "
        "disaggregate and threshold on every K searched (named in the label: K prefill + "
        f"{cluster.workers} - K decode), K searched "
        f"{'exhaustively' if args.exhaustive_k else 'coarse to fine'}.",
        "Thresholds per workload: " + "; ".join(
            f"{name} {', '.join(map(str, ts))}" for name, ts in thresholds.items()) + ".",
        f"Engines: at most {args.max_num_seqs} running requests and "
        f"{args.max_num_batched_tokens} tokens a step; chunked prefill "
        f"{args.chunked_prefill or 'off'}; scheduling policy {args.scheduling_policy} (only "
        "adaptive's decisions carry due times: the baselines' requests keep arrival order).",
        f"Each probe replays {args.span_s:g} s of scaled arrivals: trace turns (at least "
        f"{args.limit}); matrix sessions (at least {args.class_turns} turns a class; Poisson, "
        f"{args.session_rate:g}/s at scale 1; think {args.think_s:g} s; seed {args.seed}); "
        f"{args.replicas} replay(s) a probe, replica k with matrix seed {args.seed} + k and "
        f"engine seeds + {REPLICA_SEED_STRIDE}k, attainment pooled over them.",
        f"Search tolerance {args.tolerance:g}; >= marks a search that never failed. "
        f"{time.monotonic() - started:.0f} s wall clock, {args.jobs} jobs.",
    ]  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "acceptance.json").write_bytes(msgspec.json.format(msgspec.json.encode(verdicts)))
    text = render(verdicts, command, notes, cluster.workers)
    (args.out / "acceptance.md").write_text(text, "utf-8")
    print(text)
    return 0 if all(v.passed for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
