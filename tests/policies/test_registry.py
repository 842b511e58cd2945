from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping

import msgspec
import pytest

from policies import (
    ENTRY_POINT_GROUP,
    ClusterView,
    Colocate,
    Decision,
    NoParams,
    Objectives,
    Outcome,
    Policy,
    PolicyConfigError,
    Reject,
    Turn,
    WorkerView,
    available_policies,
    create_policy,
    parse_param_assignments,
)
from policies.baselines.colocate import ColocatePolicy
from policies.baselines.disaggregate import DisaggregatePolicy
from policies.baselines.round_robin import RoundRobinPolicy
from policies.baselines.threshold import ThresholdParams, ThresholdPolicy
from tests.policies.plugin_fixture import PinnedParams, PinnedPolicy

BUILTINS = ["round-robin", "colocate", "disaggregate", "threshold", "adaptive"]


class FirstWorkerParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    skip: int = 0


class FirstWorkerPolicy:
    """A test-module policy: colocate on the (skip+1)-th worker of the view."""

    name = "first-worker"
    Params = FirstWorkerParams

    def __init__(self, params: FirstWorkerParams) -> None:
        self.params = params

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        return Colocate(worker=view.workers[self.params.skip].worker_id)

    def observe(self, outcome: Outcome) -> None:
        return None


class NoParamsDeclared:
    name = "bare"

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        return Reject()

    def observe(self, outcome: Outcome) -> None:
        return None


class NotAPolicy:
    Params = NoParams

    def __init__(self, params: NoParams) -> None:
        self.params = params


NOT_A_CLASS = 42

TURN = Turn(
    session_id="s",
    request_id="r",
    prompt_tokens=10,
    uncached_tokens=10,
    max_tokens=5,
    objectives=Objectives(ttft_ms=500.0, itl_ms=50.0),
    arrival_s=0.0,
)
VIEW = ClusterView(
    now_s=0.0,
    workers=(WorkerView("a", "mixed", healthy=True), WorkerView("b", "mixed", healthy=True)),
)


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("round-robin", RoundRobinPolicy),
        ("colocate", ColocatePolicy),
        ("disaggregate", DisaggregatePolicy),
        ("threshold", ThresholdPolicy),
    ],
)
def test_builtins_by_name(name: str, cls: type) -> None:
    policy = create_policy(name)
    assert type(policy) is cls
    assert policy.name == name
    assert isinstance(policy, Policy)


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (None, 1024),
        ({}, 1024),
        ({"threshold": "2048"}, 2048),  # command line: strings
        ({"threshold": 2048}, 2048),  # TOML / JSON: typed
        ({"threshold": "0"}, 0),
    ],
)
def test_threshold_params_convert(params: Mapping[str, object] | None, expected: int) -> None:
    policy = create_policy("threshold", params)
    assert isinstance(policy, ThresholdPolicy)
    assert policy.params == ThresholdParams(threshold=expected)


@pytest.mark.parametrize(
    ("spec", "params", "fragments"),
    [
        ("threshold", {"treshold": 10}, ["'threshold'", "'treshold'", "allowed keys: threshold"]),
        ("colocate", {"threshold": 10}, ["'colocate'", "'threshold'", "allowed keys: (none)"]),
        ("threshold", {"threshold": "many"}, ["'threshold'", "Expected `int`, got `str`"]),
        ("threshold", {"threshold": 1.5}, ["parameter 'threshold'", "Expected `int`"]),
        ("threshold", {"threshold": -1}, ["'threshold'", "threshold must be >= 0, got -1"]),
        ("threshold", {"threshold": "-5"}, ["threshold must be >= 0, got -5"]),
        (
            "tests.policies.plugin_fixture:PinnedPolicy",
            {},
            ["missing required field `worker`", "allowed keys: worker, retry_after_s"],
        ),
        (
            "tests.policies.plugin_fixture:PinnedPolicy",
            {"worker": ""},
            ["worker must not be empty"],
        ),
    ],
)
def test_bad_params_raise_policy_config_error(
    spec: str, params: Mapping[str, object], fragments: list[str]
) -> None:
    with pytest.raises(PolicyConfigError) as info:
        create_policy(spec, params)
    message = str(info.value)
    assert message.startswith(f"policy {spec!r}")
    for fragment in fragments:
        assert fragment in message


def test_policy_config_error_is_value_error() -> None:
    assert issubclass(PolicyConfigError, ValueError)
    with pytest.raises(PolicyConfigError, match="threshold must be >= 0"):
        ThresholdParams(threshold=-1)


def test_unknown_name_lists_available() -> None:
    with pytest.raises(PolicyConfigError) as info:
        create_policy("adaptiv")
    message = str(info.value)
    assert "'adaptiv'" in message
    assert "available: round-robin, colocate, disaggregate, threshold" in message


def test_module_attr_loads_test_class() -> None:
    policy = create_policy("tests.policies.test_registry:FirstWorkerPolicy", {"skip": "1"})
    assert isinstance(policy, FirstWorkerPolicy)
    assert policy.decide(TURN, VIEW) == Colocate(worker="b")


def test_module_attr_plugin_package_converts_params() -> None:
    policy = create_policy(
        "tests.policies.plugin_fixture:PinnedPolicy", {"worker": "b", "retry_after_s": "0.5"}
    )
    assert isinstance(policy, PinnedPolicy)
    assert policy.params == PinnedParams(worker="b", retry_after_s=0.5)
    assert policy.decide(TURN, VIEW) == Colocate(worker="b", reason="pinned")


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("tests.policies.no_such_module:X", "cannot load 'tests.policies.no_such_module:X'"),
        ("tests.policies.test_registry:Missing", "cannot load"),
        (":FirstWorkerPolicy", "cannot load"),
        ("tests.policies.test_registry:NOT_A_CLASS", "is not a class"),
        ("tests.policies.test_registry:NoParamsDeclared", "must declare `Params`"),
        ("tests.policies.test_registry:NotAPolicy", "does not implement Policy"),
    ],
)
def test_module_attr_errors(spec: str, fragment: str) -> None:
    with pytest.raises(PolicyConfigError) as info:
        create_policy(spec)
    assert f"policy {spec!r}" in str(info.value)
    assert fragment in str(info.value)


def _fake_entry_points(
    monkeypatch: pytest.MonkeyPatch, entries: dict[str, str]
) -> list[str | None]:
    groups: list[str | None] = []

    def entry_points(*, group: str | None = None) -> list[importlib.metadata.EntryPoint]:
        groups.append(group)
        if group != ENTRY_POINT_GROUP:
            return []
        return [
            importlib.metadata.EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP)
            for name, value in entries.items()
        ]

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    return groups


def test_entry_point_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    groups = _fake_entry_points(
        monkeypatch,
        {
            "pinned": "tests.policies.plugin_fixture:PinnedPolicy",
            "colocate": "tests.policies.test_registry:FirstWorkerPolicy",  # cannot shadow
            "another": "tests.policies.test_registry:FirstWorkerPolicy",
        },
    )
    assert available_policies() == [*BUILTINS, "another", "pinned"]
    policy = create_policy("pinned", {"worker": "a"})
    assert isinstance(policy, PinnedPolicy)
    assert policy.decide(TURN, VIEW) == Colocate(worker="a", reason="pinned")
    assert type(create_policy("colocate")) is ColocatePolicy
    assert set(groups) == {ENTRY_POINT_GROUP}


def test_entry_point_broken(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_entry_points(monkeypatch, {"broken": "tests.policies.no_such_module:Policy"})
    assert "broken" in available_policies()
    with pytest.raises(PolicyConfigError, match="policy 'broken': cannot load"):
        create_policy("broken")


def test_available_policies_without_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_entry_points(monkeypatch, {})
    assert available_policies() == BUILTINS


@pytest.mark.parametrize(
    ("assignments", "expected"),
    [
        ([], {}),
        (["threshold=2048"], {"threshold": "2048"}),
        (
            ["threshold=2048", "on_infeasible=reject"],
            {"threshold": "2048", "on_infeasible": "reject"},
        ),
        ([" threshold = 7 "], {"threshold": "7"}),
        (["expr=a=b"], {"expr": "a=b"}),
        (["empty="], {"empty": ""}),
    ],
)
def test_parse_param_assignments(assignments: list[str], expected: dict[str, str]) -> None:
    assert parse_param_assignments(assignments) == expected


@pytest.mark.parametrize(
    ("assignments", "fragment"),
    [
        (["threshold"], "'threshold' is not of the form key=value"),
        (["=5"], "'=5' is not of the form key=value"),
        (["a=1", "a=2"], "'a' is given more than once"),
    ],
)
def test_parse_param_assignments_errors(assignments: list[str], fragment: str) -> None:
    with pytest.raises(PolicyConfigError) as info:
        parse_param_assignments(assignments)
    assert fragment in str(info.value)


def test_command_line_round_trip() -> None:
    policy = create_policy("threshold", parse_param_assignments(["threshold=4096"]))
    assert isinstance(policy, ThresholdPolicy)
    assert policy.params.threshold == 4096
