"""The live acceptance's plan: which stacks each variant's search or probes start (nothing
runs); and the fixed-rate probes' table."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from bench.compare import plan
from bench.results.summary import MissCauses, RunSummary, summarise
from bench.stack.layout import ClusterSpec
from bench.stack.up import StackSpec
from experiments.acceptance_grid import variants
from experiments.acceptance_verdicts import render, verdict
from experiments.acceptance_workloads import Measured, Offered, Verdict, Workload
from experiments.live_acceptance import (
    Probe,
    _parser,
    _stacks,
    chosen,
    main,
    render_probes,
    screen,
    spec_of,
    stack_of,
    workloads,
)

CLUSTER = ClusterSpec.parse("4xh200-sxm/llama-3.1-8b")
ALL = variants([1, 2], [256, 1024])


@pytest.mark.parametrize(
    ("label", "policy", "roles", "params"),
    [
        ("colocate", "colocate", ("mixed",) * 4, ()),
        ("round-robin", "round-robin", ("prefill", "decode", "decode", "decode"), ()),
        ("disaggregate K=2", "disaggregate", ("prefill", "prefill", "decode", "decode"), ()),
        ("threshold 256 K=1", "threshold", ("prefill", "decode", "decode", "decode"),
         (("threshold", "256"),)),
        ("threshold 1024 K=2", "threshold", ("prefill", "prefill", "decode", "decode"),
         (("threshold", "1024"),)),
        ("adaptive", "adaptive", ("mixed",) * 4, None),
    ],
)  # fmt: skip
def test_each_variant_searches_its_own_policy_layout_and_parameters(
    label: str, policy: str, roles: tuple[str, ...], params: tuple[tuple[str, str], ...] | None,
    tmp_path: Path,
) -> None:  # fmt: skip
    (variant,) = [v for v in ALL if v.label == label]
    spec = spec_of(variant, CLUSTER, tolerance=0.1)
    assert spec.policies == (policy,) and spec.goodput_tolerance == 0.1
    (stack,) = plan(spec, tmp_path)
    assert stack.policy == policy
    assert stack.roles == roles
    if params is not None:  # adaptive's priors come from the cluster: only what was given
        assert stack.policy_params == params


def test_chosen_variants_keep_adaptive_and_refuse_unknown_labels() -> None:
    assert [v.label for v in chosen(ALL, "colocate, threshold 1024 K=2")] == [
        "colocate", "threshold 1024 K=2", "adaptive"
    ]  # fmt: skip
    assert chosen(ALL, "") == ALL
    with pytest.raises(SystemExit, match="unknown variants"):
        chosen(ALL, "disaggregate K=9")


# the shared traces lie beside the checkout (../shared/traces), in CI as here
SHARED_TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"


def test_workloads_are_the_named_traces_then_the_named_matrix_classes(tmp_path: Path) -> None:
    (tmp_path / "azure2023_AzureLLMInferenceTrace_conv.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n"
    )
    args = _parser().parse_args([
        "--traces-dir", str(tmp_path), "--traces", "azure-conv",
        "--classes", "p16384-g512-multi-turn-t4, mixed-multi-turn",
    ])  # fmt: skip
    chosen_workloads = workloads(args)
    assert [(w.name, w.needs) for w in chosen_workloads] == [
        ("azure-conv", 1.3), ("p16384-g512-multi-turn-t4", 1.0), ("mixed-multi-turn", 1.3)
    ]  # fmt: skip
    klass = chosen_workloads[1].source.at(1.0)
    assert {len(c.turns) for c in klass.conversations} == {4}
    with pytest.raises(SystemExit, match="unknown class"):
        workloads(_parser().parse_args(["--traces", "", "--classes", "p1-g1-none"]))


@pytest.mark.skipif(not SHARED_TRACES.exists(), reason="shared traces not mounted")
def test_non_stationary_workloads_come_after_the_classes_with_the_multi_turn_bar() -> None:
    args = _parser().parse_args([
        "--traces-dir", str(SHARED_TRACES), "--traces", "", "--classes", "mixed-multi-turn",
        "--nonstationary", "mix-shift,stitched", "--span-s", "40",
    ])  # fmt: skip
    chosen_workloads = workloads(args)
    assert [(w.name, w.needs) for w in chosen_workloads] == [
        ("mixed-multi-turn", 1.3), ("mix-shift", 1.3), ("stitched", 1.3)
    ]  # fmt: skip
    # two cycles of a long-prompt then a long-answer phase over the probe's span
    shift = chosen_workloads[1].source.at(1.0)
    assert max(c.turns[0].arrival_s for c in shift.conversations) <= 40.0
    with pytest.raises(SystemExit, match="unknown non-stationary workload"):
        workloads(_parser().parse_args(["--traces", "", "--nonstationary", "mix-shift,calm"]))


@pytest.mark.parametrize("scheduling", ["priority", "fcfs"])
def test_probes_start_engines_that_schedule_as_asked(scheduling: str, tmp_path: Path) -> None:
    (variant,) = [v for v in ALL if v.label == "adaptive"]
    stack = stack_of(spec_of(variant, CLUSTER, tolerance=0.1), tmp_path, scheduling)
    assert stack.scheduling_policy == scheduling
    assert stack.roles == ("mixed",) * 4


def test_an_unknown_scheduling_policy_is_refused(tmp_path: Path) -> None:
    (variant,) = [v for v in ALL if v.label == "colocate"]
    with pytest.raises(ValueError, match="priority or fcfs"):
        stack_of(spec_of(variant, CLUSTER, tolerance=0.1), tmp_path, "lifo")


def test_fixed_rate_probes_parse_and_render_why_requests_missed() -> None:
    args = _parser().parse_args(["--at", "3.364, 3.668", "--scheduling-policy", "fcfs"])
    assert args.at == (3.364, 3.668) and args.scheduling_policy == "fcfs"
    assert _parser().parse_args([]).at == ()
    probe = Probe(
        workload="p4096-g512-multi-turn-t4", variant="adaptive", rate_scale=3.364, turns=272,
        rps=13.8, attainment=0.835, ttft_p90_ms=5935.0,
        misses=MissCauses(ttft_late=43, ttft_late_foreseen=16, itl_over=2),
    )  # fmt: skip
    unmeasured = msgspec.structs.replace(probe, variant="round-robin", ttft_p90_ms=None)
    lines = render_probes([probe, unmeasured], "cmd").splitlines()
    assert "Command: `cmd`" in lines
    assert lines[-2] == (
        "| p4096-g512-multi-turn-t4 | adaptive | 3.364x | 272 | 13.8 | 83.5% | 43 (16) | 2 | 0 "
        "| 0 | 5935 |"
    )
    assert lines[-1].endswith(
        "| round-robin | 3.364x | 272 | 13.8 | 83.5% | 43 (16) | 2 | 0 | 0 | - |"
    )


def test_each_named_workload_gets_each_chosen_variants_stack(tmp_path: Path) -> None:
    args = _parser().parse_args([
        "--traces", "", "--classes", "p4096-g512-none, p16384-g64-none", "--cluster",
        "2xh200-sxm/llama-3.1-8b", "--variants", "threshold 1024 K=1", "--scheduling-policy",
        "fcfs", "--out", str(tmp_path),
    ])  # fmt: skip
    planned = [(w.name, v.label, stack) for w, v, _, stack in _stacks(args)]
    assert [(name, label) for name, label, _ in planned] == [
        ("p4096-g512-none", "threshold 1024 K=1"), ("p4096-g512-none", "adaptive"),
        ("p16384-g64-none", "threshold 1024 K=1"), ("p16384-g64-none", "adaptive"),
    ]  # fmt: skip
    assert {stack.scheduling_policy for _, _, stack in planned} == {"fcfs"}
    logs = tmp_path / "p4096-g512-none/threshold-1024-K1/logs/threshold"
    assert planned[0][2].log_dir == str(logs)


def test_splits_that_leave_no_decode_worker_are_not_planned(tmp_path: Path) -> None:
    """The default splits (1, 2) on 2 workers: disaggregate K=2 would leave no decode worker
    (its stack refused to start, ending the whole run after adaptive's search)."""
    args = _parser().parse_args([
        "--traces", "", "--classes", "p4096-g512-none", "--cluster", "2xh200-sxm/llama-3.1-8b",
        "--out", str(tmp_path),
    ])  # fmt: skip
    labels = [v.label for _, v, _, _ in _stacks(args)]
    assert "disaggregate K=1" in labels and "disaggregate K=2" not in labels


def _summary(scale: float, attainment: float) -> RunSummary:
    empty = summarise([], "threshold", scale, 20.0, "decode")
    return msgspec.structs.replace(empty, slo_attainment=attainment)


def _adaptive(best: float | None, rps: float) -> Measured:
    return Measured(label="adaptive", best_scale=best, failing_scale=None if best is None else
                    best * 1.1, max_goodput_rps=rps, probes=[], best=None)  # fmt: skip


def _class(name: str, tmp_path: Path) -> Workload:
    args = _parser().parse_args(["--traces", "", "--classes", name, "--out", str(tmp_path)])
    (workload,) = workloads(args)
    return workload


@pytest.mark.parametrize(
    ("workload_name", "attainment", "probed_at", "screened"),
    [
        ("p4096-g64-none", 0.60, 4.0, True),  # fails where adaptive passed: bounded
        ("p4096-g64-none", 0.95, 4.0, False),  # passes there: it needs a search
        ("mixed-multi-turn", 0.80, 4.0 / 1.3, True),  # probed at adaptive's over the 1.3 needed
    ],
)  # fmt: skip
async def test_a_screen_probes_a_baseline_once_at_adaptives_max_over_the_needs(
    workload_name: str, attainment: float, probed_at: float, screened: bool, tmp_path: Path
) -> None:  # fmt: skip
    workload = _class(workload_name, tmp_path)
    (variant,) = [v for v in ALL if v.label == "threshold 256 K=1"]
    spec = spec_of(variant, CLUSTER, tolerance=0.1)
    stack = stack_of(spec, tmp_path, "priority")
    probed: list[float] = []

    async def run(
        source: object, label: str, spec_: object, stack_: StackSpec, scale: float
    ) -> tuple[RunSummary, int, float]:
        assert label == "threshold 256 K=1" and stack_ is stack
        probed.append(scale)
        return _summary(scale, attainment), 300, 7.5 * scale

    found = await screen(workload.source, variant, spec, stack, _adaptive(4.0, 30.0),
                         workload.needs, run)  # fmt: skip
    assert probed == [pytest.approx(probed_at)]
    if not screened:
        assert found is None
        return
    assert found is not None and found.screened
    assert found.best_scale is None and found.failing_scale == pytest.approx(probed_at)
    assert found.max_goodput_rps == pytest.approx(7.5 * probed_at)  # the probe's own rate
    assert found.probes == [Offered(probed_at, attainment, 300, 7.5 * probed_at)]


async def test_no_screen_when_adaptive_passed_nowhere(tmp_path: Path) -> None:
    workload = _class("p4096-g64-none", tmp_path)
    (variant,) = [v for v in ALL if v.label == "colocate"]
    spec = spec_of(variant, CLUSTER, tolerance=0.1)

    async def run(*_: object) -> tuple[RunSummary, int, float]:
        raise AssertionError("nothing to screen against: no probe")

    stack = stack_of(spec, tmp_path, "priority")
    assert await screen(workload.source, variant, spec, stack, _adaptive(None, 0.0), 1.0,
                        run) is None  # fmt: skip


def test_a_screened_baseline_is_beaten_by_construction_and_reported_as_a_bound(
    tmp_path: Path,
) -> None:
    workload = _class("mixed-multi-turn", tmp_path)
    adaptive = _adaptive(4.0, 11.9)
    # failed at 4 / 1.3: its rate there (10.0, generated arrivals vary) bounds its max goodput
    screened = Measured(label="colocate", best_scale=None, failing_scale=4.0 / 1.3,
                        max_goodput_rps=10.0, probes=[], best=None, screened=True)  # fmt: skip
    alone = verdict(workload, [adaptive, screened])
    assert alone.baseline == "colocate" and alone.passed  # 11.9 / 10 < 1.3, yet beaten
    row = render([alone], "cmd", []).split("| mixed-multi-turn |")[1]
    assert "| colocate | <10 | 11.9 | >1.19 | pass |" in row
    # beside a searched baseline, that one is the best, even below the screened bound
    searched = Measured(label="round-robin", best_scale=2.0, failing_scale=2.2,
                        max_goodput_rps=6.0, probes=[], best=None)  # fmt: skip
    both = verdict(workload, [adaptive, screened, searched])
    assert (both.baseline, both.passed, both.ratio) == ("round-robin", True, 11.9 / 6.0)
    text = render([both], "cmd", [])
    assert "| mixed-multi-turn | 1.3x | round-robin | 6 | 11.9 | 1.98 | pass |" in text
    assert "mixed-multi-turn: adaptive 11.9, colocate <10, round-robin 6" in text
    # a searched baseline above adaptive's over the needs fails it
    better = msgspec.structs.replace(searched, max_goodput_rps=11.0)
    assert not verdict(workload, [adaptive, screened, better]).passed


def test_screening_searches_adaptive_first(tmp_path: Path) -> None:
    args = _parser().parse_args([
        "--traces", "", "--classes", "p4096-g512-none", "--cluster", "2xh200-sxm/llama-3.1-8b",
        "--variants", "colocate,threshold 1024 K=1", "--screen", "--out", str(tmp_path),
    ])  # fmt: skip
    labels = [v.label for _, v, _, _ in _stacks(args)]
    assert labels == ["adaptive", "colocate", "threshold 1024 K=1"]


def test_reused_searches_and_screens_are_not_run_again(tmp_path: Path) -> None:
    adaptive = _adaptive(4.0, 30.0)
    colocate = Measured(label="colocate", best_scale=None, failing_scale=4.0,
                        max_goodput_rps=30.0, probes=[], best=None, screened=True)  # fmt: skip
    earlier = [Verdict("p4096-g64-none", 1.0, "colocate", 30.0, 30.0, 1.0, True,
                       [adaptive, colocate])]  # fmt: skip
    (tmp_path / "earlier.json").write_bytes(msgspec.json.encode(earlier))
    out = tmp_path / "out"
    # every variant asked for was measured before: no stack starts (one would take minutes)
    assert (
        main(
            [
                "--traces",
                "",
                "--classes",
                "p4096-g64-none",
                "--variants",
                "colocate",
                "--screen",
                "--reuse",
                str(tmp_path / "earlier.json"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = (out / "live-acceptance.md").read_text()
    assert "| p4096-g64-none | 1x | colocate | <30 | 30 | >1.00 | pass |" in report
    again = msgspec.json.decode((out / "live-acceptance.json").read_bytes(), type=list[Verdict])
    assert again[0].measured == [adaptive, colocate]


def _children(pid: int) -> set[int]:
    found = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        found |= {int(c) for c in (task / "children").read_text().split()}
    return found


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
def test_sigterm_stops_the_run_and_every_process_its_stack_started(tmp_path: Path) -> None:
    run = subprocess.Popen(
        [sys.executable, "-m", "experiments.live_acceptance", "--traces", "", "--classes",
         "p4096-g64-none", "--cluster", "2xh200-sxm/llama-3.1-8b", "--splits", "1",
         "--variants", "colocate", "--out", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(started := _children(run.pid)) < 2:  # the simulated workers and the router
            assert run.poll() is None and time.monotonic() < deadline, "no stack started"
            time.sleep(0.2)
        descendants = started | {g for c in started for g in _children(c)}  # the router's Redis
        run.terminate()
        _, err = run.communicate(timeout=30)
    finally:
        run.kill()
    assert run.returncode == 130
    assert b"--reuse takes it up" in err
    deadline = time.monotonic() + 10
    while (left := {pid for pid in descendants if _alive(pid)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"left behind: {left}"
