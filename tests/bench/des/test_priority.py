"""Deadline order in the simulator: a decision's `due_ms` orders the engines' queues under
priority scheduling, and changes nothing under first come, first served."""

from __future__ import annotations

import msgspec
import pytest

from bench.des import SimConfig, simulate
from bench.des.turns import engine_priority_sent
from bench.stack.layout import ClusterSpec
from bench.traces.model import Conversation, Trace, TraceTurn
from policies.types import ClusterView, Colocate, Decision, Outcome, Reject, Turn, engine_priority

# session -> (arrival s, when its first token is due after arrival, ms)
TURNS = {"long": (0.0, 60_000.0), "later": (0.001, 30_000.0), "urgent": (0.002, 500.0)}


class DueColocate:
    """Every turn on the one worker, due when `TURNS` says."""

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        return Colocate(worker=view.workers[0].worker_id, due_ms=TURNS[turn.session_id][1])

    def observe(self, outcome: Outcome) -> None:
        pass


def _config(policy: str) -> SimConfig:
    spec = ClusterSpec(1, "h200-sxm", "llama-3.1-8b")
    return msgspec.convert(
        {"cluster": spec, "roles": ("mixed",), "noise_sigma": 0.0, "max_num_seqs": 1,
         "scheduling_policy": policy},
        SimConfig, from_attributes=True,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("policy", "order"),
    [("fcfs", ["long", "later", "urgent"]), ("priority", ["long", "urgent", "later"])],
)
def test_the_turn_due_first_is_served_first_under_priority_scheduling(
    policy: str, order: list[str]
) -> None:
    trace = Trace("due", tuple(Conversation(s, (TraceTurn(at, 2000, 8),))
                               for s, (at, _) in TURNS.items()))  # fmt: skip
    result = simulate(trace, DueColocate(), _config(policy), policy_name="due-colocate")
    assert result.failure is None
    first = {r.session_id: r.first_chunk_at or 0.0 for r in result.results}
    assert sorted(first, key=first.__getitem__) == order  # one slot: one answer at a time


@pytest.mark.parametrize(
    ("decision", "policy", "priority"),
    [
        (Colocate(worker="w", due_ms=750.0), "priority", engine_priority(2.0, 750.0)),
        (Colocate(worker="w", due_ms=750.0), "fcfs", 0),  # fcfs engines refuse priorities
        (Colocate(worker="w"), "priority", 0),  # no due time: arrival order
        (Reject(), "priority", 0),
    ],
)
def test_a_turn_carries_its_due_time_only_to_priority_engines(
    decision: Decision, policy: str, priority: int
) -> None:
    assert engine_priority_sent(decision, 2.0, policy) == priority
    assert engine_priority(2.0, 750.0) == 2750
