"""What the simulator's acceptance of `adaptive` asks of each workload."""

from __future__ import annotations

from bench.scripts.acceptance import _parser, matrix_spec
from bench.scripts.acceptance_workloads import MULTI_TURN_NEEDS, matrix_workloads


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
    assert MULTI_TURN_NEEDS == 1.2
