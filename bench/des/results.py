"""What one simulated run returns, and how a failing policy is reported."""

from __future__ import annotations

from typing import Literal

import msgspec

from bench.results.summary import RequestResult

PolicyStage = Literal["decide", "observe", "decision"]


class PolicyFailure(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A policy raised (or returned an impossible decision): which, where and when.

    `stage` is "decide" or "observe" when the call raised, "decision" when it returned a
    decision naming a worker the cluster does not have. `time_s` is virtual time.
    """

    policy: str
    stage: PolicyStage
    request_id: str
    session_id: str
    time_s: float
    error: str
    traceback: str = ""

    def describe(self) -> str:
        return (
            f"policy {self.policy!r} failed in {self.stage} for request {self.request_id} "
            f"(session {self.session_id}) at t={self.time_s:.3f}s: {self.error}"
        )


class PolicyError(Exception):
    """Raised through the event loop to end the run at the failure."""

    def __init__(self, failure: PolicyFailure) -> None:
        super().__init__(failure.describe())
        self.failure = failure


class SimStats(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Cost of the simulation itself: events handled, engine steps, CPU seconds."""

    events: int
    steps: int
    inline_steps: int
    cpu_s: float
    virtual_s: float


class SimResult(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The client's view of every turn sent (all of them unless `failure` ended the run)."""

    policy: str
    rate_scale: float
    results: list[RequestResult]
    stats: SimStats
    failure: PolicyFailure | None = None
