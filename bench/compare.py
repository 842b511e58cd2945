"""`session-router bench compare`: one trace, several policies, the same simulated GPUs.

For each policy in turn: a fresh `LocalStack` (a `sim-cluster` process and a `serve` process
with its own embedded Redis, so no cache or residency carries over), a live replay of the same
trace at the same rate, then the router's stage events (its `--events` file) joined by request
id. Worker roles (`roles_for`): colocate gets only mixed workers; every other policy, a plugin
name too, gets the split layout of `bench.stack.layout.worker_roles`: K prefill workers (default a
quarter of the cluster, at least one), then decode workers. Policies with hardware parameters
(adaptive's gpu/model/tp) are given the cluster's. Every name and parameter is checked before
anything starts, so a typo fails fast with the policy registry's message.

With `find_max_goodput`, each policy gets the simulator's search instead of one run
(`bench.des.goodput`: exponential bracketing from `rate_scale`, then bisection), every probe a
fresh stack; `max_goodput_rps` on that policy's runs is the trace slice's turns per second at
scale 1 times the highest passing scale.

Files under `out_dir`: the run outputs (`bench.results.outputs`) for all policies together, and
`logs/<policy>/` with the router's and workers' logs and the router's events file.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import msgspec
from rich.table import Table

from bench.des.goodput import GoodputSearch, goodput_search
from bench.replay.run import (
    DEFAULT_REQUEST_TIMEOUT_S,
    join_stage_events,
    read_stage_events,
    replay,
    run_duration_s,
)
from bench.replay.stream import Api, LagProbe
from bench.results.outputs import write_run_outputs
from bench.results.report import run_label
from bench.results.summary import (
    FirstTokenConvention,
    Objectives,
    RequestResult,
    RunSummary,
    Summary,
    summarise,
)
from bench.simulate import GOODPUT_TARGET
from bench.stack.layout import ClusterSpec, worker_roles
from bench.stack.up import LocalStack, RealEngines, StackSpec, policy_params
from bench.traces.model import Trace
from policies.types import Role
from router.obs.events import StageEvents

DEFAULT_CLUSTER = ClusterSpec(4, "h200-sxm", "llama-3.1-8b")


class CompareSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What to compare and how; `policy_params` maps a policy to its `key=value` strings."""

    policies: tuple[str, ...]
    cluster: ClusterSpec = DEFAULT_CLUSTER
    prefill_workers: int | None = None
    rate_scale: float = 1.0
    limit: int | None = None
    first_token: FirstTokenConvention = "decode"
    objectives: Objectives = Objectives()
    api: Api = "chat"
    policy_params: dict[str, dict[str, str]] = {}
    seed: int = 0
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    find_max_goodput: bool = False
    goodput_tolerance: float = 0.1
    real: RealEngines | None = None  # real vLLM engines instead of simulated workers

    def __post_init__(self) -> None:
        if not self.policies or len(set(self.policies)) != len(self.policies):
            raise ValueError("policies must be non-empty, without repeats")
        if not self.rate_scale > 0:
            raise ValueError("rate_scale must be > 0")
        if not self.goodput_tolerance > 0:
            raise ValueError("goodput_tolerance must be > 0")


class ComparedRun(msgspec.Struct, frozen=True):
    summary: RunSummary
    results: list[RequestResult]
    notes: tuple[str, ...]


def roles_for(policy: str, workers: int, prefill_workers: int | None) -> list[Role]:
    """The same layout `bench simulate` uses (`bench.stack.layout.worker_roles`)."""
    return worker_roles(policy, workers, prefill_workers)


def plan(spec: CompareSpec, out_dir: Path) -> list[StackSpec]:
    """One stack per policy; raises ValueError (or PolicyConfigError) before anything runs."""
    stacks = []
    for policy in spec.policies:
        params = policy_params(policy, spec.policy_params.get(policy, {}), spec.cluster)
        roles = roles_for(policy, spec.cluster.workers, spec.prefill_workers)
        logs = out_dir / "logs" / policy
        stacks.append(
            StackSpec(
                cluster=spec.cluster, roles=tuple(roles), policy=policy,
                policy_params=tuple(sorted(params.items())), first_token=spec.first_token,
                events=str(logs / "events.jsonl"), seed=spec.seed, log_dir=str(logs),
                engine="sim" if spec.real is None else "vllm", real=spec.real,
            )
        )  # fmt: skip
    for key in spec.policy_params:
        if key not in spec.policies:
            raise ValueError(f"parameters given for {key!r}, which is not being compared")
    return stacks


def _roles_text(roles: Sequence[str]) -> str:
    counts = {role: roles.count(role) for role in ("prefill", "decode", "mixed")}
    return " + ".join(f"{n} {role}" for role, n in counts.items() if n)


def _fresh_logs(log_dir: str, events: str) -> None:
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    Path(events).unlink(missing_ok=True)


def _events_of(path: str) -> list[StageEvents]:
    return read_stage_events(path) if Path(path).exists() else []


async def run_policy(
    trace: Trace, spec: CompareSpec, stack_spec: StackSpec, progress: bool,
    stop: asyncio.Event | None,
) -> ComparedRun:  # fmt: skip
    """Start a fresh stack, replay the trace through it, stop it, join its stage events."""
    assert stack_spec.events is not None and stack_spec.log_dir is not None
    _fresh_logs(stack_spec.log_dir, stack_spec.events)
    probe = LagProbe()
    async with LocalStack(stack_spec) as stack:
        probe.start()
        try:
            results = await replay(
                trace, stack.url, rate_scale=spec.rate_scale, limit=spec.limit,
                objectives=spec.objectives, api=spec.api, policy_label=stack_spec.policy,
                model=stack.model, progress=progress, stop=stop,
                request_timeout_s=spec.request_timeout_s,
            )  # fmt: skip
        finally:
            await probe.stop()
    stage_events = _events_of(stack_spec.events)
    joined, matched, convention = join_stage_events(results, stage_events)
    summary = summarise(joined, stack_spec.policy, spec.rate_scale, run_duration_s(joined),
                        convention or spec.first_token, objectives=spec.objectives)  # fmt: skip
    notes = [
        f"{stack_spec.policy}: workers {_roles_text(stack_spec.roles)}; router stage events "
        f"joined for {matched} of {len(results)} requests; client event-loop lag p99 "
        f"{probe.quantile_ms(0.99):.2f} ms"
    ]
    cancelled = sum(1 for r in results if r.error.startswith("cancelled"))
    if cancelled:
        notes.append(f"{stack_spec.policy}: stopped early; {cancelled} requests in flight "
                     "were cancelled and count as errors")  # fmt: skip
    return ComparedRun(summary, joined, tuple(notes))


async def compare(
    trace: Trace,
    spec: CompareSpec,
    out_dir: Path,
    *,
    progress: bool = False,
    stop: asyncio.Event | None = None,
) -> Summary:
    """Replay `trace` once per policy (see the module docstring) and write one report."""
    stacks = plan(spec, out_dir)
    sliced = trace.slice(spec.limit) if spec.limit is not None else trace
    if spec.find_max_goodput and not sliced.duration_s > 0:
        raise ValueError("--find-max-goodput scales arrival times: the trace's arrivals must "
                         "span some time")  # fmt: skip
    runs: list[ComparedRun] = []
    searches: dict[str, GoodputSearch] = {}
    for stack_spec in stacks:
        if stop is not None and stop.is_set():
            break
        if not spec.find_max_goodput:
            runs.append(await run_policy(trace, spec, stack_spec, progress, stop))
            continue
        probes, found = await _search(trace, spec, stack_spec, progress, stop)
        runs += probes
        if found is not None:
            searches[stack_spec.policy] = found
    runs = _with_max_goodput(runs, searches, sliced.num_turns / max(sliced.duration_s, 1e-9))
    summary = Summary([run.summary for run in runs])
    workers = (
        "simulated workers" if spec.real is None
        else f"real vLLM engines serving {spec.real.model_dir}"
    )  # fmt: skip
    notes = [
        f"trace {trace.name!r} ({trace.source or 'no source'}): {sliced.num_turns} turns of "
        f"{len(sliced.conversations)} sessions, replayed live at rate scale "
        f"{spec.rate_scale:g} through the {spec.api} API",
        f"cluster {spec.cluster} ({workers}); each policy got a fresh cluster and a "
        f"fresh router with embedded Redis; first-token convention {spec.first_token}",
    ]
    for run in runs:
        notes += run.notes
    notes += [_search_note(policy, found) for policy, found in searches.items()]
    skipped = [s.policy for s in stacks if s.policy not in {r.summary.policy for r in runs}]
    if skipped:
        notes.append(f"not run (stopped): {', '.join(skipped)}")
    summaries = [run.summary for run in runs]
    results = [
        msgspec.structs.replace(r, policy=run_label(run.summary, summaries))
        for run in runs
        for r in run.results
    ]
    write_run_outputs(out_dir, summary, results, f"bench compare: {trace.name} on "
                      f"{spec.cluster}", notes)  # fmt: skip
    return summary


async def _search(
    trace: Trace, spec: CompareSpec, stack_spec: StackSpec, progress: bool,
    stop: asyncio.Event | None,
) -> tuple[list[ComparedRun], GoodputSearch | None]:  # fmt: skip
    """One policy's max-goodput search, every probe a fresh stack; None when stopped."""
    search = goodput_search(GOODPUT_TARGET, start=spec.rate_scale,
                            tolerance=spec.goodput_tolerance)  # fmt: skip
    probes: list[ComparedRun] = []
    scale = next(search)
    while True:
        if stop is not None and stop.is_set():
            search.close()
            return probes, None
        probe = await run_policy(trace, msgspec.structs.replace(spec, rate_scale=scale),
                                 stack_spec, progress, stop)  # fmt: skip
        probes.append(probe)
        try:
            scale = search.send(probe.summary.slo_attainment)
        except StopIteration as done:
            return probes, done.value


def _with_max_goodput(
    runs: list[ComparedRun], searches: dict[str, GoodputSearch], base_rps: float
) -> list[ComparedRun]:
    out = []
    for run in runs:
        found = searches.get(run.summary.policy)
        if found is not None and found.best_scale is not None:
            rps = found.best_scale * base_rps
            summary = msgspec.structs.replace(run.summary, max_goodput_rps=rps)
            run = ComparedRun(summary, run.results, run.notes)
        out.append(run)
    return out


def _search_note(policy: str, found: GoodputSearch) -> str:
    probes = ", ".join(f"{p.rate_scale:.4g}x {p.attainment:.1%}" for p in found.probes)
    best = "none" if found.best_scale is None else f"{found.best_scale:.4g}x"
    above = "none" if found.failing_scale is None else f"{found.failing_scale:.4g}x"
    return (
        f"max goodput search for {policy} (target {GOODPUT_TARGET:.0%} good), live: "
        f"highest passing scale {best}, lowest failing above it {above}; probes: {probes}"
    )


def comparison_table(summary: Summary, title: str = "bench compare") -> Table:
    """The runs side by side (one column per run), for the terminal."""
    runs = summary.runs
    table = Table(title=title)
    table.add_column("", no_wrap=True)
    for run in runs:
        table.add_column(run_label(run, runs), justify="right")

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    rows: list[tuple[str, list[str]]] = [
        ("requests", [str(r.requests) for r in runs]),
        ("completed", [str(r.completed) for r in runs]),
        ("rejected", [str(r.rejected) for r in runs]),
        ("errors", [str(r.errors) for r in runs]),
        ("SLO attainment", [f"{r.slo_attainment:.1%}" for r in runs]),
        ("goodput req/s", [f"{r.goodput_rps:.2f}" for r in runs]),
        ("TTFT p50 ms", [ms(r.ttft_ms.p50) for r in runs]),
        ("TTFT p99 ms", [ms(r.ttft_ms.p99) for r in runs]),
        ("ITL p50 ms", [ms(r.itl_ms.p50) for r in runs]),
        ("ITL p99 ms", [ms(r.itl_ms.p99) for r in runs]),
        ("ITL max ms", [ms(r.itl_ms.max) for r in runs]),
        ("stalls", [str(r.stalls) for r in runs]),
        ("actions", ["\n".join(f"{a} {n}" for a, n in r.actions.items()) or "-" for r in runs]),
        ("recomputed tokens", [str(r.recomputed_tokens) for r in runs]),
        ("evicted tokens", [str(r.evicted_tokens) for r in runs]),
        ("transferred GiB", [f"{r.transferred_bytes / 2**30:.2f}" for r in runs]),
        ("exposed xfer p99 ms", [ms(r.exposed_transfer_ms.p99) for r in runs]),
    ]
    if any(r.max_goodput_rps is not None for r in runs):
        rows.insert(6, ("max goodput req/s", [ms(r.max_goodput_rps) for r in runs]))
    for name, cells in rows:
        table.add_row(name, *cells)
    return table
