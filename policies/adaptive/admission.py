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

from policies.adaptive import tuning
from policies.adaptive.ledgers.legs import forget_oldest


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
        self.continuing += tuning.CONTINUING_RATE * (float(continues) - self.continuing)
        forget_oldest(sessions)

    def limit_ms(self, objective_ms: float) -> float:
        """The predicted TTFT past which a turn with this objective is rejected."""
        shed, most = 1.0 - self.continuing, tuning.MAX_FACTOR
        return objective_ms / shed if shed * most > 1.0 else objective_ms * most


class Deadlines:
    """When a served turn's first token is due (its decision's `due_ms`): its TTFT objective,
    but at most `DUE_CAP_FACTOR` times the laxest objective among the last `FRESH_WINDOW`
    turns that began a session, and at most that laxest objective for a light returning turn
    (it prefills little more than a fresh turn does, `LIGHT_FACTOR`; tunings in
    `policies.adaptive.tuning`).

    A worker with priority scheduling admits the turn due first. An objective that grows with
    the prompt makes a late turn of a long session due long after the fresh turns arriving
    beside it: admitted behind all of them, it waits through each burst, past its own
    objective near saturation. A light returning turn costs a fresh turn's work, but each
    wait behind fresh ones lets their prefills push its context out of the worker's prefix
    cache, which turns it into a whole prompt's prefill: due with them, it waits no longer."""

    __slots__ = ("_fresh", "_fresh_tokens", "_laxest", "_seen", "_tokens")

    def __init__(self) -> None:
        window = tuning.FRESH_WINDOW
        self._fresh: deque[float] = deque(maxlen=window)
        self._fresh_tokens: deque[int] = deque(maxlen=window)
        # Kept as the window slides, not summed or searched per turn: the tokens' sum, and
        # the fresh turns that may yet be the laxest (seen at, objective), laxest first.
        self._tokens = 0
        self._seen = 0
        self._laxest: deque[tuple[int, float]] = deque()

    def due_ms(self, objective_ms: float, fresh: bool, new_tokens: int) -> float:
        """The due time of a turn with this objective (`fresh`: it begins a session) that
        prefills `new_tokens` where it is placed."""
        fresh_objectives = self._fresh
        if fresh:
            self._add(objective_ms, new_tokens)
        if not fresh_objectives:
            return objective_ms
        laxest = self._laxest[0][1]
        cap = tuning.DUE_CAP_FACTOR * laxest
        if not fresh:
            tokens = self._fresh_tokens
            if new_tokens <= tuning.LIGHT_FACTOR * self._tokens / len(tokens):
                cap = laxest
        return objective_ms if objective_ms < cap else cap

    def _add(self, objective_ms: float, new_tokens: int) -> None:
        tokens = self._fresh_tokens
        if len(tokens) == tokens.maxlen:
            self._tokens -= tokens[0]
        tokens.append(new_tokens)
        self._tokens += new_tokens
        self._fresh.append(objective_ms)
        seen = self._seen = self._seen + 1
        laxest = self._laxest
        while laxest and not laxest[-1][1] > objective_ms:
            laxest.pop()  # never the laxest again: this one is as lax and leaves later
        laxest.append((seen, objective_ms))
        window = self._fresh.maxlen
        while window is not None and laxest[0][0] <= seen - window:
            laxest.popleft()
