"""Every built-in policy keeps the properties of the policy authors' kit (policies.testing).

The adaptive policy has its own, stricter property tests (tests/policies/adaptive).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial

import pytest

from policies import BUILTIN_POLICIES, create_policy
from policies.testing import (
    PolicyFactory,
    check_affinity,
    check_deterministic,
    check_feasible,
    check_handoff,
    check_round_trip,
)


@dataclass(frozen=True)
class Spec:
    """A built-in policy with its parameters, and what its checks may expect of it."""

    name: str
    params: Mapping[str, object] = field(default_factory=dict)
    # round-robin alone: session-blind, stateful, and it needs a prefill-capable worker
    keeps_affinity: bool = True
    stateless: bool = True
    may_reject_without_prefill: bool = False
    may_hand_off: bool = True
    handoff_min_uncached_tokens: int = 0

    @property
    def factory(self) -> PolicyFactory:
        return partial(create_policy, self.name, self.params)


SPECS = [
    Spec("round-robin", keeps_affinity=False, stateless=False, may_reject_without_prefill=True),
    Spec("colocate", may_hand_off=False),
    Spec("disaggregate"),
    Spec("threshold", handoff_min_uncached_tokens=1024),
    Spec("threshold", {"threshold": 0}, handoff_min_uncached_tokens=0),
    Spec("threshold", {"threshold": 3000}, handoff_min_uncached_tokens=3000),
]


def _id(spec: Spec) -> str:
    return f"{spec.name}{dict(spec.params) or ''}"


every_spec = pytest.mark.parametrize("spec", SPECS, ids=_id)


def test_every_builtin_but_adaptive_is_covered() -> None:
    assert {spec.name for spec in SPECS} == set(BUILTIN_POLICIES) - {"adaptive"}


@every_spec
def test_decisions_are_feasible(spec: Spec) -> None:
    check_feasible(spec.factory, may_reject_without_prefill=spec.may_reject_without_prefill)


@pytest.mark.parametrize("spec", [s for s in SPECS if s.keeps_affinity], ids=_id)
def test_affinity_kept_when_possible(spec: Spec) -> None:
    check_affinity(spec.factory)


@every_spec
def test_handoff_only_where_the_policy_allows(spec: Spec) -> None:
    check_handoff(
        spec.factory,
        may_hand_off=spec.may_hand_off,
        handoff_min_uncached_tokens=spec.handoff_min_uncached_tokens,
    )


@every_spec
def test_deterministic_and_order_independent(spec: Spec) -> None:
    check_deterministic(spec.factory, stateless=spec.stateless)


@every_spec
def test_decisions_round_trip_as_tagged_union(spec: Spec) -> None:
    check_round_trip(spec.factory)
