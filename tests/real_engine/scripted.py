"""A policy that places each session's turns as a script says, for the real-engine suite: it
makes the router carry out a given decision (a migration, a recompute, a rejection) against
real engines, whatever a cost model would choose.

`plan` is a `;`-separated list of steps, one per turn of a session (the last one repeats):
`colocate:I`, `recompute:I`, `handoff:I>J`, `migrate:I>J` or `reject`, where I and J index
the view's workers in the order the router was given them. Served turns are due by their TTFT
objective (`due_ms`), as the adaptive policy's are.
"""

from __future__ import annotations

import msgspec

from policies.types import (
    ClusterView,
    Colocate,
    Decision,
    Handoff,
    Migrate,
    Outcome,
    Recompute,
    Reject,
    Turn,
)  # fmt: skip


class ScriptedParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    plan: str = "colocate:0"


def _step(text: str) -> tuple[str, int, int]:
    action, _, workers = text.strip().partition(":")
    first, _, second = workers.partition(">")
    if action not in ("colocate", "recompute", "handoff", "migrate", "reject"):
        raise ValueError(f"unknown step {text!r}")
    return action, int(first or 0), int(second or 0)


class Scripted:
    Params = ScriptedParams
    name = "scripted"

    def __init__(self, params: ScriptedParams | None = None) -> None:
        self.steps = [_step(step) for step in (params or ScriptedParams()).plan.split(";")]
        self.turns: dict[str, int] = {}
        self.outcomes: list[Outcome] = []

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        index = self.turns.get(turn.session_id, 0)
        self.turns[turn.session_id] = index + 1
        action, first, second = self.steps[min(index, len(self.steps) - 1)]
        ids = [worker.worker_id for worker in view.workers]
        due = turn.objectives.ttft_ms
        match action:
            case "colocate":
                return Colocate(worker=ids[first], reason="scripted", due_ms=due)
            case "recompute":
                return Recompute(worker=ids[first], reason="scripted", due_ms=due)
            case "handoff":
                return Handoff(prefill_worker=ids[first], decode_worker=ids[second],
                               reason="scripted", due_ms=due)  # fmt: skip
            case "migrate":
                return Migrate(source=ids[first], destination=ids[second], reason="scripted",
                               due_ms=due)  # fmt: skip
        return Reject(retry_after_s=2.0, reason="scripted")

    def observe(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)
