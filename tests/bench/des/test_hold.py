"""A decision's hold (`hold_s`) in the simulator: the turn waits in the router first; and
the predicted TTFT each result carries."""

from __future__ import annotations

import msgspec
import pytest

from bench.des import SimConfig, simulate
from bench.stack.layout import ClusterSpec
from bench.traces.model import Conversation, Trace, TraceTurn
from policies.params import NoParams
from policies.types import (
    ClusterView,
    Colocate,
    Decision,
    Handoff,
    Outcome,
    Prediction,
    Role,
    Turn,
)
from sim.engine.presets import deployment_from_names
from sim.engine.roofline import CostModel

DEPLOYMENT = deployment_from_names("h200-sxm", "llama-3.1-8b")
HOLD_S = 0.25


class Holding:
    """Holds every turn `HOLD_S`, then runs it whole on w0 or hands it off w0 -> w1."""

    name = "holding"
    Params = NoParams
    split = False

    def __init__(self, params: NoParams | None = None) -> None:
        self.outcomes: list[Outcome] = []

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        if self.split:
            return Handoff("w0", "w1", hold_s=HOLD_S)
        return Colocate("w0", hold_s=HOLD_S)

    def observe(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)


class SplitHolding(Holding):
    split = True


def config(roles: tuple[Role, ...]) -> SimConfig:
    spec = ClusterSpec(len(roles), "h200-sxm", "llama-3.1-8b")
    return msgspec.convert({"cluster": spec, "roles": roles, "noise_sigma": 0.0,
                            "nic_latency_s": 0.0}, SimConfig, from_attributes=True)  # fmt: skip


@pytest.mark.parametrize("policy", [Holding(), SplitHolding()], ids=["whole", "handoff"])
def test_a_held_turn_is_sent_after_its_hold(policy: Holding) -> None:
    trace = Trace("t", (Conversation("s0", (TraceTurn(0.0, 4000, 4),)),))
    cfg = config(("mixed", "mixed"))
    result = simulate(trace, policy, cfg)
    assert result.failure is None
    [done] = result.results
    [outcome] = policy.outcomes
    assert done.status == "completed"
    assert done.first_chunk_at is not None
    ttft = done.first_chunk_at - done.sent_at
    prefill = CostModel(DEPLOYMENT).predict_prefill_s(4002)
    assert ttft > HOLD_S + cfg.router_overhead_s + prefill - 1e-9
    assert outcome.held_ms == pytest.approx(HOLD_S * 1000.0)
    assert outcome.ttft_ms == pytest.approx(ttft * 1000.0)
    # The router's queue stage starts when the hold ends.
    assert outcome.queue_ms is not None and outcome.queue_ms < 1e-6


class Predicting(Holding):
    """Runs every turn whole on w0, predicting a TTFT for the first turn only."""

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        if turn.request_id.endswith("#0"):
            return Colocate("w0", predicted=Prediction(ttft_ms=123.5))
        return Colocate("w0")


def test_each_result_carries_the_ttft_its_policy_predicted() -> None:
    turns = (TraceTurn(0.0, 1000, 4), TraceTurn(1.0, 500, 4))
    trace = Trace("t", (Conversation("s0", turns),))
    result = simulate(trace, Predicting(), config(("mixed", "mixed")))
    assert result.failure is None
    by_turn = sorted(result.results, key=lambda r: r.turn_index)
    assert [r.status for r in by_turn] == ["completed", "completed"]
    # A decision without a prediction (as the baselines make) predicts nothing, not 0 ms.
    assert [r.predicted_ttft_ms for r in by_turn] == [123.5, None]
