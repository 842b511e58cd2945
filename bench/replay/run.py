"""Live replay: send a trace's turns to an OpenAI-compatible endpoint and time every chunk.

Arrivals are open-loop at the trace's times divided by `rate_scale`; a later turn of a session
starts no earlier than its own `arrival_s` and no earlier than the previous turn's completion
plus its `think_s`. With `Trace.concurrency` set the replay is closed-loop: that many sessions
in flight, the next session (in `iter_turns` order) starting when one finishes, arrivals
ignored. Prompts come from `PromptSynth` with the trace's exact token counts; a turn's messages
repeat the previous turn's and the answer the client actually received. When a turn gets no
answer (rejected, error) the next turn carries a filler answer of the turn's `output_tokens`
words, so later prompts keep the trace's sizes. `max_tokens` is the turn's `output_tokens`
(at least 1) with `ignore_eos`, so the worker generates exactly that many.

Every request carries `X-Session-ID`, a unique `X-Request-Id` and its objectives as
`X-SLO-TTFT-Ms` / `X-SLO-ITL-Ms` (the turn's own, else from `Objectives`), so the router and
the report judge by the same numbers. Chunk timing and status rules: `bench.replay.stream`.

Router stage events are joined afterwards by request id (`join_stage_events`), from
`GET /admin/decisions` or the router's `--events` file. Joined, per request: `action`,
`recomputed_tokens`, `transferred_bytes`, `predicted_ttft_ms` (the policy's, when it made one)
and `exposed_transfer_ms` = (transfer_end - transfer_start) in ms when both are stamped
(handoff and migrate turns). Under the "decode"
first-token convention that time lies inside the TTFT; under "prefill" inside the first
inter-token gap. The convention itself is returned for the summary. Nothing else is taken
from the router: every latency is the client's own.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import random
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import aiohttp
import msgspec

from bench.replay.stream import PATHS, Api, StreamOutcome, error_text, stream_request
from bench.results.summary import (
    FirstTokenConvention,
    Objectives,
    RequestResult,
    Status,
    predicted_ttft,
)
from bench.traces.model import Conversation, Trace
from bench.traces.textgen import VOCABULARY, Message, PromptSynth, chat_prompt_tokens, count_words
from router.obs.events import StageEvents

DEFAULT_REQUEST_TIMEOUT_S = 600.0
_encode = msgspec.json.Encoder().encode


def filler_answer(conversation: Conversation, turn_index: int) -> str:
    """Stand-in answer for a turn that got none: `output_tokens` words, deterministic."""
    tokens = conversation.turns[turn_index].output_tokens
    rng = random.Random(f"answer:{conversation.session_id}:{turn_index}")
    return " ".join(rng.choices(VOCABULARY, k=tokens))


def run_duration_s(results: Sequence[RequestResult]) -> float:
    """From the first request sent to the last one finished (0.0 without results)."""
    if not results:
        return 0.0
    end = max(r.done_at if r.done_at is not None else r.sent_at for r in results)
    return max(0.0, end - min(r.sent_at for r in results))


class _Tally:
    """Counts by status, shown live with rich when asked to."""

    def __init__(self, total: int, show: bool) -> None:
        self.counts: dict[Status, int] = {"completed": 0, "rejected": 0, "error": 0}
        self._progress = None
        if show:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._progress = Progress(
                TextColumn("replay"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.description}"), refresh_per_second=2,
            )  # fmt: skip
            self._task = self._progress.add_task(self._text(), total=total)
            self._progress.start()

    def _text(self) -> str:
        c = self.counts
        return f"completed {c['completed']}  rejected {c['rejected']}  failed {c['error']}"

    def add(self, status: Status) -> None:
        self.counts[status] += 1
        if self._progress is not None:
            self._progress.update(self._task, advance=1, description=self._text())

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


# First-turn bodies built before the replay starts, at most this many bytes in all.
PREBUILT_BODY_BYTES = 256 << 20


class _Built(NamedTuple):
    """One turn's request as sent: the conversation so far, and the encoded body."""

    messages: list[Message]
    prompt: str
    prompt_tokens: int
    body: bytes


class _Replayer:
    def __init__(
        self, trace: Trace, session: aiohttp.ClientSession, target: str, api: Api,
        objectives: Objectives, policy_label: str, model: str | None, timeout_s: float,
        tally: _Tally, api_key: str | None,
    ) -> None:  # fmt: skip
        self.trace = trace
        self.session = session
        self.url = target.rstrip("/") + PATHS[api]
        self.api: Api = api
        self.objectives = objectives
        self.policy_label = policy_label
        self.model = model
        self.timeout_s = timeout_s
        self.tally = tally
        self.synth = PromptSynth(trace.block_tokens)
        self.results: list[RequestResult] = []
        self.run_id = uuid.uuid4().hex[:10]
        self._ids = itertools.count()
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # sessions in the order their first turns arrive
        self.order = [s.conversation for s in trace.iter_turns() if s.turn_index == 0]
        self._first_turns = self._prebuild_first_turns(PREBUILT_BODY_BYTES)
        self.t0 = time.perf_counter()

    def _prebuild_first_turns(self, budget_bytes: int) -> dict[str, _Built]:
        """First turns' bodies, built before the clock starts (up to `budget_bytes`).

        Synthesising a long prompt takes milliseconds of this loop: done at the turn's
        arrival, it would delay the chunk timestamps of every stream in flight.
        """
        built: dict[str, _Built] = {}
        total = 0
        for conversation in self.order:
            if total >= budget_bytes:
                break
            turn = built[conversation.session_id] = self._build(conversation, 0, [], "", "")
            total += len(turn.body)
        return built

    def _build(
        self, conversation: Conversation, index: int, messages: list[Message], prompt: str,
        answer: str,
    ) -> _Built:  # fmt: skip
        turn = conversation.turns[index]
        payload: dict[str, object] = {
            "max_tokens": max(1, turn.output_tokens), "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True,
        }  # fmt: skip
        if self.model is not None:
            payload["model"] = self.model
        if self.api == "chat":
            messages = self.synth.messages_for(conversation, index, messages, answer)
            payload["messages"] = messages
            prompt_tokens = chat_prompt_tokens(messages)
        else:
            prompt = self.synth.prompt_for_completion(conversation, index, prompt, answer)
            payload["prompt"] = prompt
            prompt_tokens = count_words(prompt)
        return _Built(messages, prompt, prompt_tokens, _encode(payload))

    async def run_open_loop(self) -> None:
        tasks: set[asyncio.Task[None]] = set()
        failures: list[BaseException] = []

        def done(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            error = None if task.cancelled() else task.exception()
            if error is not None:
                failures.append(error)

        try:
            for conversation in self.order:
                await _sleep_until(self.t0 + conversation.turns[0].arrival_s)
                task = asyncio.create_task(self.run_session(conversation, closed=False))
                tasks.add(task)
                task.add_done_callback(done)
            await asyncio.gather(*tasks)
        finally:
            await _cancel_all(tasks)
        if failures:  # a bug in the replay itself, not a failed request
            raise failures[0]

    async def run_closed_loop(self, concurrency: int) -> None:
        pending: Iterator[Conversation] = iter(self.order)

        async def slot() -> None:
            for conversation in pending:
                await self.run_session(conversation, closed=True)

        tasks = [asyncio.create_task(slot()) for _ in range(min(concurrency, len(self.order)))]
        try:
            await asyncio.gather(*tasks)
        finally:
            await _cancel_all(tasks)

    async def run_session(self, conversation: Conversation, closed: bool) -> None:
        messages: list[Message] = []
        prompt = answer = ""
        finished = time.perf_counter()
        last = len(conversation.turns) - 1
        for index, turn in enumerate(conversation.turns):
            if index:
                due = finished + turn.think_s
                await _sleep_until(due if closed else max(due, self.t0 + turn.arrival_s))
            built = self._first_turns.pop(conversation.session_id, None) if index == 0 else None
            if built is None:
                built = self._build(conversation, index, messages, prompt, answer)
            messages, prompt = built.messages, built.prompt
            outcome = await self.send(conversation, index, built.prompt_tokens, built.body,
                                      keep_text=index < last)  # fmt: skip
            finished = outcome.done_at or time.perf_counter()
            if index < last:
                answer = outcome.answer_text() if outcome.status == "completed" else ""
                if not answer.strip():
                    answer = filler_answer(conversation, index)

    async def send(
        self, conversation: Conversation, index: int, prompt_tokens: int, body: bytes,
        keep_text: bool,
    ) -> StreamOutcome:  # fmt: skip
        turn = conversation.turns[index]
        goals = self.objectives
        ttft_slo = turn.ttft_slo_ms
        if ttft_slo is None:
            ttft_slo = goals.ttft_base_ms + goals.ttft_per_prompt_token_ms * prompt_tokens
        itl_slo = goals.itl_ms if turn.itl_slo_ms is None else turn.itl_slo_ms
        request_id = f"{self.run_id}-{next(self._ids)}"
        headers = {
            "Content-Type": "application/json", "X-Session-ID": conversation.session_id,
            "X-Request-Id": request_id, "X-SLO-TTFT-Ms": f"{ttft_slo:.3f}",
            "X-SLO-ITL-Ms": f"{itl_slo:.3f}", **self._auth,
        }  # fmt: skip
        outcome = StreamOutcome()
        sent_at = time.perf_counter()
        try:
            await stream_request(self.session, self.url, body, headers, self.api, keep_text,
                                 self.timeout_s, outcome)  # fmt: skip
        except asyncio.CancelledError:
            outcome.status, outcome.error = "error", "cancelled: the replay was stopped"
            outcome.done_at = time.perf_counter()
            raise
        finally:
            usage, times = outcome.usage, outcome.chunk_times
            self.results.append(
                RequestResult(
                    request_id=request_id, session_id=conversation.session_id,
                    turn_index=index, klass=turn.klass, policy=self.policy_label,
                    sent_at=sent_at, first_chunk_at=times[0] if times else None,
                    chunk_times=times, done_at=outcome.done_at, status=outcome.status,
                    http_status=outcome.http_status, error=outcome.error,
                    prompt_tokens=usage.prompt_tokens if usage else prompt_tokens,
                    cached_tokens=usage.cached_tokens if usage else 0,
                    completion_tokens=usage.completion_tokens if usage else len(times),
                    ttft_slo_ms=turn.ttft_slo_ms, itl_slo_ms=turn.itl_slo_ms,
                )
            )  # fmt: skip
            self.tally.add(outcome.status)
        return outcome


async def _sleep_until(due: float) -> None:
    delay = due - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def _cancel_all(tasks: Iterable[asyncio.Future[None]]) -> None:
    pending = [task for task in tasks if not task.done()]
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


async def replay(
    trace: Trace,
    target: str,
    *,
    rate_scale: float = 1.0,
    limit: int | None = None,
    objectives: Objectives,
    api: Api = "chat",
    policy_label: str = "",
    model: str | None = None,
    progress: bool = False,
    session: aiohttp.ClientSession | None = None,
    stop: asyncio.Event | None = None,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    api_key: str | None = None,
) -> list[RequestResult]:
    """Replay `trace` against `target` (the base URL); results in the order requests were sent.

    `limit` keeps the first turns (`Trace.slice`), then arrivals are scaled. Setting `stop`
    ends the replay: no new request is sent, requests in flight are cancelled and recorded as
    "error" ("cancelled: ..."), and every request sent so far is returned.
    """
    if limit is not None:
        trace = trace.slice(limit)
    if rate_scale != 1.0:
        trace = trace.scaled(rate_scale)
    # A loaded trace is many long-lived objects: a full collection walking them would delay
    # the chunk timestamps of every stream in flight.
    gc.freeze()
    own = session is None
    if session is None:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    tally = _Tally(trace.num_turns, progress)
    replayer = _Replayer(trace, session, target, api, objectives, policy_label, model,
                         request_timeout_s, tally, api_key)  # fmt: skip
    if trace.concurrency is not None:
        work = asyncio.create_task(replayer.run_closed_loop(trace.concurrency))
    else:
        work = asyncio.create_task(replayer.run_open_loop())
    waits: list[asyncio.Future[None]] = [work]
    try:
        if stop is not None:
            waits.append(asyncio.create_task(_wait_set(stop)))
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await _cancel_all(waits)
        tally.close()
        if own:
            await session.close()
    if not work.cancelled():
        work.result()  # a bug in the replay itself surfaces here
    return sorted(replayer.results, key=lambda r: r.sent_at)


async def _wait_set(event: asyncio.Event) -> None:
    await event.wait()


# -- router stage events ----------------------------------------------------------------------
class _Decisions(msgspec.Struct):
    decisions: list[StageEvents]


_decode_events = msgspec.json.Decoder(StageEvents).decode
_decode_decisions = msgspec.json.Decoder(_Decisions).decode


def read_stage_events(path: str | Path) -> list[StageEvents]:
    """Every record of a router `--events` JSON-lines file (blank lines skipped)."""
    with open(path, "rb") as file:
        return [_decode_events(line) for line in file if line.strip()]


async def fetch_stage_events(
    session: aiohttp.ClientSession, target: str, admin_token: str, limit: int
) -> list[StageEvents]:
    """The router's most recent `limit` records from `GET /admin/decisions` (its ring holds
    the last 1024 by default: prefer the events file for longer runs)."""
    url = f"{target.rstrip('/')}/admin/decisions"
    headers = {"Authorization": f"Bearer {admin_token}"}
    async with session.get(url, params={"limit": str(max(1, limit))}, headers=headers) as reply:
        raw = await reply.read()
        if reply.status != 200:
            raise RuntimeError(f"GET {url} answered {reply.status}: {error_text(raw)}")
    return _decode_decisions(raw).decisions


def join_stage_events(
    results: Sequence[RequestResult], events: Iterable[StageEvents]
) -> tuple[list[RequestResult], int, FirstTokenConvention | None]:
    """Results with the router fields filled (see the module docstring), how many were
    joined, and the router's first-token convention (None when nothing joined)."""
    # the replay's X-Request-Id comes back as the client's id (older routers: the turn's)
    by_id = {event.client_request_id or event.request_id: event for event in events}
    joined: list[RequestResult] = []
    matched = 0
    convention: FirstTokenConvention | None = None
    for result in results:
        event = by_id.get(result.request_id)
        if event is None:
            joined.append(result)
            continue
        matched += 1
        convention = event.first_token_convention
        exposed = None
        if event.transfer_start is not None and event.transfer_end is not None:
            exposed = (event.transfer_end - event.transfer_start) * 1000.0
        joined.append(
            msgspec.structs.replace(
                result,
                action=event.action,
                recomputed_tokens=event.recomputed_tokens,
                transferred_bytes=event.transferred_bytes,
                exposed_transfer_ms=exposed,
                predicted_ttft_ms=predicted_ttft(event.predicted),
            )
        )
    return joined, matched, convention
