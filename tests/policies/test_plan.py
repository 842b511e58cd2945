"""policies.plan: the legs each decision becomes and the KV they move, for router and simulator."""

from __future__ import annotations

import pytest

from policies.plan import Plan, Transfer, kv_bytes, plan_turn, tokens_to_move
from policies.types import (
    Colocate,
    Decision,
    Handoff,
    Migrate,
    Recompute,
    Reject,
    Residency,
)

KV = 1000  # bytes per token, round for reading


def at(worker: str, tokens: int) -> Residency:
    return Residency(worker_id=worker, tokens=tokens, bytes=kv_bytes(tokens, KV), epoch=1)


@pytest.mark.parametrize(
    ("residency", "worker", "prompt", "moved"),
    [
        (None, "w1", 5000, 5000),
        (at("w1", 4000), "w1", 5000, 1000),
        (at("w1", 4000), "w2", 5000, 5000),  # w2 holds nothing of it
        (at("w1", 6000), "w1", 5000, 1),  # a shorter prompt (edited history): its own token
    ],
)
def test_tokens_to_move(residency: Residency | None, worker: str, prompt: int, moved: int) -> None:
    assert tokens_to_move(prompt, residency, worker) == moved


@pytest.mark.parametrize(
    ("decision", "residency", "plan"),
    [
        (Reject(reason="full"), None, Plan("reject", None)),
        (Colocate(worker="w1"), at("w1", 300), Plan("colocate", "w1")),
        (Recompute(worker="w2"), at("w1", 300), Plan("recompute", "w2", recomputed_tokens=300)),
        (Recompute(worker="w2"), None, Plan("recompute", "w2")),
        (
            Handoff(prefill_worker="p", decode_worker="d"),
            None,
            Plan("handoff", "d", "p", Transfer("handoff", "p", "d", 500, 500_000)),
        ),
        (
            Handoff(prefill_worker="p", decode_worker="d"),
            at("d", 400),
            Plan("handoff", "d", "p", Transfer("handoff", "p", "d", 100, 100_000)),
        ),
        (
            Migrate(source="a", destination="b"),
            at("a", 400),
            Plan("migrate", "b", "a", Transfer("migration", "a", "b", 400, 400_000),
                 refused_link_worker="a"),
        ),
    ],
    ids=["reject", "colocate", "recompute", "recompute-new", "handoff", "handoff-resident",
         "migrate"],
)  # fmt: skip
def test_plan_of_each_decision(decision: Decision, residency: Residency | None, plan: Plan) -> None:
    planned = plan_turn(decision, 500, residency, KV)
    assert planned == plan
    assert planned.legs == (0 if plan.answering_worker is None else 2 if plan.transfer else 1)
