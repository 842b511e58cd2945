"""`session-router demo` (what `make demo` runs): the decisive experiment, in small.

A short non-stationary trace (`demo_trace`: long-prompt short-answer phases alternating with
short-prompt long-answer ones, `DEMO_PHASE_S` each, twice over) at a load where fixed
placements break, on a 4 x H200 / Llama-3.1-8B cluster, once each for colocation, the best
fixed split and adaptive. The best fixed split is chosen in hindsight, as a user tuning it
would: every K of 1..3 prefill workers for disaggregate and for threshold at each of its
candidates (`bench.hindsight`), each run on the same trace, the highest share of good requests
winning. Out come the side-by-side table, good requests over time per policy (in the terminal,
and good_over_time.png) and the usual report.

With `live` (what `make demo` runs) the three are replayed live, each against a fresh simulated
cluster and router with embedded Redis (`bench compare`): about three and a half minutes on two
cores that nothing else uses. The load that breaks fixed placements streams about 20 turns a
second of answers hundreds of tokens long; on cores shared with other heavy work the simulated
workers' lag, not the placement, decides the result. Without it, the runs are the
discrete-event simulator's (`bench simulate`: the simulated workers' engine, the same policy
objects, the live router's semantics), under a minute.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import msgspec
from rich.console import Console

from bench.compare import DEFAULT_CLUSTER, CompareSpec, compare, comparison_table
from bench.des import SimConfig
from bench.hindsight import threshold_candidates
from bench.results.outputs import REPORT_HTML, REPORT_MD, read_requests, requests_file
from bench.results.summary import Objectives, RequestResult, Summary, is_good
from bench.simulate import plan_runs, run_one, run_simulation, write_outputs
from bench.stack.layout import ClusterSpec, worker_roles
from bench.traces.model import Trace
from bench.traces.phases import generate_phased, mix_shift

DEMO_OUT = Path("bench-out/demo")
DEMO_PHASE_S = 8.0
# Sessions/s: where on DEMO_CLUSTER adaptive keeps nearly every request good and colocation and
# the best fixed split lose a large share of the long-prompt phases (see the commit's figures).
DEMO_RATE_RPS = 7.5
DEMO_CLUSTER = DEFAULT_CLUSTER
_BUCKET_S = 5.0
_BARS = " ▁▂▃▄▅▆▇█"


def demo_trace(seed: int = 0, rate_rps: float = DEMO_RATE_RPS) -> Trace:
    """Four phases of `DEMO_PHASE_S`: long prompts (6144 tokens, 48 answered), then long
    answers (256-token prompts, 768 answered), twice; 3-turn sessions at `rate_rps`."""
    spec = mix_shift(DEMO_PHASE_S, rate_rps, cycles=2)
    return generate_phased(msgspec.structs.replace(spec, name="demo", seed=seed))


class FixedSplit(msgspec.Struct, frozen=True):
    """The best fixed placement found in hindsight, and how many layouts were tried."""

    policy: str
    params: dict[str, str]
    prefill_workers: int
    attainment: float
    tried: int

    @property
    def label(self) -> str:
        threshold = self.params.get("threshold")
        chosen = f"threshold {threshold}" if threshold else self.policy
        return f"{chosen} on {self.prefill_workers} prefill + decode workers"


def best_fixed_split(trace: Trace, cluster: ClusterSpec, rate_scale: float = 1.0) -> FixedSplit:
    """Every split layout of disaggregate and threshold on `trace` in the simulator; the one
    with the highest share of good requests (the first of equals)."""
    template = SimConfig(cluster=cluster, roles=tuple(worker_roles("colocate", cluster.workers)))
    candidates: list[tuple[str, dict[str, str]]] = [("disaggregate", {})]
    candidates += [("threshold", {"threshold": str(t)}) for t in threshold_candidates(trace)]
    best: FixedSplit | None = None
    tried = 0
    for k in range(1, cluster.workers):
        for policy, params in candidates:
            (run,) = plan_runs([policy], template, k, {policy: params} if params else None)
            attainment = run_one(trace, run, rate_scale).summary.slo_attainment
            tried += 1
            if best is None or attainment > best.attainment:
                best = FixedSplit(policy, params, k, attainment, 0)
    if best is None:
        raise ValueError(f"{cluster} has no split layout (it needs at least 2 workers)")
    return msgspec.structs.replace(best, tried=tried)


def good_over_time(results: Sequence[RequestResult], objectives: Objectives) -> str:
    """Good requests per `_BUCKET_S` by when sent, as a bar of block characters scaled to the
    most sent in any bucket, and the share good in each bucket."""
    if not results:
        return ""
    start = min(r.sent_at for r in results)
    buckets = int((max(r.sent_at for r in results) - start) // _BUCKET_S) + 1
    sent, good = [0] * buckets, [0] * buckets
    for r in results:
        b = int((r.sent_at - start) // _BUCKET_S)
        sent[b] += 1
        good[b] += is_good(r, objectives)
    top = max(sent)
    return "".join(_BARS[round(g / top * (len(_BARS) - 1))] for g in good)


def _timelines(out_dir: Path, summary: Summary) -> list[str]:
    results = read_requests(requests_file(out_dir))
    lines = []
    for run in summary.runs:
        mine = [r for r in results if r.policy == run.policy]
        bars = good_over_time(mine, run.objectives)
        lines.append(f"  {run.policy:>14} |{bars}| {run.slo_attainment:.0%} good")
    return lines


def _simulated(trace: Trace, split: FixedSplit, out_dir: Path) -> Summary:
    template = SimConfig(cluster=DEMO_CLUSTER,
                         roles=tuple(worker_roles("colocate", DEMO_CLUSTER.workers)))  # fmt: skip
    params = {split.policy: split.params} if split.params else None
    [colocate, adaptive] = plan_runs(["colocate", "adaptive"], template)
    [fixed] = plan_runs([split.policy], template, split.prefill_workers, params)
    runs = [colocate, fixed, adaptive]
    simulation = run_simulation(trace, runs, jobs=1)
    write_outputs(out_dir, trace, runs, simulation)
    return simulation.summary


async def run_demo(
    out_dir: Path = DEMO_OUT,
    rate_scale: float = 1.0,
    progress: bool = True,
    stop: asyncio.Event | None = None,
    console: Console | None = None,
    live: bool = False,
) -> int:
    console = console or Console()
    trace = demo_trace().scaled(rate_scale)
    cluster = DEMO_CLUSTER
    console.print(
        f"session-router demo: {trace.num_turns} turns of {len(trace.conversations)} sessions "
        f"whose mix changes every {DEMO_PHASE_S / rate_scale:g} s (long prompts with short "
        f"answers, then short prompts with long answers, twice), at {rate_scale:g}x its "
        f"rate, on {cluster}."
    )
    console.print("Tuning the fixed split in hindsight on the simulator ...")
    split = await asyncio.to_thread(best_fixed_split, trace, cluster)
    console.print(
        f"  best of {split.tried} fixed layouts: {split.label} "
        f"({split.attainment:.0%} good in the simulator)."
    )
    chosen = ("colocate", split.policy, "adaptive")
    how = ("live, each on a fresh simulated cluster and router" if live
           else "in the simulator")  # fmt: skip
    console.print(
        f"Running it {how}: colocate ({cluster.workers} mixed workers), {split.label}, "
        f"adaptive ({cluster.workers} mixed workers; it prefills, decodes or both per turn)."
    )
    if live:
        spec = CompareSpec(
            policies=chosen, cluster=cluster, prefill_workers=split.prefill_workers,
            policy_params={split.policy: split.params} if split.params else {},
        )  # fmt: skip
        summary = await compare(trace, spec, out_dir, progress=progress, stop=stop)
    else:
        summary = await asyncio.to_thread(_simulated, trace, split, out_dir)
    console.print(comparison_table(summary, "session-router demo"))
    console.print(f"Good requests per {_BUCKET_S:g} s (bar height: good / most sent in a bucket):")
    for line in _timelines(out_dir, summary):
        console.print(line, markup=False, highlight=False)
    console.print(
        f"plot: {out_dir / 'good_over_time.png'}  report: {out_dir / REPORT_MD} "
        f"(and {out_dir / REPORT_HTML})"
    )
    return 0 if len(summary.runs) == len(chosen) else 130
