"""Policies for end-to-end tests, loaded by the router process as `module:attr`."""

from __future__ import annotations

import msgspec

from policies.types import (
    ClusterView,
    Colocate,
    Decision,
    Handoff,
    Migrate,
    Outcome,
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
