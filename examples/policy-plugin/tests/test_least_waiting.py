"""least-waiting keeps the properties every policy must keep (the session-router kit,
`policies.testing`), places turns as its docstring says, and is found by name once installed."""

from __future__ import annotations

import re
from functools import partial

import pytest
from example_policy import LeastWaitingParams, LeastWaitingPolicy

from policies import (
    Colocate,
    PolicyConfigError,
    Recompute,
    Reject,
    available_policies,
    create_policy,
)
from policies.testing import check_affinity, check_policy, turn, view, w


def test_keeps_the_properties_of_every_policy() -> None:
    # It never hands off, and it leaves a resident worker whose queue is too long.
    check_policy(LeastWaitingPolicy, may_hand_off=False, keeps_affinity=False)


def test_keeps_affinity_while_no_queue_is_too_long() -> None:
    # The kit's views have at most 64 requests waiting on a worker.
    check_affinity(lambda: LeastWaitingPolicy(LeastWaitingParams(max_waiting=64)))


def test_keeps_the_properties_when_built_by_the_registry() -> None:
    factory = partial(create_policy, "least-waiting", {"max_waiting": "2"})
    check_policy(factory, may_hand_off=False, keeps_affinity=False, max_examples=30)


def test_stays_on_the_resident_worker_while_its_queue_is_short() -> None:
    policy = LeastWaitingPolicy(LeastWaitingParams(max_waiting=4))
    cluster = view(w("a", waiting=4), w("b", waiting=0), resident="a")
    assert policy.decide(turn(), cluster) == Colocate("a", reason="resident queue short")


def test_recomputes_on_the_least_waiting_worker_once_the_resident_queue_is_too_long() -> None:
    policy = LeastWaitingPolicy(LeastWaitingParams(max_waiting=4))
    cluster = view(w("a", waiting=5), w("b", waiting=1), w("c", waiting=0), resident="a")
    decision = policy.decide(turn(), cluster)
    assert decision == Recompute("c", reason="resident queue too long or gone")


def test_places_a_new_session_on_the_fewest_waiting_then_running_then_id() -> None:
    policy = LeastWaitingPolicy()
    cluster = view(
        w("c", waiting=1, running=0),
        w("b", waiting=1, running=2),
        w("a", waiting=1, running=2),
        w("p", "prefill", waiting=0),
        w("x", waiting=0, healthy=False),
        w("y", waiting=0, draining=True),
    )
    assert policy.decide(turn(), cluster) == Colocate("c", reason="fewest waiting")
    tied = view(w("b", waiting=1, running=2), w("a", waiting=1, running=2))
    assert policy.decide(turn(), tied) == Colocate("a", reason="fewest waiting")


def test_rejects_when_no_worker_can_decode() -> None:
    cluster = view(w("p", "prefill"), w("d", "decode", draining=True), resident="d")
    decision = LeastWaitingPolicy().decide(turn(), cluster)
    assert isinstance(decision, Reject)
    assert decision.retry_after_s == 1.0


def test_is_found_by_name_through_the_entry_point() -> None:
    assert "least-waiting" in available_policies()
    policy = create_policy("least-waiting", {"max_waiting": "2"})
    assert isinstance(policy, LeastWaitingPolicy)
    assert policy.name == "least-waiting"
    assert policy.params == LeastWaitingParams(max_waiting=2)


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        ({"max_waiting": "-1"}, "max_waiting must be >= 0, got -1"),
        ({"max_waiting": "x"}, "parameter 'max_waiting': Expected `int`, got `str`"),
        ({"queue": 1}, "unknown parameter 'queue'; allowed keys: max_waiting"),
    ],
)
def test_bad_parameters_fail_at_creation(params: dict[str, object], problem: str) -> None:
    with pytest.raises(PolicyConfigError, match=re.escape(problem)):
        create_policy("least-waiting", params)
