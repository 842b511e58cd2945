"""Admission: reject only when even a lucky outcome of the prediction misses the objective."""

from __future__ import annotations

import msgspec
import pytest

from policies.adaptive import AdaptivePolicy
from policies.admission import MIN_SAMPLES, RATIO_MIN, REFRESH, Admission
from policies.types import (
    Action,
    ClusterView,
    Colocate,
    Objectives,
    Outcome,
    Prediction,
    Reject,
    Turn,
    WorkerView,
)


def fed(ratios: list[float], predicted_ms: float = 1000.0) -> Admission:
    admission = Admission()
    for ratio in ratios:
        admission.observe(predicted_ms, predicted_ms * ratio)
    return admission


@pytest.mark.parametrize(
    ("ratios", "low"),
    [
        ([], 1.0),  # nothing measured: the prediction stands
        ([0.5] * (MIN_SAMPLES - 1), 1.0),  # too few to trust
        ([0.5] * 64, 0.5),
        ([0.5] * 12 + [1.0] * 52, 1.0),  # the 20th percentile: 12 of 64 are lower
        ([0.5] * 13 + [1.0] * 51, 0.5),
        ([2.0] * 64, 1.0),  # predictions run low: admission is never stricter than them
        ([0.01] * 64, RATIO_MIN),  # nor blind
        ([0.8] * 256 + [0.4] * 256, 0.4),  # only the latest window counts
    ],
)
def test_the_low_ratio_is_the_quantile_of_the_latest_window(
    ratios: list[float], low: float
) -> None:
    assert fed(ratios).low_ratio == pytest.approx(low)


def test_the_ratio_is_refreshed_every_few_turns_not_every_turn() -> None:
    admission = fed([0.5] * 64)
    for _ in range(REFRESH - 1):
        admission.observe(1000.0, 1000.0)
    assert admission.low_ratio == pytest.approx(0.5)
    for _ in range(256):
        admission.observe(1000.0, 1000.0)
    assert admission.low_ratio == pytest.approx(1.0)


@pytest.mark.parametrize("measured", [None, 0.0, -5.0, float("inf"), float("nan")])
def test_unusable_measurements_teach_nothing(measured: float | None) -> None:
    admission = fed([0.5] * 64)
    for _ in range(64):
        admission.observe(1000.0, measured)
        admission.observe(0.0, 1000.0)
    assert admission.low_ratio == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("ratios", "predicted_ms", "admitted"),
    [
        ([], 1000.0, True),
        ([], 1001.0, False),
        ([0.7] * 64, 1400.0, True),  # 1,400 ms x 0.7 = 980 ms
        ([0.7] * 64, 1500.0, False),  # 1,050 ms: a miss even then
    ],
)
def test_a_turn_is_admitted_when_its_lucky_outcome_meets_the_objective(
    ratios: list[float], predicted_ms: float, admitted: bool
) -> None:
    assert fed(ratios).admits(predicted_ms, 1000.0) is admitted


def test_invalid_construction_fails() -> None:
    with pytest.raises(ValueError):
        Admission(quantile=1.5)


def _turn(request: str, ttft_ms: float) -> Turn:
    return Turn(session_id=f"s-{request}", request_id=request, prompt_tokens=16_000,
                uncached_tokens=16_000, max_tokens=64,
                objectives=Objectives(ttft_ms=ttft_ms, itl_ms=100.0), arrival_s=1.0)  # fmt: skip


def _cluster() -> ClusterView:
    worker = msgspec.convert({"worker_id": "d1", "role": "mixed", "healthy": True}, WorkerView)
    return ClusterView(now_s=1.0, workers=(worker,))


def test_the_policy_serves_turns_its_predictions_have_lately_overestimated() -> None:
    predicted = AdaptivePolicy().decide(_turn("probe", 60_000.0), _cluster()).predicted.ttft_ms
    objective = predicted / 1.25
    assert isinstance(AdaptivePolicy().decide(_turn("before", objective), _cluster()), Reject)
    policy = AdaptivePolicy()
    for _ in range(64):
        policy.admission.observe(predicted, 0.7 * predicted)
    after = policy.decide(_turn("after", objective), _cluster())
    assert isinstance(after, Colocate)
    assert after.reason.startswith("best effort")
    assert "within 0.70x" in after.reason
    # Still rejected where even 0.7 of the prediction misses.
    assert isinstance(policy.decide(_turn("hopeless", predicted * 0.5), _cluster()), Reject)


def _outcome(index: int, action: Action, ok: bool = True) -> Outcome:
    return Outcome(
        request_id=f"seen-{index}", session_id="s", action=action, prefill_worker="d1",
        decode_worker="d1", prompt_tokens=16_000, cached_tokens=0, completion_tokens=64, ok=ok,
        ttft_ms=700.0, predicted=Prediction(ttft_ms=1000.0),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("action", "ok", "low"), [("colocate", True, 0.7), ("handoff", True, 0.7),
                              ("colocate", False, 1.0), ("reject", True, 1.0)],
)  # fmt: skip
def test_observe_teaches_admission_from_served_turns(action: Action, ok: bool, low: float) -> None:
    policy = AdaptivePolicy()
    for index in range(64):
        policy.observe(_outcome(index, action, ok))
    assert policy.admission.low_ratio == pytest.approx(low)
