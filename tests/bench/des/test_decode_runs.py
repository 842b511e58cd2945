"""Decode runs (`sim.engine.decode_run` in `bench.des.cluster`) change the simulator's cost, never
its results: a replay with them gives what stepping every engine through the event heap gives."""

from __future__ import annotations

import msgspec
import pytest

import bench.des.cluster as des_cluster
from bench.des import SimConfig, SimResult, simulate
from bench.stack.layout import ClusterSpec, worker_roles
from bench.traces.model import Trace
from bench.traces.workloads import ArrivalSpec, ThinkSpec, WorkloadSpec, generate_matrix
from policies import create_policy


def workload() -> Trace:
    spec = WorkloadSpec(
        prompt_tokens=(512, 3000), output_tokens=(16, 300), reuse=("none", "multi-turn"),
        turns=(3,), sessions_per_class=4, arrival=ArrivalSpec(rate_rps=12.0),
        think=ThinkSpec(mean_s=0.3),
    )  # fmt: skip
    return generate_matrix(spec)


def replay(policy: str, run_steps: int, monkeypatch: pytest.MonkeyPatch,
           **overrides: object) -> SimResult:  # fmt: skip
    monkeypatch.setattr(des_cluster, "MAX_RUN_STEPS", run_steps)
    spec = ClusterSpec(3, "h200-sxm", "llama-3.1-8b")
    fields = {"cluster": spec, "roles": tuple(worker_roles(policy, 3)), **overrides}
    config = msgspec.convert(fields, SimConfig, from_attributes=True)
    result = simulate(workload(), create_policy(policy), config)
    assert result.failure is None
    return result


@pytest.mark.parametrize(
    ("policy", "overrides"),
    [
        ("colocate", {}),
        ("round-robin", {"noise_sigma": 0.0}),
        ("disaggregate", {"kv_hold_timeout_s": 0.05}),  # holds expire during decodes
        ("adaptive", {}),
    ],
)
def test_decode_runs_give_the_step_by_step_results(
    policy: str, overrides: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    stepped = replay(policy, 1, monkeypatch, **overrides)  # a run needs two steps: none
    fast = replay(policy, 64, monkeypatch, **overrides)
    assert msgspec.json.encode(fast.results) == msgspec.json.encode(stepped.results)
    a, b = fast.stats, stepped.stats
    assert (a.events, a.steps, a.virtual_s) == (b.events, b.steps, b.virtual_s)
    # most steps ran inside runs rather than as events of their own
    assert a.inline_steps > b.inline_steps and a.inline_steps > a.steps // 2
