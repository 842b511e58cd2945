"""What the simulator's acceptance of `adaptive` asks of each workload, and what its report
says where adaptive fell short."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from bench.des import SimConfig
from bench.simulate import run_one
from bench.stack.layout import ClusterSpec, worker_roles
from experiments.acceptance import (
    _init,
    _parser,
    _plan,
    _probe,
    main,
    matrix_spec,
    measure,
    reused,
    tune,
)
from experiments.acceptance_verdicts import render, verdict
from experiments.acceptance_workloads import (
    MULTI_TURN_NEEDS,
    REPLICA_SEED_STRIDE,
    Variant,
    matrix_workloads,
)

_SMALL = ["--cluster", "2xh200-sxm/llama-3.1-8b", "--prompts", "4096", "--outputs", "64",
          "--reuse", "none", "--class-turns", "60", "--span-s", "5"]  # fmt: skip


def test_single_classes_need_parity_and_the_multi_turn_mix_needs_more() -> None:
    args = _parser().parse_args(
        ["--prompts", "512", "--outputs", "64,512", "--reuse", "none,multi-turn"]
    )
    needs = {w.name: w.needs for w in matrix_workloads(matrix_spec(args), 40, 5.0)}
    assert needs == {
        "p512-g64-none": 1.0,
        "p512-g512-none": 1.0,
        "p512-g64-multi-turn-t4": 1.0,
        "p512-g512-multi-turn-t4": 1.0,
        "mixed-multi-turn": MULTI_TURN_NEEDS,
    }
    assert MULTI_TURN_NEEDS == 1.3


def test_the_report_says_why_adaptive_fell_short_where_it_failed() -> None:
    args = _parser().parse_args(_SMALL)
    workloads = matrix_workloads(matrix_spec(args), args.class_turns, args.span_s)
    cluster = ClusterSpec.parse(args.cluster)
    template = SimConfig(cluster=cluster, roles=tuple(worker_roles("colocate", cluster.workers)))
    contenders = [Variant("colocate", "colocate"), Variant("adaptive", "adaptive", mixed=True)]
    results = measure(workloads, contenders, template, jobs=1, tolerance=0.25)
    [verdict_] = [verdict(w, results[w.name]) for w in workloads]
    adaptive = next(m for m in verdict_.measured if m.label == "adaptive")
    assert adaptive.failing_scale is not None and adaptive.failing is not None
    assert adaptive.failing.rate_scale == adaptive.failing_scale
    assert adaptive.failing.slo_attainment < 0.9
    misses = adaptive.failing.misses
    assert misses is not None
    missed = misses.rejected + misses.failed + misses.ttft_late + misses.itl_over
    assert missed == adaptive.failing.requests - adaptive.failing.good > 0
    text = render([verdict_], "cmd", [])
    shortfall = text.split("## Where adaptive fell short", 1)[1]
    assert (f"| p4096-g64-none | {adaptive.failing_scale:.4g}x | "
            f"{adaptive.failing.slo_attainment:.2%} | {missed} of ") in shortfall  # fmt: skip


def test_a_probe_pools_the_attainment_of_its_replicas_each_with_its_own_seeds() -> None:
    args = _parser().parse_args(_SMALL)
    [workload] = matrix_workloads(matrix_spec(args), args.class_turns, args.span_s)
    cluster = ClusterSpec.parse(args.cluster)
    template = SimConfig(cluster=cluster, roles=tuple(worker_roles("colocate", cluster.workers)))
    run = _plan(Variant("colocate", "colocate"), template)
    _init({workload.name: workload.source})
    scale = 4.0  # past colocate's edge here: the replicas' attainments differ
    traces = [workload.source.at(scale, replica) for replica in range(3)]
    assert traces[0].conversations != traces[1].conversations  # its own sessions
    summaries = []
    for replica, trace in enumerate(traces):
        seeded = msgspec.structs.replace(run.config, seed=REPLICA_SEED_STRIDE * replica)
        summaries.append(run_one(trace, msgspec.structs.replace(run, config=seeded), scale).summary)
    assert len({s.good for s in summaries}) > 1
    summary, offered, failure = _probe(workload.name, run, scale, 3)
    assert failure is None and offered.replicas == 3
    assert offered.attainment == sum(s.good for s in summaries) / sum(s.requests for s in summaries)
    assert summary == summaries[0]  # the record of the first replay
    _, single, _ = _probe(workload.name, run, scale, 1)
    assert single.attainment == summaries[0].slo_attainment and single.replicas == 1


def test_replicas_must_be_at_least_one(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([*_SMALL, "--replicas", "0"])
    assert "--replicas must be at least 1" in capsys.readouterr().err


def test_baselines_measured_with_other_replicas_are_refused(tmp_path: Path) -> None:
    args = _parser().parse_args(_SMALL)
    workloads = matrix_workloads(matrix_spec(args), args.class_turns, args.span_s)
    cluster = ClusterSpec.parse(args.cluster)
    template = SimConfig(cluster=cluster, roles=tuple(worker_roles("colocate", cluster.workers)))
    contenders = [Variant("colocate", "colocate"), Variant("adaptive", "adaptive", mixed=True)]
    results = measure(workloads, contenders, template, jobs=1, tolerance=0.5, replicas=2)
    path = tmp_path / "acceptance.json"
    path.write_bytes(msgspec.json.encode([verdict(w, results[w.name]) for w in workloads]))
    assert {p.replicas for m in results["p4096-g64-none"] for p in m.probes} == {2}
    kept = reused(path, "adaptive", replicas=2)
    assert list(kept["p4096-g64-none"]) == ["colocate"]
    with pytest.raises(ValueError, match="colocate was measured with 2 replays a probe"):
        reused(path, "adaptive", replicas=1)


def test_tune_searches_the_split_grid_and_the_report_shows_it() -> None:
    args = _parser().parse_args([*_SMALL, "--cluster", "3xh200-sxm/llama-3.1-8b"])
    workloads = matrix_workloads(matrix_spec(args), args.class_turns, args.span_s)
    cluster = ClusterSpec.parse(args.cluster)
    template = SimConfig(cluster=cluster, roles=tuple(worker_roles("colocate", cluster.workers)))
    fixed = [Variant("colocate", "colocate"), Variant("adaptive", "adaptive", mixed=True)]
    results = tune(workloads, fixed, {"p4096-g64-none": [1024]}, template, jobs=1,
                   tolerance=0.5)  # fmt: skip
    labels = [m.label for m in results["p4096-g64-none"]]
    # 3 workers: coarse K = 1, 2 (the quartiles), nothing finer
    assert labels == ["colocate", "adaptive", "disaggregate K=1", "disaggregate K=2",
                      "threshold 1024 K=1", "threshold 1024 K=2"]  # fmt: skip
    [verdict_] = [verdict(w, results[w.name]) for w in workloads]
    text = render([verdict_], "cmd", [], workers=3)
    assert "| family | K=1 | K=2 |" in text
    grid = text.split("## The split grid", 1)[1]
    assert "| disaggregate | " in grid and "| threshold 1024 | " in grid
    best = text.split("## Each baseline's best variant", 1)[1]
    assert "(threshold 1024 K=" in best and "(colocate)" in best


def test_tune_keeps_every_known_variant_of_a_reused_grid() -> None:
    args = _parser().parse_args([*_SMALL, "--cluster", "3xh200-sxm/llama-3.1-8b"])
    workloads = matrix_workloads(matrix_spec(args), args.class_turns, args.span_s)
    cluster = ClusterSpec.parse(args.cluster)
    template = SimConfig(cluster=cluster, roles=tuple(worker_roles("colocate", cluster.workers)))
    fixed = [Variant("colocate", "colocate")]
    first = tune(workloads, fixed, {"p4096-g64-none": []}, template, jobs=1, tolerance=0.5)
    known = {"p4096-g64-none": {m.label: m for m in first["p4096-g64-none"]}}
    extra = msgspec.structs.replace(first["p4096-g64-none"][0], label="threshold 64 K=2")
    known["p4096-g64-none"][extra.label] = extra  # measured before, asked by no round now
    again = tune(workloads, fixed, {"p4096-g64-none": []}, template, jobs=1, tolerance=0.5,
                 known=known)  # fmt: skip
    assert [m.label for m in again["p4096-g64-none"]] == [
        "colocate", "disaggregate K=1", "disaggregate K=2", "threshold 64 K=2"]  # fmt: skip
