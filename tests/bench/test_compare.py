"""`bench compare`: one report for several policies, fail-fast validation, worker layouts."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from bench.cli_live import _params_by_policy
from bench.compare import CompareSpec, compare, comparison_table, plan, roles_for
from bench.results.outputs import read_requests
from bench.results.summary import read_summary
from bench.stack.layout import ClusterSpec
from bench.traces.model import write_native
from bench.traces.workloads import ArrivalSpec, ThinkSpec, WorkloadSpec, generate_matrix
from policies import PolicyConfigError, available_policies, create_policy
from session_router_cli import main

TWO_GPUS = ClusterSpec(2, "h200-sxm", "llama-3.1-8b")
TINY = WorkloadSpec(
    name="tiny", prompt_tokens=(256, 2048), output_tokens=(8,), reuse=("none", "multi-turn"),
    turns=(2,), sessions_per_class=1, arrival=ArrivalSpec(rate_rps=20.0),
    think=ThinkSpec(distribution="fixed", mean_s=0.05),
)  # fmt: skip


async def test_two_baselines_one_report(tmp_path: Path) -> None:
    trace = generate_matrix(TINY)
    assert trace.num_turns == 6
    spec = CompareSpec(policies=("colocate", "disaggregate"), cluster=TWO_GPUS)
    summary = await compare(trace, spec, tmp_path)

    assert read_summary(tmp_path / "summary.json") == summary
    assert [(r.policy, r.requests, r.completed) for r in summary.runs] == [
        ("colocate", 6, 6), ("disaggregate", 6, 6)]  # fmt: skip
    assert summary.runs[0].actions == {"colocate": 6}
    assert summary.runs[1].actions == {"handoff": 6}
    assert summary.runs[0].transferred_bytes == 0 < summary.runs[1].transferred_bytes
    rows = read_requests(tmp_path / "requests.jsonl")
    assert [r.policy for r in rows] == ["colocate"] * 6 + ["disaggregate"] * 6
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# bench compare: tiny on 2xh200-sxm/llama-3.1-8b\n")
    assert (
        "| colocate | 1x | 6 | 6 | 0 | 0 |" in md and "| disaggregate | 1x | 6 | 6 | 0 | 0 |" in md
    )
    assert "colocate: workers 2 mixed; router stage events joined for 6 of 6" in md
    assert "disaggregate: workers 1 prefill + 1 decode; router stage events joined" in md
    for policy in ("colocate", "disaggregate"):
        logs = tmp_path / "logs" / policy
        assert {p.name for p in logs.iterdir()} == {"events.jsonl", "router.log", "workers.log"}
    for name in ("ttft_cdf.png", "itl_cdf.png", "slo_by_class.png", "decisions.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_unknown_policy_fails_fast_with_the_registry_message(tmp_path: Path) -> None:
    with pytest.raises(PolicyConfigError) as expected:
        create_policy("nope")
    spec = CompareSpec(policies=("colocate", "nope"), cluster=TWO_GPUS)
    with pytest.raises(PolicyConfigError) as raised:
        plan(spec, tmp_path)
    assert str(raised.value) == str(expected.value)
    assert list(tmp_path.iterdir()) == []


def test_command_line_rejects_bad_input_before_starting_anything(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    write_native(generate_matrix(TINY), trace)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as raised:
        main(["bench", "compare", str(trace), "--policies", "colocate,nope", "--out", str(out)])
    assert str(raised.value).startswith("session-router bench compare: unknown policy 'nope'")
    with pytest.raises(SystemExit) as raised:
        main(["bench", "compare", str(trace), "--cluster", "4h200", "--out", str(out)])
    assert "cluster must look like 8xh200-sxm/llama-3.1-8b" in str(raised.value)
    with pytest.raises(SystemExit) as raised:
        main(["bench", "compare", str(trace), "--policies", "colocate",
              "--policy-param", "threshold:threshold=5", "--out", str(out)])  # fmt: skip
    assert "parameters given for 'threshold', which is not being compared" in str(raised.value)
    with pytest.raises(SystemExit) as raised:
        main(["bench", "compare", str(trace), "--policies", "threshold",
              "--policy-param", "threshold:nope=5", "--out", str(out)])  # fmt: skip
    assert "policy 'threshold': unknown parameter 'nope'" in str(raised.value)
    with pytest.raises(SystemExit) as raised:
        main(["bench", "compare", str(trace), "--find-max-goodput", "--goodput-tolerance", "0",
              "--out", str(out)])  # fmt: skip
    assert "goodput_tolerance must be > 0" in str(raised.value)
    assert not out.exists()


@pytest.mark.parametrize(
    ("policy", "workers", "prefill", "expected"),
    [
        ("colocate", 4, None, ["mixed"] * 4),
        ("disaggregate", 4, None, ["prefill"] + ["decode"] * 3),
        ("threshold", 4, 2, ["prefill"] * 2 + ["decode"] * 2),
        ("round-robin", 8, None, ["prefill"] * 2 + ["decode"] * 6),
        ("some-plugin", 3, None, ["prefill"] + ["decode"] * 2),
    ],
)
def test_roles(policy: str, workers: int, prefill: int | None, expected: list[str]) -> None:
    assert roles_for(policy, workers, prefill) == expected


@pytest.mark.parametrize(("workers", "prefill"), [(1, None), (4, 0), (4, 4)])
def test_split_needs_both_roles(workers: int, prefill: int | None) -> None:
    with pytest.raises(ValueError, match="splits prefill from decode"):
        roles_for("disaggregate", workers, prefill)


def test_policy_params_by_policy() -> None:
    assert _params_by_policy(["threshold:threshold=512", "a:x=1", "a:y=2"]) == {
        "threshold": {"threshold": "512"}, "a": {"x": "1", "y": "2"}}  # fmt: skip
    for bad in (["threshold=5"], ["threshold:threshold"], [":x=1"], ["a:x=1", "a:x=2"]):
        with pytest.raises(ValueError):
            _params_by_policy(bad)


@pytest.mark.skipif("adaptive" not in available_policies(), reason="adaptive not registered")
def test_adaptive_gets_the_clusters_hardware(tmp_path: Path) -> None:
    [stack] = plan(CompareSpec(policies=("adaptive",), cluster=TWO_GPUS), tmp_path)
    params = dict(stack.policy_params)
    assert (params["gpu"], params["model"], params["tp"]) == ("h200-sxm", "llama-3.1-8b", "1")
    assert stack.roles == ("mixed", "mixed")  # it splits a turn only when that pays
    [split] = plan(CompareSpec(policies=("adaptive",), cluster=TWO_GPUS, prefill_workers=1),
                   tmp_path)  # fmt: skip
    assert split.roles == ("prefill", "decode")


def test_comparison_table_has_a_column_per_run(tmp_path: Path) -> None:
    from bench.results.summary import Summary, summarise

    summary = Summary([summarise([], "colocate", 1.0, 1.0, "decode"),
                       summarise([], "threshold", 1.0, 1.0, "decode")])  # fmt: skip
    console = Console(record=True, width=160)
    console.print(comparison_table(summary))
    text = console.export_text()
    assert "colocate" in text and "threshold" in text and "SLO attainment" in text
    assert [column.header for column in comparison_table(summary).columns] == [
        "", "colocate", "threshold"]  # fmt: skip


async def test_a_stop_before_the_first_policy_still_writes_a_report(tmp_path: Path) -> None:
    import asyncio

    stop = asyncio.Event()
    stop.set()
    spec = CompareSpec(policies=("colocate", "disaggregate"), cluster=TWO_GPUS)
    summary = await compare(generate_matrix(TINY), spec, tmp_path, stop=stop)
    assert summary.runs == []
    md = (tmp_path / "report.md").read_text()
    assert "- not run (stopped): colocate, disaggregate" in md
    assert "No runs were recorded." in md


async def test_max_goodput_search_probes_fresh_runs_until_the_bracket_closes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The live search's wiring: probes at the scales the search asks for, each probe's runs
    labelled by its scale, `max_goodput_rps` from the slice's arrival rate."""
    import asyncio

    import bench.compare as compare_module
    from bench.compare import ComparedRun
    from bench.results.summary import RequestResult, summarise
    from bench.stack.up import StackSpec
    from bench.traces.model import Trace

    capacity = {"colocate": 3.0, "disaggregate": 1.5}  # the scale each policy just sustains
    probed: list[tuple[str, float]] = []

    async def fake_run(
        trace: Trace, spec: CompareSpec, stack: StackSpec, progress: bool,
        stop: asyncio.Event | None,
    ) -> ComparedRun:  # fmt: skip
        probed.append((stack.policy, spec.rate_scale))
        late = spec.rate_scale > capacity[stack.policy]
        results = [
            RequestResult(request_id=f"r{i}", session_id=f"s{i}", turn_index=0, klass="k",
                          policy=stack.policy, sent_at=float(i),
                          first_chunk_at=i + (60.0 if late else 0.1),
                          chunk_times=[i + 0.2], done_at=i + 61.0, status="completed",
                          http_status=200, prompt_tokens=100, completion_tokens=2)
            for i in range(10)
        ]  # fmt: skip
        summary = summarise(results, stack.policy, spec.rate_scale, 10.0, "decode")
        return ComparedRun(summary, results, ())

    monkeypatch.setattr(compare_module, "run_policy", fake_run)
    trace = generate_matrix(TINY)
    spec = CompareSpec(policies=("colocate", "disaggregate"), cluster=TWO_GPUS,
                       find_max_goodput=True, goodput_tolerance=0.1)  # fmt: skip
    summary = await compare(trace, spec, tmp_path)

    scales = {p: [s for q, s in probed if q == p] for p in capacity}
    assert scales["colocate"][:3] == [1.0, 2.0, 4.0]  # doubling until a probe fails
    assert scales["disaggregate"][:2] == [1.0, 2.0]
    base_rps = trace.num_turns / trace.duration_s
    for policy, cap in capacity.items():
        runs = [r for r in summary.runs if r.policy == policy]
        assert len(runs) == len(scales[policy])
        best = max(s for s in scales[policy] if s <= cap)
        assert all(r.max_goodput_rps == pytest.approx(best * base_rps) for r in runs)
        assert cap / best <= 1.1  # bisected to the tolerance
        assert min(s for s in scales[policy] if s > cap) / best <= 1.1
    labels = {r.policy for r in read_requests(tmp_path / "requests.jsonl")}
    assert "colocate@4x" in labels and "disaggregate@1x" in labels
    md = (tmp_path / "report.md").read_text()
    assert "max goodput search for colocate (target 90% good), live: highest passing" in md
