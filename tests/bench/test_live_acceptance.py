"""The live acceptance's plan: which stacks each variant's search starts (nothing runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.compare import plan
from bench.layout import ClusterSpec
from bench.scripts.acceptance import variants
from bench.scripts.live_acceptance import chosen, spec_of

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
