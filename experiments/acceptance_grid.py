"""The baselines' grid for the acceptance: each split family (disaggregate, threshold T) at
the K that `bench.hindsight` chooses, as `Variant`s labelled `{family} K={k}`, and the grid's
rows for the report."""

from __future__ import annotations

from collections.abc import Sequence

from bench.hindsight import next_splits
from experiments.acceptance_workloads import Measured, Variant, fixed_variants


def split_label(family: str, k: int) -> str:
    return f"{family} K={k}"


def family_of(label: str) -> tuple[str, int | None]:
    """A variant label's family and K (None: no split)."""
    family, sep, k = label.rpartition(" K=")
    return (family, int(k)) if sep and k.isdigit() else (label, None)


def split_variant(family: str, k: int) -> Variant:
    """The variant of `family` ("disaggregate", "threshold T") at K prefill workers."""
    policy, _, threshold = family.partition(" ")
    params = {"threshold": threshold} if threshold else {}
    return Variant(split_label(family, k), policy, params, prefill_workers=k)


def families(thresholds: Sequence[int]) -> list[str]:
    return ["disaggregate", *[f"threshold {t}" for t in thresholds]]


def variants(splits: Sequence[int], thresholds: Sequence[int]) -> list[Variant]:
    """Colocate first (the pilot), round-robin, each split family at every K of `splits`,
    then adaptive on mixed workers (judged: it splits per turn)."""
    colocate, round_robin, adaptive = fixed_variants()
    grid = [split_variant(family, k) for family in families(thresholds) for k in splits]
    return [colocate, round_robin, *grid, adaptive]


def next_variants(
    measured: Sequence[Measured], thresholds: Sequence[int], workers: int, exhaustive: bool
) -> list[Variant]:
    """The split variants to search next on a workload, given what it has measured."""
    done: dict[str, dict[int, float]] = {}
    for m in measured:
        family, k = family_of(m.label)
        if k is not None:
            done.setdefault(family, {})[k] = m.max_goodput_rps
    out = []
    for family in families(thresholds):
        searched = done.get(family, {})
        if exhaustive:
            ks = [k for k in range(1, workers) if k not in searched]
        else:
            ks = next_splits(searched, workers)
        out += [split_variant(family, k) for k in ks]
    return out


def grid_rows(measured: Sequence[Measured], workers: int) -> list[tuple[str, list[str]]]:
    """Each split family's max goodput by K (1..workers-1), "." where not searched."""
    from experiments.acceptance_verdicts import rps_text

    cells: dict[str, dict[int, str]] = {}
    for m in measured:
        family, k = family_of(m.label)
        if k is not None:
            cells.setdefault(family, {})[k] = rps_text(m)
    return [(family, [by_k.get(k, ".") for k in range(1, workers)])
            for family, by_k in cells.items()]  # fmt: skip
