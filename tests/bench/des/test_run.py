"""`bench simulate`: sweeps, the max-goodput search, failing policies, the command line."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from bench.des import SimConfig, simulate
from bench.results.summary import read_summary
from bench.simulate import plan_runs, run_simulation
from bench.stack.layout import ClusterSpec, worker_roles
from bench.traces.model import write_native
from bench.traces.workloads import ArrivalSpec, WorkloadSpec, generate_matrix
from policies.params import NoParams
from policies.types import ClusterView, Colocate, Decision, Outcome, Turn
from session_router_cli import main

SPEC = WorkloadSpec(
    name="tiny", prompt_tokens=(256, 2048), output_tokens=(32,), reuse=("none", "multi-turn"),
    turns=(2,), sessions_per_class=6, arrival=ArrivalSpec(rate_rps=3.0),
)  # fmt: skip


def template(workers: int = 2) -> SimConfig:
    cluster = ClusterSpec(workers, "h200-sxm", "llama-3.1-8b")
    return SimConfig(cluster=cluster, roles=tuple(worker_roles("colocate", workers)))


class RaisingPolicy:
    """Colocates on w0 and raises on its third decision (or on its second outcome)."""

    name = "raising"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
        stage: str = "decide"

    def __init__(self, params: RaisingPolicy.Params | None = None) -> None:
        self.stage = params.stage if params is not None else "decide"
        self.decisions = 0
        self.outcomes = 0

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        self.decisions += 1
        if self.stage == "decide" and self.decisions == 3:
            raise ZeroDivisionError("broken estimate")
        return Colocate(worker="w0")

    def observe(self, outcome: Outcome) -> None:
        self.outcomes += 1
        if self.stage == "observe" and self.outcomes == 2:
            raise KeyError("no such worker")


class StrayPolicy:
    """Names a worker the cluster does not have."""

    name = "stray"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        pass

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        return Colocate(worker="gpu-99")

    def observe(self, outcome: Outcome) -> None:
        pass


RAISING = f"{__name__}:RaisingPolicy"


class OnW0:
    """What RaisingPolicy does until it raises, keeping the order of calls."""

    name = "on-w0"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.decided: list[tuple[str, float]] = []
        self.observed: list[str] = []

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        self.decided.append((turn.request_id, turn.arrival_s))
        return Colocate(worker="w0")

    def observe(self, outcome: Outcome) -> None:
        self.observed.append(outcome.request_id)


@pytest.mark.parametrize(
    ("spec", "params", "stage", "error"),
    [
        (RAISING, {}, "decide", "ZeroDivisionError: broken estimate"),
        (RAISING, {"stage": "observe"}, "observe", "KeyError: 'no such worker'"),
        (f"{__name__}:StrayPolicy", {}, "decision", "'gpu-99', not in the cluster"),
    ],
)
def test_a_failing_policy_is_reported_and_the_other_runs_go_on(
    spec: str, params: dict[str, str], stage: str, error: str
) -> None:
    trace = generate_matrix(SPEC)
    runs = plan_runs(["colocate", spec], template(), params={spec: params} if params else None)
    simulation = run_simulation(trace, runs, jobs=1)
    [failure] = simulation.failures
    assert (failure.policy, failure.stage) == (spec, stage)
    assert error in failure.error
    if stage != "decision":  # where the policy raised
        assert failure.traceback.startswith("Traceback") and "line" in failure.traceback
    reference = OnW0()
    simulate(trace, reference, runs[1].config)
    request_id, time_s = {"decide": reference.decided[2], "decision": reference.decided[0]}.get(
        stage, (reference.observed[1], failure.time_s)
    )
    assert (failure.request_id, failure.time_s) == (request_id, time_s)
    assert failure.session_id == request_id.split("#")[0]
    assert [run.policy for run in simulation.summary.runs] == ["colocate"]
    assert {r.policy for r in simulation.results} == {"colocate"}


def test_max_goodput_search_finds_a_passing_rate_with_a_failing_one_just_above() -> None:
    trace = generate_matrix(msgspec.structs.replace(SPEC, reuse=("none",)))
    runs = plan_runs(["colocate"], template(workers=1))
    simulation = run_simulation(trace, runs, find_max_goodput=True, jobs=1)
    found = simulation.searches["colocate"]
    assert found.best_scale is not None and found.failing_scale is not None
    assert found.best_scale < found.failing_scale <= found.best_scale * 1.05
    by_scale = {run.rate_scale: run for run in simulation.summary.runs}
    assert len(by_scale) == len(found.probes) == len(simulation.summary.runs)
    assert by_scale[found.best_scale].slo_attainment >= 0.9
    assert by_scale[found.failing_scale].slo_attainment < 0.9
    base_rps = trace.num_turns / trace.duration_s
    assert {run.max_goodput_rps for run in by_scale.values()} == {found.best_scale * base_rps}
    assert sorted(by_scale) == [run.rate_scale for run in simulation.summary.runs]


@pytest.mark.parametrize("keep_all", [False, True])
def test_a_search_keeps_records_of_its_final_bracket_unless_asked(keep_all: bool) -> None:
    trace = generate_matrix(msgspec.structs.replace(SPEC, reuse=("none",)))
    runs = plan_runs(["colocate"], template(workers=1))
    simulation = run_simulation(
        trace, runs, find_max_goodput=True, jobs=1, tolerance=0.2, keep_all_requests=keep_all
    )
    found = simulation.searches["colocate"]
    assert len(simulation.summary.runs) == len(found.probes) > 2  # every probe's summary
    recorded = {o.summary.rate_scale for o in simulation.outcomes if o.results}
    probed = {p.rate_scale for p in found.probes}
    assert recorded == (probed if keep_all else {found.best_scale, found.failing_scale})
    assert len(simulation.results) == trace.num_turns * len(recorded)


def test_find_max_goodput_needs_an_open_loop_trace() -> None:
    trace = generate_matrix(msgspec.structs.replace(SPEC, arrival=ArrivalSpec("concurrency")))
    with pytest.raises(ValueError, match="open-loop"):
        run_simulation(trace, plan_runs(["colocate"], template()), find_max_goodput=True, jobs=1)


def test_closed_loop_keeps_the_concurrency() -> None:
    trace = generate_matrix(
        msgspec.structs.replace(SPEC, arrival=ArrivalSpec("concurrency", concurrency=2))
    )
    simulation = run_simulation(trace, plan_runs(["colocate"], template()), jobs=1)
    results = sorted(simulation.results, key=lambda r: r.sent_at)
    assert len(results) == trace.num_turns
    for result in results:
        assert result.done_at is not None
        in_flight = sum(1 for r in results if r.sent_at <= result.sent_at < (r.done_at or 0))
        assert in_flight <= 2


def cli(trace: Path, out: Path, *extra: str) -> int:
    return main(["bench", "simulate", str(trace), "--cluster", "2xh200-sxm/llama-3.1-8b",
                 "--out", str(out), "--no-progress", *extra])  # fmt: skip


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.jsonl"
    write_native(generate_matrix(SPEC), path)
    return path


def test_the_same_seed_writes_the_same_summary_in_one_process_or_many(
    trace_file: Path, tmp_path: Path
) -> None:
    args = ("--policies", "colocate,disaggregate,threshold", "--rate-scale", "1,3", "--seed", "7")
    assert cli(trace_file, tmp_path / "a", *args, "--jobs", "1") == 0
    assert cli(trace_file, tmp_path / "b", *args, "--jobs", "3") == 0
    for name in ("summary.json", "requests.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    summary = read_summary(tmp_path / "a" / "summary.json")
    assert [(r.policy, r.rate_scale) for r in summary.runs] == [
        (p, s) for p in ("colocate", "disaggregate", "threshold") for s in (1.0, 3.0)
    ]
    assert {r.requests for r in summary.runs} == {generate_matrix(SPEC).num_turns}
    report = (tmp_path / "a" / "report.md").read_text()
    assert "1000 ms + 0.2 ms per prompt token" in report and "1 prefill + 1 decode" in report
    assert not (tmp_path / "a" / "failures.json").exists()


def test_the_command_exits_non_zero_naming_the_failing_policy(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli(trace_file, tmp_path / "out", "--policies", f"colocate,{RAISING}", "--jobs", "1")
    assert code == 1
    err = capsys.readouterr().err
    assert f"policy '{RAISING}' failed in decide for request" in err
    assert "ZeroDivisionError: broken estimate" in err
    failures = msgspec.json.decode((tmp_path / "out" / "failures.json").read_bytes())
    assert [f["policy"] for f in failures] == [RAISING]
    assert [r.policy for r in read_summary(tmp_path / "out" / "summary.json").runs] == ["colocate"]
    assert "FAILED: policy" in (tmp_path / "out" / "report.md").read_text()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--policies", "nope"), "unknown policy 'nope'"),
        (("--cluster", "8h200"), "cluster must look like"),
        (("--policy-param", "threshold:threshold=1"), "not being simulated"),
        (("--policies", "threshold", "--policy-param", "threshold:depth=1"), "unknown parameter"),
        (("--policies", "disaggregate", "--prefill-workers", "2"), "prefill workers"),
    ],
)
def test_bad_arguments_exit_2(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    extra: tuple[str, ...], message: str,
) -> None:  # fmt: skip
    args = ("--policies", "colocate", *extra) if "--policies" not in extra else extra
    assert cli(trace_file, tmp_path / "out", *args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
