"""The kit's checks pass a policy that keeps every property and fail one that breaks any."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from collections.abc import Iterator
from functools import partial

import pytest
from hypothesis import Phase, given, settings

from policies import (
    ClusterView,
    Colocate,
    Decision,
    Outcome,
    Recompute,
    Reject,
    Turn,
    create_policy,
)
from policies.testing import (
    PolicyFactory,
    PolicyPropertyError,
    check_affinity,
    check_deterministic,
    check_feasible,
    check_handoff,
    check_policy,
    check_round_trip,
    steps,
)

FEW = 30  # examples for checks that must pass
MANY = 300  # for checks that must fail: a broken policy fails within a few dozen


@pytest.fixture(autouse=True)
def no_shrinking() -> Iterator[None]:
    """The checks take every setting but theirs from the active hypothesis profile: here,
    one that reports the first failing example as found, unshrunk (shrinking takes seconds)."""
    settings.register_profile("kit-restore", parent=settings.default)
    settings.register_profile(
        "kit-no-shrinking",
        parent=settings.default,
        phases=(Phase.explicit, Phase.reuse, Phase.generate),
        database=None,
    )
    settings.load_profile("kit-no-shrinking")
    try:
        yield
    finally:
        settings.load_profile("kit-restore")


def _decode_capable(view: ClusterView) -> list[str]:
    return sorted(
        worker.worker_id
        for worker in view.workers
        if worker.accepts_new_work and worker.role in ("decode", "mixed")
    )


class Sticky:
    """Keeps every property: the resident worker when it can decode, else the first
    decode-capable worker by id (a Recompute when the session lived elsewhere)."""

    name = "sticky"

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        eligible = _decode_capable(view)
        if not eligible:
            return Reject(reason="no decode-capable worker")
        residency = view.residency
        if residency is not None and residency.worker_id in eligible:
            return Colocate(residency.worker_id, reason="resident")
        if residency is not None:
            return Recompute(eligible[0], reason="resident cannot decode")
        return Colocate(eligible[0], reason="first by id")

    def observe(self, outcome: Outcome) -> None:
        """Sticky learns nothing."""


class ServesNowhere(Sticky):
    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        return Colocate("nowhere", reason="not in any view")


class GivesNoReason(Sticky):
    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        decision = super().decide(turn, view)
        return Reject() if isinstance(decision, Reject) else Colocate(_decode_capable(view)[0])


class AlwaysRejects(Sticky):
    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        return Reject(reason="closed")


class RecomputesOnResident(Sticky):
    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        decision = super().decide(turn, view)
        if isinstance(decision, Colocate) and view.residency is not None:
            return Recompute(decision.worker, reason="prefill it all again")
        return decision


class IgnoresResidency(Sticky):
    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        eligible = _decode_capable(view)
        if not eligible:
            return Reject(reason="no decode-capable worker")
        residency = view.residency
        if residency is not None and residency.worker_id != eligible[0]:
            return Recompute(eligible[0], reason="first by id")
        return Colocate(eligible[0], reason="first by id")


class FirstListed(Sticky):
    """Depends on the order of the view's workers."""

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        decision = super().decide(turn, view)
        if isinstance(decision, Colocate) and view.residency is None:
            listed = [w.worker_id for w in view.workers if w.worker_id in _decode_capable(view)]
            return Colocate(listed[0], reason="first listed")
        return decision


class CountsCalls(Sticky):
    """Depends on how many decisions any instance made before."""

    calls = itertools.count()

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        decision = super().decide(turn, view)
        return (
            Reject(reason=f"call {next(self.calls)}")
            if isinstance(decision, Reject)
            else (Colocate(_decode_capable(view)[0], reason=f"call {next(self.calls)}"))
        )


class HoldsNaN(Sticky):
    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        decision = super().decide(turn, view)
        if isinstance(decision, Colocate):
            return Colocate(decision.worker, reason=decision.reason, hold_s=math.nan)
        return decision


def builtin(name: str, **params: object) -> PolicyFactory:
    return partial(create_policy, name, params)


def test_a_policy_that_keeps_every_property_passes() -> None:
    check_policy(Sticky, max_examples=FEW)


@pytest.mark.parametrize(
    ("factory", "problem"),
    [
        (ServesNowhere, "serves on 'nowhere', not a worker of the view that can decode"),
        (GivesNoReason, "gives no reason"),
        (AlwaysRejects, "rejects although a worker can decode"),
        (RecomputesOnResident, "recomputes on the resident worker"),
    ],
    ids=["worker-not-in-view", "no-reason", "needless-reject", "recompute-on-resident"],
)
def test_check_feasible_fails_an_infeasible_decision(factory: type[Sticky], problem: str) -> None:
    with pytest.raises(PolicyPropertyError, match=problem):
        check_feasible(factory, max_examples=MANY)
    with pytest.raises(PolicyPropertyError, match=problem):
        check_policy(factory, max_examples=MANY)


def test_may_reject_without_prefill_allows_only_that_reject() -> None:
    # round-robin refuses when no worker can prefill, though one can decode
    with pytest.raises(PolicyPropertyError, match="rejects although a worker can decode"):
        check_feasible(builtin("round-robin"), max_examples=MANY)
    check_feasible(builtin("round-robin"), may_reject_without_prefill=True, max_examples=FEW)
    with pytest.raises(PolicyPropertyError, match="can decode and one can prefill"):
        check_feasible(AlwaysRejects, may_reject_without_prefill=True, max_examples=MANY)


def test_check_affinity_fails_a_policy_that_leaves_an_eligible_resident() -> None:
    check_feasible(IgnoresResidency, max_examples=FEW)
    with pytest.raises(PolicyPropertyError, match="abandons the eligible resident worker"):
        check_affinity(IgnoresResidency, max_examples=MANY)
    with pytest.raises(PolicyPropertyError, match="abandons the eligible resident worker"):
        check_policy(IgnoresResidency, max_examples=MANY)
    check_policy(IgnoresResidency, keeps_affinity=False, max_examples=FEW)


def test_check_handoff_fails_a_handoff_the_policy_does_not_allow() -> None:
    with pytest.raises(PolicyPropertyError, match="hands off, which this policy never does"):
        check_handoff(builtin("disaggregate"), may_hand_off=False, max_examples=MANY)
    with pytest.raises(PolicyPropertyError, match="uncached tokens, below 5000"):
        check_handoff(builtin("threshold"), handoff_min_uncached_tokens=5000, max_examples=MANY)
    check_handoff(builtin("threshold"), handoff_min_uncached_tokens=1024, max_examples=FEW)
    with pytest.raises(PolicyPropertyError, match="hands off, which this policy never does"):
        check_policy(builtin("disaggregate"), may_hand_off=False, max_examples=MANY)


def test_check_deterministic_fails_on_worker_order() -> None:
    with pytest.raises(PolicyPropertyError, match="reordering the views' workers"):
        check_deterministic(FirstListed, max_examples=MANY)


def test_check_deterministic_fails_on_state_shared_by_instances() -> None:
    with pytest.raises(PolicyPropertyError, match="a second policy decided"):
        check_deterministic(CountsCalls, max_examples=MANY)


def test_stateless_fails_a_policy_that_keeps_state_between_turns() -> None:
    with pytest.raises(PolicyPropertyError, match="a stateless policy keeps no state"):
        check_deterministic(builtin("round-robin"), max_examples=MANY)
    check_deterministic(builtin("round-robin"), stateless=False, max_examples=FEW)


def test_check_round_trip_fails_a_decision_json_cannot_carry() -> None:
    with pytest.raises(PolicyPropertyError, match="does not decode as a Decision"):
        check_round_trip(HoldsNaN, max_examples=MANY)


@given(sequence=steps())
def test_steps_are_sequences_of_turns_and_views(sequence: list[tuple[Turn, ClusterView]]) -> None:
    assert 1 <= len(sequence) <= 6
    for turn, view in sequence:
        assert 0 <= turn.uncached_tokens <= turn.prompt_tokens <= turn.uncached_tokens + 10_000
        assert len(view.workers) <= 7
        assert len({worker.worker_id for worker in view.workers}) == len(view.workers)
        if view.residency is not None:
            assert view.residency.tokens >= 1
            assert view.residency.worker_id == "gone" or view.worker(view.residency.worker_id)


def test_the_router_and_policies_never_import_the_kit() -> None:
    code = (
        "import sys, policies, router.app\n"
        "for name in policies.BUILTIN_POLICIES: policies.create_policy(name)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('hypothesis', 'policies.testing'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"
