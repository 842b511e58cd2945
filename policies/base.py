"""The policy plugin interface."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from policies.types import ClusterView, Decision, Outcome, Turn


@runtime_checkable
class Policy(Protocol):
    """Decides where each turn runs. `decide` is pure and fast (no I/O, microseconds)."""

    name: str

    def decide(self, turn: Turn, view: ClusterView) -> Decision: ...

    def observe(self, outcome: Outcome) -> None: ...
