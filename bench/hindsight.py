"""Tuning a fixed placement in hindsight, as a user would: which thresholds and splits to try.

A split policy (disaggregate, threshold) runs on K = 1..N-1 prefill workers of N, the rest
decode. Threshold's candidates for a trace are the boundaries between its prompt classes (a
threshold at the larger of two neighbouring prompt sizes splits them: threshold hands off at
>=) and the powers of two from 256 to 65,536; of candidates that no turn can tell apart only
the smallest is kept (`distinct_thresholds`).

Searching every K is exhaustive; coarse to fine instead tries the quartiles of N, then the
neighbours of the best K so far at half the step, down to 1 (`next_splits`). Max goodput is
close to unimodal in K, so this finds the exhaustive best with a fraction of the searches (at 8
workers 5 of 7; at 32, 9 to 11 of 31).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from bench.traces.model import Trace

POWERS_OF_TWO = tuple(2**e for e in range(8, 17))  # 256 .. 65,536
MAX_PROMPT_CLASSES = 16  # more distinct prompt sizes than this: a recorded trace, no classes


def prompt_classes(trace: Trace) -> list[int]:
    """The distinct new-input sizes of `trace`'s turns, when there are few (a generated mix)."""
    sizes = {t.new_input_tokens for c in trace.conversations for t in c.turns}
    return sorted(sizes) if len(sizes) <= MAX_PROMPT_CLASSES else []


def distinct_thresholds(candidates: Sequence[int], trace: Trace) -> list[int]:
    """`candidates` ascending, less each one that no turn can tell from the one kept before
    it. A turn's uncached tokens lie between its new input and its whole context (all of it
    resident, or none), so thresholds a < b place it alike unless new input < b and context
    >= a."""
    ranges = [(t.new_input_tokens, c.context_tokens(i))
              for c in trace.conversations for i, t in enumerate(c.turns)]  # fmt: skip
    kept: list[int] = []
    for b in sorted(set(candidates)):
        a = kept[-1] if kept else None
        if a is None or any(low < b and high >= a for low, high in ranges):
            kept.append(b)
    return kept


def threshold_candidates(trace: Trace) -> list[int]:
    """The boundaries between `trace`'s prompt classes and the powers of two, told apart."""
    return distinct_thresholds([*prompt_classes(trace)[1:], *POWERS_OF_TWO], trace)


def coarse_splits(workers: int) -> list[int]:
    """The quartiles of `workers` as prefill-worker counts in 1..workers-1."""
    if workers < 2:
        return []
    return sorted({min(workers - 1, max(1, round(workers * q))) for q in (0.25, 0.5, 0.75)})


def next_splits(goodput: Mapping[int, float], workers: int) -> list[int]:
    """The K to search next, given each searched K's max goodput: the unsearched neighbours
    of the best at the largest step (half the coarse gap, halving down to 1) that has any;
    none once the best's neighbours at step 1 are searched."""
    if not goodput:
        return coarse_splits(workers)
    best = max(sorted(goodput), key=lambda k: goodput[k])  # ties: the fewest prefill workers
    step = max(1, workers // 8)
    while step >= 1:
        found = [k for k in (best - step, best + step) if 1 <= k < workers and k not in goodput]
        if found:
            return found
        step //= 2
    return []
