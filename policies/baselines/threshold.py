"""`threshold`: conditional disaggregation on uncached prompt length (Dynamo, llm-d)."""

from __future__ import annotations

import msgspec

from policies.baselines.colocate import serve_on_decode_worker
from policies.baselines.disaggregate import handoff_to_decode_worker
from policies.params import require_non_negative
from policies.types import ClusterView, Decision, Outcome, Turn


class ThresholdParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`threshold`: hand off turns with at least this many uncached prompt tokens."""

    threshold: int = 1024

    def __post_init__(self) -> None:
        require_non_negative("threshold", self.threshold)


class ThresholdPolicy:
    """Hand off long uncached prefills; run short ones on the session's decode worker."""

    name = "threshold"
    Params = ThresholdParams

    def __init__(self, params: ThresholdParams | None = None) -> None:
        self.params = params if params is not None else ThresholdParams()
        self._threshold = self.params.threshold
        self._handoff_reason = f"uncached tokens >= threshold {self._threshold}"

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        if turn.uncached_tokens >= self._threshold:
            return handoff_to_decode_worker(view, self._handoff_reason)
        return serve_on_decode_worker(view)

    def observe(self, outcome: Outcome) -> None:
        """A fixed threshold learns nothing from outcomes."""
