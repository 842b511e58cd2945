"""The live acceptance's plan: which stacks each variant's search or probes start (nothing
runs); and the fixed-rate probes' table."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from bench.compare import plan
from bench.layout import ClusterSpec
from bench.metrics import MissCauses
from bench.scripts.acceptance_workloads import variants
from bench.scripts.live_acceptance import (
    Probe,
    _parser,
    _stacks,
    chosen,
    render_probes,
    spec_of,
    stack_of,
    workloads,
)

CLUSTER = ClusterSpec.parse("4xh200-sxm/llama-3.1-8b")
ALL = variants([1, 2], [256, 1024], split=False)


@pytest.mark.parametrize(
    ("label", "policy", "roles", "params"),
    [
        ("colocate", "colocate", ("mixed",) * 4, ()),
        ("round-robin", "round-robin", ("prefill", "decode", "decode", "decode"), ()),
        ("disaggregate K=2", "disaggregate", ("prefill", "prefill", "decode", "decode"), ()),
        ("threshold 256", "threshold", ("prefill", "decode", "decode", "decode"),
         (("threshold", "256"),)),
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
    assert [v.label for v in chosen(ALL, "colocate, threshold 1024")] == [
        "colocate", "threshold 1024", "adaptive"
    ]  # fmt: skip
    assert chosen(ALL, "") == ALL
    with pytest.raises(SystemExit, match="unknown variants"):
        chosen(ALL, "disaggregate K=9")


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
        ("azure-conv", 1.0), ("p16384-g512-multi-turn-t4", 1.0), ("mixed-multi-turn", 1.2)
    ]  # fmt: skip
    klass = chosen_workloads[1].source.at(1.0)
    assert {len(c.turns) for c in klass.conversations} == {4}
    with pytest.raises(SystemExit, match="unknown class"):
        workloads(_parser().parse_args(["--traces", "", "--classes", "p1-g1-none"]))


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
        "2xh200-sxm/llama-3.1-8b", "--variants", "threshold 1024", "--scheduling-policy", "fcfs",
        "--out", str(tmp_path),
    ])  # fmt: skip
    planned = [(w.name, v.label, stack) for w, v, _, stack in _stacks(args)]
    assert [(name, label) for name, label, _ in planned] == [
        ("p4096-g512-none", "threshold 1024"), ("p4096-g512-none", "adaptive"),
        ("p16384-g64-none", "threshold 1024"), ("p16384-g64-none", "adaptive"),
    ]  # fmt: skip
    assert {stack.scheduling_policy for _, _, stack in planned} == {"fcfs"}
    assert planned[0][2].log_dir == str(tmp_path / "p4096-g512-none/threshold-1024/logs/threshold")
