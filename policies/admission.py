"""When `adaptive` turns a turn away: a rejection sheds only what its session will not send again.

A turn whose best placement misses its TTFT objective misses it served or rejected. Rejecting
it frees its worker for the turns behind it, but a session that goes on sends the rejected
prompt again in its next turn, uncached, on top of that turn's own: the work comes back, and
that turn is the likelier to miss and be rejected in its turn. Of a rejected turn's work only
the share `1 - continuing` is shed, where `continuing` is the share of turns that continue a
session (learned from the session ids decided). So a turn is rejected only when its predicted
TTFT, scaled by that share, still exceeds the objective: past objective / (1 - continuing).
Fresh prompts are rejected past their objective, a workload of 2-turn sessions past twice it,
of 4-turn sessions (3 turns in 4 continue one) past 4 times it, and never past `MAX_FACTOR`.
"""

from __future__ import annotations

from policies.adaptive_ledgers import forget_oldest

LEARNING_RATE = 0.01  # the share follows about the last 100 turns
MAX_FACTOR = 20.0  # at most this many objectives: where nearly every turn continues a session


class Admission:
    """The share of decided turns that continue a session, and the TTFT past which a turn
    is rejected."""

    __slots__ = ("_sessions", "continuing")

    def __init__(self) -> None:
        self.continuing = 0.0
        # session -> (its latest request, whether that request continued the session): a
        # turn decided again counts once.
        self._sessions: dict[str, tuple[str, bool]] = {}

    def note(self, session_id: str, request_id: str) -> None:
        """Count a decided turn (again for a request already counted: no change)."""
        sessions = self._sessions
        last = sessions.pop(session_id, None)
        if last is not None and last[0] == request_id:
            sessions[session_id] = last
            return
        continues = last is not None
        sessions[session_id] = (request_id, continues)
        self.continuing += LEARNING_RATE * (float(continues) - self.continuing)
        forget_oldest(sessions)

    def limit_ms(self, objective_ms: float) -> float:
        """The predicted TTFT past which a turn with this objective is rejected."""
        shed = 1.0 - self.continuing
        return objective_ms / shed if shed * MAX_FACTOR > 1.0 else objective_ms * MAX_FACTOR
