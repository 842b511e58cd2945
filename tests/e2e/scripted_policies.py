"""Policies for end-to-end and real-engine tests, loaded by the router process as
`module:attr`."""

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
)


class NoParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class MigrateOnSecondTurn:
    """First turn on the first worker; second turn migrates to the next one; then stays."""

    Params = NoParams
    name = "migrate-on-second-turn"

    def __init__(self, params: NoParams | None = None) -> None:
        pass

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        ids = sorted(w.worker_id for w in view.workers if w.accepts_new_work)
        residency = view.residency
        if residency is None:
            return Colocate(ids[0], reason="first turn")
        if residency.turns == 1:
            others = [w for w in ids if w != residency.worker_id]
            return Migrate(residency.worker_id, others[0], reason="scripted migration")
        return Colocate(residency.worker_id, reason="stay")

    def observe(self, outcome: Outcome) -> None:
        return None


class HandoffParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    prefill: str
    decode: str
    due_ms: float | None = None  # when the turn is due, as the decision says


class AlwaysHandoff:
    """Every turn: prefill on `prefill`, decode on `decode` (worker ids), healthy or not."""

    Params = HandoffParams
    name = "always-handoff"

    def __init__(self, params: HandoffParams) -> None:
        self._params = params

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        params = self._params
        return Handoff(params.prefill, params.decode, reason="scripted", due_ms=params.due_ms)

    def observe(self, outcome: Outcome) -> None:
        return None


class HoldParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    hold_s: float


class HoldThenColocate:
    """Every turn: held `hold_s`, then whole on the first worker."""

    Params = HoldParams
    name = "hold-then-colocate"

    def __init__(self, params: HoldParams) -> None:
        self._hold_s = params.hold_s

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        first = min(w.worker_id for w in view.workers)
        return Colocate(first, hold_s=self._hold_s, reason="scripted hold")

    def observe(self, outcome: Outcome) -> None:
        return None


class ScriptedParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    plan: str = "colocate:0"


def _step(text: str) -> tuple[str, int, int]:
    action, _, workers = text.strip().partition(":")
    first, _, second = workers.partition(">")
    if action not in ("colocate", "recompute", "handoff", "migrate", "reject"):
        raise ValueError(f"unknown step {text!r}")
    return action, int(first or 0), int(second or 0)


class Scripted:
    """A policy that places each session's turns as a script says, for the real-engine suite: it
    makes the router carry out a given decision (a migration, a recompute, a rejection) against
    real engines, whatever a cost model would choose.

    `plan` is a `;`-separated list of steps, one per turn of a session (the last one repeats):
    `colocate:I`, `recompute:I`, `handoff:I>J`, `migrate:I>J` or `reject`, where I and J index
    the view's workers in the order the router was given them. Served turns are due by their TTFT
    objective (`due_ms`), as the adaptive policy's are."""

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
