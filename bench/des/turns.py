"""A turn as the client sends it to the simulated router, and its state while placed."""

from __future__ import annotations

from collections.abc import Callable

from bench.des.ledger import Reservation
from bench.results.summary import RequestResult
from policies.plan import Plan
from policies.types import Decision, Residency, Turn, engine_priority_of
from router.obs.events import StageEvents


class TurnRequest:
    """One turn as the client sends it: the prompt's token ids and the turn's objectives."""

    __slots__ = ("block_hashes", "itl_slo_ms", "keep_answer", "klass", "max_tokens", "owner",
                 "prompt", "request_id", "sent_at", "session_id", "ttft_slo_ms",
                 "turn_index")  # fmt: skip

    def __init__(
        self, request_id: str, session_id: str, turn_index: int, klass: str, prompt: list[int],
        max_tokens: int, ttft_slo_ms: float | None, itl_slo_ms: float | None, keep_answer: bool,
        owner: object = None, block_hashes: list[int] | None = None,
    ) -> None:  # fmt: skip
        self.request_id = request_id
        self.session_id = session_id
        self.turn_index = turn_index
        self.klass = klass
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.ttft_slo_ms = ttft_slo_ms
        self.itl_slo_ms = itl_slo_ms
        self.keep_answer = keep_answer  # the session has a next turn that resends the answer
        self.owner = owner  # the client's state for the session
        # The prompt's KV block hashes, computed once for all legs (`SimRouter`); a session's
        # next turn extends the same list, as its prompt extends this one.
        self.block_hashes = [] if block_hashes is None else block_hashes
        self.sent_at = 0.0


def engine_priority_sent(decision: Decision, arrival_s: float, scheduling_policy: str) -> int:
    """What a decided turn's requests carry as `priority`: its due time where the engines
    schedule by priority and the decision says when it is due, else 0 (arrival order)."""
    priority = engine_priority_of(decision, arrival_s)
    return 0 if scheduling_policy != "priority" or priority is None else priority


# on_done(request, result, generated token ids or None)
DoneCallback = Callable[[TurnRequest, RequestResult, list[int] | None], None]


class Flight:
    """A placed turn's state between its legs."""

    __slots__ = ("decode", "events", "first_at", "first_token", "held", "plan", "preload",
                 "priority", "pull_bytes", "pull_started", "reported", "req", "reservation",
                 "residency", "served_by", "turn")  # fmt: skip

    def __init__(
        self, req: TurnRequest, turn: Turn, residency: Residency | None, events: StageEvents,
        priority: int, plan: Plan,
    ) -> None:  # fmt: skip
        self.req = req
        self.plan = plan
        self.turn = turn
        self.residency = residency
        self.events = events
        self.served_by = -1
        self.decode = -1
        self.reservation: Reservation | None = None
        self.held: tuple[int, str] | None = None  # (prefill worker, engine id) holding the KV
        self.first_at: float | None = None  # the prefill leg's token, streamed at once
        self.first_token: list[int] | None = None  # its id (when the answer is resent)
        self.reported: tuple[int, float] | None = None  # the pull's (bytes, seconds)
        self.preload = 0
        self.pull_bytes = 0
        self.pull_started = 0.0
        self.priority = priority  # what its requests carry to engines with priority scheduling
