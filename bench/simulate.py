"""`bench simulate`: whole traces through the discrete-event simulator, many runs in parallel.

A run is one policy at one rate scale on the same simulated cluster (`bench.des.simulate`),
summarised exactly as a live replay (`bench.results.summary.summarise` over the client's results,
the run's duration from `bench.replay.run.run_duration_s`). Runs are independent: a sweep (policies
x rate scales) or the max-goodput searches (`bench.des.goodput`, one per policy, their probes
interleaved) spread them over a process pool. A policy that raises ends its own run; the
failure is kept (`PolicyFailure`) and reported, the other runs go on.

`max_goodput_rps` is the arrival rate at the highest passing rate scale: the trace's turns per
second at scale 1 (turns / the latest arrival offset) times that scale.

A search keeps the per-request records only of its final bracket (the highest passing probe and
the lowest failing one above it) unless `keep_all_requests`: a probe outside the current
bracket can never become one of its ends (every later probe lies inside it), so its records
are dropped as soon as the bracket passes it. Every probe's summary is kept.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path

import msgspec

from bench.des import PolicyFailure, SimConfig, SimStats, simulate
from bench.des.goodput import GoodputSearch, Search, goodput_search
from bench.replay.run import run_duration_s
from bench.results.outputs import write_run_outputs
from bench.results.report import run_label
from bench.results.summary import RequestResult, RunSummary, Summary, summarise
from bench.stack.layout import hardware_params, worker_roles
from bench.traces.model import Trace
from policies import create_policy

GOODPUT_TARGET = 0.9


class PolicyRun(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One policy on its cluster layout; `params` as `--policy-param` gives them."""

    policy: str
    params: dict[str, str]
    config: SimConfig


class RunOutcome(msgspec.Struct, frozen=True):
    summary: RunSummary
    results: list[RequestResult]
    stats: SimStats
    failure: PolicyFailure | None = None


class Simulation(msgspec.Struct, frozen=True):
    """Everything a `bench simulate` invocation measured.

    `summary` has every successful run (by policy, then rate scale) and `results` their
    requests, labelled with `bench.results.report.run_label`; failed runs are only in `failures`.
    """

    summary: Summary
    results: list[RequestResult]
    outcomes: list[RunOutcome]
    searches: dict[str, GoodputSearch]
    failures: list[PolicyFailure]


def plan_runs(
    policies: Sequence[str],
    template: SimConfig,
    prefill_workers: int | None = None,
    params: Mapping[str, Mapping[str, str]] | None = None,
) -> list[PolicyRun]:
    """Each policy's run: its roles (`worker_roles`), its parameters plus the cluster's
    hardware ones, all validated now (ValueError / PolicyConfigError) so no worker fails."""
    params = params or {}
    unknown = sorted(set(params) - set(policies))
    if unknown:
        raise ValueError(f"parameters given for {unknown[0]!r}, which is not being simulated")
    if not policies or len(set(policies)) != len(policies):
        raise ValueError("policies must be non-empty, without repeats")
    runs = []
    for name in policies:
        params_type = getattr(type(create_policy(name)), "Params", None)
        merged = hardware_params(
            params_type, params.get(name, {}), template.cluster, template.chunked_prefill,
            template.max_num_seqs,
        )  # fmt: skip
        create_policy(name, merged)
        roles = tuple(worker_roles(name, template.cluster.workers, prefill_workers))
        config = msgspec.structs.replace(template, roles=roles)
        runs.append(PolicyRun(name, {k: str(v) for k, v in merged.items()}, config))
    return runs


def run_one(trace: Trace, run: PolicyRun, rate_scale: float) -> RunOutcome:
    """Simulate one run with a fresh policy object and summarise it."""
    policy = create_policy(run.policy, run.params)
    result = simulate(trace, policy, run.config, rate_scale, run.policy)
    summary = summarise(
        result.results, run.policy, rate_scale, run_duration_s(result.results),
        run.config.first_token, objectives=run.config.objectives,
    )  # fmt: skip
    return RunOutcome(summary, result.results, result.stats, result.failure)


_WORKER_TRACE: Trace | None = None


def _init_worker(trace: Trace) -> None:
    global _WORKER_TRACE
    _WORKER_TRACE = trace


def _run_in_worker(run: PolicyRun, rate_scale: float) -> RunOutcome:
    assert _WORKER_TRACE is not None
    return run_one(_WORKER_TRACE, run, rate_scale)


class _Runner:
    """Runs in this process (jobs <= 1) or in a pool of `jobs` processes; futures either way."""

    def __init__(self, trace: Trace, jobs: int) -> None:
        self._trace = trace
        self._pool: ProcessPoolExecutor | None = None
        if jobs > 1:
            # forkserver: never fork a process whose threads (the progress bar) hold locks
            self._pool = ProcessPoolExecutor(
                jobs, multiprocessing.get_context("forkserver"), _init_worker, (trace,)
            )

    def submit(self, run: PolicyRun, rate_scale: float) -> Future[RunOutcome]:
        if self._pool is not None:
            return self._pool.submit(_run_in_worker, run, rate_scale)
        future: Future[RunOutcome] = Future()
        try:
            future.set_result(run_one(self._trace, run, rate_scale))
        except BaseException as error:
            future.set_exception(error)
        return future

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)


OnRun = Callable[[RunOutcome, int], None]  # (finished run, runs submitted so far)


def run_simulation(
    trace: Trace,
    runs: Sequence[PolicyRun],
    rate_scales: Sequence[float] = (1.0,),
    find_max_goodput: bool = False,
    jobs: int | None = None,
    tolerance: float = 0.05,
    on_run: OnRun | None = None,
    keep_all_requests: bool = False,
) -> Simulation:
    """The sweep (every run at every scale), or with `find_max_goodput` each policy's search
    (per-request records of its final bracket only, unless `keep_all_requests`)."""
    if find_max_goodput and (trace.concurrency is not None or not trace.duration_s > 0):
        raise ValueError(
            "--find-max-goodput scales arrival times: it needs an open-loop trace whose "
            "arrivals span some time"
        )
    runner = _Runner(trace, jobs if jobs is not None else os.cpu_count() or 1)
    pending: dict[Future[RunOutcome], tuple[PolicyRun, Search | None]] = {}
    searches: dict[str, GoodputSearch] = {}
    outcomes: list[RunOutcome] = []
    try:
        for run in runs:
            if find_max_goodput:
                started = goodput_search(GOODPUT_TARGET, tolerance=tolerance)
                pending[runner.submit(run, next(started))] = (run, started)
            else:
                for scale in rate_scales:
                    pending[runner.submit(run, scale)] = (run, None)
        submitted = len(pending)
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                run, search = pending.pop(future)
                outcome = future.result()
                outcomes.append(outcome)
                if search is not None:
                    following = _advance(search, outcome, searches, run.policy)
                    if following is not None:
                        pending[runner.submit(run, following)] = (run, search)
                        submitted += 1
                    if not keep_all_requests:
                        outcomes = _outside_bracket_dropped(outcomes, run.policy)
                if on_run is not None:
                    on_run(outcome, submitted)
    finally:
        runner.close()
    return _assemble(trace, runs, outcomes, searches)


def _advance(
    search: Search, outcome: RunOutcome, searches: dict[str, GoodputSearch], policy: str
) -> float | None:
    """The next scale the search wants, or None when it is over (its answer in `searches`)."""
    if outcome.failure is not None:
        search.close()
        return None
    try:
        return search.send(outcome.summary.slo_attainment)
    except StopIteration as stop:
        searches[policy] = stop.value
        return None


def bracket(outcomes: Sequence[RunOutcome], policy: str) -> tuple[float | None, float | None]:
    """`policy`'s search bracket so far: its highest passing scale and the lowest failing one
    above it (None where there is none), over its successful runs."""
    runs = [o.summary for o in outcomes if o.summary.policy == policy and o.failure is None]
    passed = [r.rate_scale for r in runs if r.slo_attainment >= GOODPUT_TARGET]
    low = max(passed, default=None)
    failed = [r.rate_scale for r in runs if r.slo_attainment < GOODPUT_TARGET]
    high = min((s for s in failed if low is None or s > low), default=None)
    return low, high


def _outside_bracket_dropped(outcomes: list[RunOutcome], policy: str) -> list[RunOutcome]:
    """`outcomes` with the records of `policy`'s runs outside its current bracket emptied."""
    ends = bracket(outcomes, policy)
    return [
        msgspec.structs.replace(o, results=[])
        if o.results and o.summary.policy == policy and o.summary.rate_scale not in ends
        else o
        for o in outcomes
    ]


def _assemble(
    trace: Trace,
    runs: Sequence[PolicyRun],
    outcomes: list[RunOutcome],
    searches: dict[str, GoodputSearch],
) -> Simulation:
    order = {run.policy: i for i, run in enumerate(runs)}
    outcomes = sorted(outcomes, key=lambda o: (order[o.summary.policy], o.summary.rate_scale))
    good = [o for o in outcomes if o.failure is None]
    base_rps = trace.num_turns / trace.duration_s if trace.duration_s > 0 else 0.0
    summaries = []
    for outcome in good:
        found = searches.get(outcome.summary.policy)
        best = found.best_scale if found is not None else None
        rps = best * base_rps if best is not None else None
        summaries.append(msgspec.structs.replace(outcome.summary, max_goodput_rps=rps))
    results: list[RequestResult] = []
    for outcome, summary in zip(good, summaries, strict=True):
        if not outcome.results:
            continue
        label = run_label(summary, summaries)
        results.extend(msgspec.structs.replace(r, policy=label) for r in outcome.results)
    failures = [o.failure for o in outcomes if o.failure is not None]
    return Simulation(Summary(summaries), results, outcomes, searches, failures)


def describe(trace: Trace, runs: Sequence[PolicyRun], simulation: Simulation) -> list[str]:
    """The report's notes: what was simulated, how, the searches, failures and the cost."""
    if not runs:
        return []
    config = runs[0].config
    spine = f", a {config.spine_gbps:g} Gb/s spine" if config.spine_gbps is not None else ""
    chunked = config.chunked_prefill if config.chunked_prefill is not None else "off"
    notes = [
        f"Discrete-event simulation of {trace.name} ({trace.num_turns} turns, "
        f"{len(trace.conversations)} sessions) on {config.cluster}: the simulated workers' "
        f"engine (step noise sigma {config.noise_sigma:g}, seed {config.seed} + worker index, "
        f"max_num_seqs {config.max_num_seqs}, max_num_batched_tokens "
        f"{config.max_num_batched_tokens}, chunked prefill {chunked}), "
        f"{config.nic_gbps:g} Gb/s NICs{spine}.",
        f"Simulated router: worker load scraped every {config.scrape_interval_s * 1000:g} ms, "
        f"{config.router_overhead_s * 1000:g} ms of router overhead per leg, first-token "
        f"convention {config.first_token!r}, link reservations leased "
        f"{config.reservation_lease_s:g} s.",
    ]
    notes += [f"{run.policy}: workers {_roles_text(run.config.roles)}" for run in runs]
    for policy, found in simulation.searches.items():
        probes = ", ".join(f"{p.rate_scale:.4g}x {p.attainment:.1%}" for p in found.probes)
        best = "none" if found.best_scale is None else f"{found.best_scale:.4g}x"
        above = "none" if found.failing_scale is None else f"{found.failing_scale:.4g}x"
        notes.append(
            f"max goodput search for {policy} (target {GOODPUT_TARGET:.0%} good): highest "
            f"passing scale {best}, lowest failing above it {above}; probes: {probes}"
        )
    dropped = [o.summary for o in simulation.outcomes if not o.results and o.summary.requests]
    if dropped:
        notes.append(
            f"Per-request records kept for each search's final bracket only: {len(dropped)} "
            "probes have their summary here and no records (--keep-all-requests keeps them)."
        )
    notes += [f"FAILED: {failure.describe()}" for failure in simulation.failures]
    events = sum(o.stats.events for o in simulation.outcomes)
    cpu = sum(o.stats.cpu_s for o in simulation.outcomes)
    turns = sum(o.summary.requests for o in simulation.outcomes)  # records may be dropped
    if cpu > 0:
        notes.append(
            f"Simulation cost: {len(simulation.outcomes)} runs, {turns} turns, {events} events "
            f"in {cpu:.1f} CPU s ({turns / cpu:.0f} turns and {events / cpu:.0f} events per "
            "CPU second)."
        )
    return notes


def _roles_text(roles: Sequence[str]) -> str:
    counts = {role: roles.count(role) for role in ("prefill", "decode", "mixed")}
    return " + ".join(f"{n} {role}" for role, n in counts.items() if n)


def write_outputs(
    out_dir: Path, trace: Trace, runs: Sequence[PolicyRun], simulation: Simulation
) -> None:
    """The run outputs (`bench.results.outputs`), plus failures.json when a policy failed."""
    cluster = runs[0].config.cluster if runs else ""
    title = f"Simulated replay of {trace.name} on {cluster}"
    write_run_outputs(
        out_dir, simulation.summary, simulation.results, title, describe(trace, runs, simulation)
    )
    failures = out_dir / "failures.json"
    if simulation.failures:
        failures.write_bytes(msgspec.json.format(msgspec.json.encode(simulation.failures)))
    else:
        failures.unlink(missing_ok=True)
