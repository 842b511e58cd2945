"""The acceptance's split variants: labels naming the family and K."""

from __future__ import annotations

from experiments.acceptance_grid import family_of, split_variant


def test_labels_name_the_family_and_k() -> None:
    variant = split_variant("threshold 4096", 6)
    assert (variant.label, variant.policy, variant.params, variant.prefill_workers) == (
        "threshold 4096 K=6", "threshold", {"threshold": "4096"}, 6)  # fmt: skip
    assert family_of(variant.label) == ("threshold 4096", 6)
    assert family_of("colocate") == ("colocate", None)
    assert split_variant("disaggregate", 3).params == {}
