"""The sim commands' worker options: vLLM's engine flags reach the simulated engine."""

from __future__ import annotations

import argparse

import pytest

from sim.cluster import SimCluster
from sim.commands import add_worker_options, worker_options


def _options(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_worker_options(parser)
    return parser.parse_args(list(argv))


def test_num_gpu_blocks_override_sizes_the_kv_cache() -> None:
    default = SimCluster.uniform(worker_options(_options(), 8101), 1, 8101).workers[0]
    small = SimCluster.uniform(
        worker_options(_options("--num-gpu-blocks-override", "1500"), 8101), 1, 8101
    ).workers[0]
    assert small.engine.blocks.num_blocks == 1500
    assert default.engine.blocks.num_blocks > 1500


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--num-gpu-blocks-override", "0"), "num_gpu_blocks_override must be >= 1"),
        (("--max-num-seqs", "0"), "max_num_seqs and max_num_batched_tokens must be >= 1"),
        (("--tp", "0"), "tp"),
    ],
)
def test_bad_engine_flags_exit_with_the_reason(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        worker_options(_options(*argv), 8101)
