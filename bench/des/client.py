"""The replay client in virtual time: sends a trace's turns and keeps what it saw.

As `bench.replay.run` does it. Open loop: a session's first turn is sent at its arrival divided by
the rate scale; a later turn at max(its arrival / rate scale, previous turn's end + think_s)
(think times are not scaled, as `Trace.scaled`). Closed loop (`Trace.concurrency` set): that
many sessions are in flight, the next one (in `iter_turns` order) starts when one ends, and
arrivals are ignored (a later turn follows its predecessor after think_s). A turn that got no
answer (rejected, error) is followed by the next one carrying a filler answer of the turn's
`output_tokens` tokens, so later prompts keep the trace's sizes. Every turn's `RequestResult`
has its chunk timestamps as the client received them.
"""

from __future__ import annotations

from bench.des.loop import EventLoop
from bench.des.router import SimRouter
from bench.des.tokens import PromptBuilder
from bench.des.turns import TurnRequest
from bench.results.summary import RequestResult
from bench.traces.model import Conversation, Trace


class _Session:
    __slots__ = ("answer", "block_hashes", "conversation", "prompt", "turn_index")

    def __init__(self, conversation: Conversation) -> None:
        self.conversation = conversation
        self.turn_index = 0
        self.prompt: list[int] = []
        self.answer: list[int] = []
        self.block_hashes: list[int] = []  # of `prompt`, as far as computed


class Client:
    def __init__(
        self, trace: Trace, rate_scale: float, loop: EventLoop, kv_block_size: int | None = None
    ) -> None:
        """`kv_block_size`: the workers' KV block size, to hash each prompt's blocks once."""
        if not rate_scale > 0:
            raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
        self._trace = trace
        self._scale = rate_scale
        self._loop = loop
        self._prompts = PromptBuilder(trace.block_tokens, kv_block_size)
        self._router: SimRouter | None = None
        conversations = trace.conversations
        # Sessions in `iter_turns` order of their first turns.
        self._order = sorted(
            range(len(conversations)), key=lambda i: (conversations[i].turns[0].arrival_s, i)
        )
        self._next = 0
        self._unfinished = len(conversations)
        self.results: list[RequestResult] = []

    def attach(self, router: SimRouter) -> None:
        self._router = router

    @property
    def finished(self) -> bool:
        return self._unfinished == 0

    def start(self) -> None:
        if not self._order:
            self._loop.stop()
            return
        concurrency = self._trace.concurrency
        if concurrency is None:
            self._loop.at(self._first_arrival(self._next), self._open_arrival)
        else:
            for _ in range(min(concurrency, len(self._order))):
                self._loop.at(self._loop.now(), self._closed_start)

    def _first_arrival(self, position: int) -> float:
        conversation = self._trace.conversations[self._order[position]]
        return conversation.turns[0].arrival_s / self._scale

    def _open_arrival(self, _: object) -> None:
        self._start_next_session()
        if self._next < len(self._order):
            self._loop.at(self._first_arrival(self._next), self._open_arrival)

    def _closed_start(self, _: object) -> None:
        if self._next < len(self._order):
            self._start_next_session()

    def _start_next_session(self) -> None:
        session = _Session(self._trace.conversations[self._order[self._next]])
        self._next += 1
        self._send(session)

    def _send(self, session: _Session) -> None:
        assert self._router is not None
        conversation = session.conversation
        index = session.turn_index
        turn = conversation.turns[index]
        hashes = session.block_hashes  # the previous prompt's, still valid for this one
        if index == 0:
            prompt = self._prompts.first_prompt(conversation, hashes)
        else:
            prompt = self._prompts.next_prompt(
                conversation, index, session.prompt, session.answer, hashes
            )
        more = index + 1 < len(conversation.turns)
        session.prompt = prompt if more else []
        session.block_hashes = hashes if more else []
        request = TurnRequest(
            request_id=f"{conversation.session_id}#{index}",
            session_id=conversation.session_id,
            turn_index=index,
            klass=turn.klass,
            prompt=prompt,
            max_tokens=max(1, turn.output_tokens),
            ttft_slo_ms=turn.ttft_slo_ms,
            itl_slo_ms=turn.itl_slo_ms,
            keep_answer=more,
            owner=session,
            block_hashes=hashes,
        )
        self._router.handle(request)

    def on_done(
        self, request: TurnRequest, result: RequestResult, answer: list[int] | None
    ) -> None:
        self.results.append(result)
        session = request.owner
        assert isinstance(session, _Session)
        conversation = session.conversation
        session.turn_index += 1
        if session.turn_index < len(conversation.turns):
            session.answer = answer or []
            turn = conversation.turns[session.turn_index]
            now = self._loop.now()
            self._loop.at(
                max(turn.arrival_s / self._scale, now + turn.think_s), self._send, session
            )
            return
        self._unfinished -= 1
        if self._unfinished == 0:
            self._loop.stop()
        elif self._trace.concurrency is not None:
            self._loop.at(self._loop.now(), self._closed_start)
