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

from collections import deque

from policies.adaptive.ledgers.legs import forget_oldest

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


# A served turn is due at most this many of the laxest recent fresh turn's objectives after
# it arrives (`Deadlines`); a light returning turn at most one.
DUE_CAP_FACTOR = 2.0
FRESH_WINDOW = 256  # the fresh sessions' turns whose objectives and prefills set those caps
# A returning turn is light when it prefills at most this many times the mean fresh turn's
# new tokens.
LIGHT_FACTOR = 1.5


class Deadlines:
    """When a served turn's first token is due (its decision's `due_ms`): its TTFT objective,
    but at most `DUE_CAP_FACTOR` times the laxest objective among the last `FRESH_WINDOW`
    turns that began a session, and at most that laxest objective for a light returning turn
    (its context cached where it prefills, it prefills little more than a fresh turn does).

    A worker with priority scheduling admits the turn due first. An objective that grows with
    the prompt (the default allows 0.2 ms a token, cached ones too) makes a late turn of a
    long session due many seconds after the fresh turns arriving beside it; admitted behind
    every one of them, it waits through each burst and, near saturation, past its own
    objective. Measured (2 x h200, p16384-g512-multi-turn-t4, seeds 0-2): uncapped, the
    highest rate with 90% good fell below first come, first served on two seeds; capped, it
    is at least as high on all three, and mixed-multi-turn keeps its gain.

    A light returning turn costs a fresh one's work, but while it waits behind them the
    contexts their prefills use push its own out of the worker's prefix cache (least recently
    used first): once the sessions' contexts outgrow that cache, each wait turns it into a
    whole prompt's prefill, which lengthens the queue the next ones wait in. Measured (2 x
    h200, p4096-g512-multi-turn-t4, 20 s of arrivals at 3.364x, seeds 0-2 pooled): 90.7% good
    capped at twice the fresh objective, 98.5% at once it (round-robin, first come first
    served: 98.5%); mixed-multi-turn's heavy returning turns (16k new tokens against a mean
    fresh prompt of 7k) keep their later due time and its goodput (98.0% and 98.1% at 0.6x)."""

    __slots__ = ("_fresh", "_fresh_tokens")

    def __init__(self) -> None:
        self._fresh: deque[float] = deque(maxlen=FRESH_WINDOW)
        self._fresh_tokens: deque[int] = deque(maxlen=FRESH_WINDOW)

    def due_ms(self, objective_ms: float, fresh: bool, new_tokens: int) -> float:
        """The due time of a turn with this objective (`fresh`: it begins a session) that
        prefills `new_tokens` where it is placed."""
        fresh_objectives = self._fresh
        if fresh:
            fresh_objectives.append(objective_ms)
            self._fresh_tokens.append(new_tokens)
        if not fresh_objectives:
            return objective_ms
        laxest = max(fresh_objectives)
        cap = DUE_CAP_FACTOR * laxest
        if not fresh:
            tokens = self._fresh_tokens
            if new_tokens <= LIGHT_FACTOR * sum(tokens) / len(tokens):
                cap = laxest
        return objective_ms if objective_ms < cap else cap
