"""Hindsight tuning: threshold candidates per trace, coarse-to-fine search over K."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from bench.hindsight import coarse_splits, distinct_thresholds, next_splits, threshold_candidates
from bench.traces.model import Conversation, Trace, TraceTurn


def _coarse_to_fine(goodput: Callable[[int], float], workers: int) -> tuple[int, int]:
    """The best K coarse to fine finds and how many K it searched."""
    searched: dict[int, float] = {}
    while found := next_splits(searched, workers):
        searched.update((k, goodput(k)) for k in found)
    return max(sorted(searched), key=lambda k: searched[k]), len(searched)


@pytest.mark.parametrize("workers", [2, 3, 4, 8, 16, 32])
@pytest.mark.parametrize("peak_fraction", [0.05, 0.3, 0.5, 0.7, 0.95])
def test_coarse_to_fine_finds_the_peak_of_a_unimodal_grid(
    workers: int, peak_fraction: float
) -> None:
    peak = min(workers - 1, max(1, round(workers * peak_fraction)))

    def goodput(k: int) -> float:
        return 100.0 - abs(k - peak) * 3.0

    best, searched = _coarse_to_fine(goodput, workers)
    assert best == peak
    assert searched <= workers - 1
    if workers >= 16:
        assert searched <= 12  # far fewer than every K


def test_coarse_splits_are_the_quartiles() -> None:
    assert coarse_splits(8) == [2, 4, 6]
    assert coarse_splits(32) == [8, 16, 24]
    assert coarse_splits(2) == [1] and coarse_splits(1) == []


def _trace(*sessions: tuple[int, ...]) -> Trace:
    return Trace("t", tuple(
        Conversation(f"s{i}", tuple(TraceTurn(0.0, p, 10) for p in prompts))
        for i, prompts in enumerate(sessions)
    ))  # fmt: skip


def test_thresholds_no_turn_tells_apart_are_dropped() -> None:
    single = _trace((300,), (5000,))  # single turns: uncached is the prompt
    assert distinct_thresholds([256, 512, 1024, 4096, 8192, 16384], single) == [256, 512, 8192]
    multi = _trace((300, 300, 300))  # context 300, 610, 920: anything up to 920 may be uncached
    assert distinct_thresholds([256, 512, 1024, 2048], multi) == [256, 512, 1024]


def test_candidates_include_the_boundaries_between_prompt_classes() -> None:
    # 400 alone splits 300 from 400; 5000 places like 1024 (nothing between them)
    assert threshold_candidates(_trace((300,), (5000,), (400,))) == [256, 400, 512, 8192]
