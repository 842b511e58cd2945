"""Stage events: what happened to each turn, when, and how it compared with the prediction.

The proxy fills one `StageEvents` per request as it goes (plain attribute stores, no I/O) and
hands it to `EventLog.record` when the request ends. The log keeps a bounded ring of recent
requests in memory and, when given a path, appends every record to a JSON-lines file from a
background thread, so the request path never waits on disk.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import IO, Literal

import msgspec

from policies.costmodel.calibration import queue_ahead
from policies.plan import Plan
from policies.types import Action, ClusterView, Decision, Outcome, Prediction

logger = logging.getLogger("router.obs.events")

EventOutcome = Literal["completed", "rejected", "error", "cancelled"]
FirstTokenConvention = Literal["decode", "prefill"]


class StageClock:
    """Unix-seconds timestamps read from one monotonic clock.

    The monotonic-to-wall offset is taken once, at construction, so every stage timestamp of
    every request is a cheap monotonic read, differences between stages are exact, and no
    `time.time()` call (nor its NTP steps) lands on the request path.
    """

    __slots__ = ("_monotonic", "_offset")

    def __init__(
        self,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._monotonic = monotonic
        self._offset = wall() - monotonic()

    def now(self) -> float:
        return self._monotonic() + self._offset


# Not forbid_unknown_fields: the events file outlives versions, and an older reader should
# still load records that carry newer fields.
class StageEvents(msgspec.Struct):
    """The stage timestamps (unix seconds; None for stages the turn skipped) and facts of one
    request. `predicted` is the policy's estimate; `realised` the same terms as measured,
    filled at completion. Ownership passes to `EventLog.record`: do not mutate it afterwards.
    """

    request_id: str
    session_id: str
    policy: str = ""
    action: Action | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None
    predicted: Prediction | None = None
    reason: str = ""
    admitted: float | None = None
    decided: float | None = None
    released: float | None = None  # the end of the hold the decision asked for, if any
    prefill_start: float | None = None
    prefill_end: float | None = None
    transfer_start: float | None = None
    transfer_end: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    done: float | None = None
    prompt_tokens: int = 0
    estimated_prompt_tokens: int = 0  # what the router assumed before the worker's usage
    cached_tokens: int = 0
    prefill_cached_tokens: int | None = None  # a split turn's prefill leg's, where reported
    completion_tokens: int = 0
    recomputed_tokens: int = 0
    transferred_bytes: int = 0
    outcome: EventOutcome | None = None
    error: str | None = None
    http_status: int | None = None
    retried: bool = False
    # the decode worker's running streams and the queue ahead at the prefill worker when placed
    # (its scraped waiting plus the legs in flight there the scrape has not counted)
    worker_running_at_start: int = 0
    worker_waiting_at_start: int = 0
    first_token_convention: FirstTokenConvention = "decode"
    realised: Prediction | None = None
    # the client's X-Request-Id, where it sent one: echoed to it, never sent to a worker or
    # a policy (`request_id` is the router's own)
    client_request_id: str | None = None

    def record_decision(self, policy: str, decision: Decision, plan: Plan, at: float) -> None:
        """The decision stage, as the live router and the simulator both record it."""
        self.decided = at
        self.policy = policy
        self.action = plan.action
        self.predicted = decision.predicted
        self.reason = decision.reason
        self.prefill_worker = plan.prefill_worker
        self.decode_worker = plan.answering_worker
        if plan.recomputed_tokens:
            self.recomputed_tokens = plan.recomputed_tokens

    def record_placement_load(self, view: ClusterView) -> None:
        """The answering worker's running streams and the queue ahead where the turn
        prefills, as `view` shows them (what `observe` learns queue waits from)."""
        answering = view.worker(self.decode_worker or "")
        prefilling = view.worker(self.prefill_worker or self.decode_worker or "")
        self.worker_running_at_start = answering.running if answering else 0
        self.worker_waiting_at_start = queue_ahead(prefilling) if prefilling else 0

    def to_outcome(self) -> Outcome:
        """The feedback a policy's `observe` takes; durations in ms, None where unmeasured."""
        if self.action is None:
            raise ValueError(f"request {self.request_id} was never placed")
        queue_start = self.decided if self.decided is not None else self.admitted
        held_ms = _ms(queue_start, self.released) or 0.0
        if self.released is not None:
            queue_start = self.released
        return Outcome(
            request_id=self.request_id,
            session_id=self.session_id,
            action=self.action,
            prefill_worker=self.prefill_worker,
            decode_worker=self.decode_worker,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            completion_tokens=self.completion_tokens,
            ok=self.outcome == "completed",
            queue_ms=_ms(queue_start, self.prefill_start),
            prefill_ms=_ms(self.prefill_start, self.prefill_end),
            transfer_ms=_ms(self.transfer_start, self.transfer_end),
            transfer_bytes=self.transferred_bytes,
            ttft_ms=_ms(self.admitted, self.first_token),
            decode_ms=_ms(self.first_token, self.last_token),
            worker_running_at_start=self.worker_running_at_start,
            worker_waiting_at_start=self.worker_waiting_at_start,
            predicted=self.predicted if self.predicted is not None else Prediction(),
            held_ms=held_ms if held_ms > 0.0 else 0.0,
            prefill_cached_tokens=self.prefill_cached_tokens,
        )


def _ms(start: float | None, end: float | None) -> float | None:
    if start is None or end is None:
        return None
    return (end - start) * 1000.0


class EventLog:
    """A bounded in-memory ring of recent `StageEvents`, plus an optional JSON-lines file.

    `record` is O(1) and never touches disk: it appends to the ring and, with a `path`, to a
    pending buffer that a writer thread drains in batches every `flush_interval_s` (sooner
    once `batch_size` records wait). If the disk falls behind by more than `max_pending`
    records, the oldest pending ones are dropped and counted in `dropped`; records lost to a
    failed write are counted in `failed`.
    """

    def __init__(
        self,
        ring_size: int = 1024,
        path: str | None = None,
        *,
        flush_interval_s: float = 0.25,
        batch_size: int = 512,
        max_pending: int = 65536,
    ) -> None:
        if ring_size < 1 or batch_size < 1 or max_pending < 1:
            raise ValueError("ring_size, batch_size and max_pending must be positive")
        self._ring: collections.deque[StageEvents] = collections.deque(maxlen=ring_size)
        self._path = path
        self._flush_interval_s = flush_interval_s
        self._batch_size = batch_size
        self._pending: collections.deque[StageEvents] = collections.deque(maxlen=max_pending)
        self._wake = threading.Event()
        self._closing = False
        self.dropped = 0
        self.failed = 0
        self.written = 0
        self.writer: threading.Thread | None = None
        if path is not None:
            self.writer = threading.Thread(
                target=self._write_loop, name="router-events-writer", daemon=True
            )
            self.writer.start()

    def record(self, events: StageEvents) -> None:
        self._ring.append(events)
        if self.writer is None or self._closing:
            return
        pending = self._pending
        if len(pending) == pending.maxlen:
            self.dropped += 1
        pending.append(events)
        if len(pending) >= self._batch_size:
            self._wake.set()

    def recent(self, limit: int | None = None) -> list[StageEvents]:
        """The most recent records, newest first (at most `limit`)."""
        return list(itertools.islice(reversed(self._ring), limit))

    async def close(self) -> None:
        """Stop accepting file writes and wait until everything recorded is on disk."""
        if self.writer is None or self._closing:
            return
        self._closing = True
        self._wake.set()
        await asyncio.get_running_loop().run_in_executor(None, self.writer.join)

    def _write_loop(self) -> None:
        assert self._path is not None
        encoder = msgspec.json.Encoder()
        try:
            file = _open_for_append(self._path)
        except OSError:
            logger.exception(
                "cannot open the events file %s; events go to the ring only", self._path
            )
            self._closing = True
            self.failed += len(self._pending)
            self._pending.clear()
            return
        with file:
            while True:
                self._wake.wait(self._flush_interval_s)
                self._wake.clear()
                # Read before draining: whatever was recorded before close() is then drained.
                closing = self._closing
                self._drain(file, encoder)
                if closing:
                    return

    def _drain(self, file: IO[bytes], encoder: msgspec.json.Encoder) -> None:
        pending = self._pending
        buffer = bytearray()
        count = 0
        # popleft is atomic, so this is safe against concurrent appends from `record`.
        while pending:
            encoder.encode_into(pending.popleft(), buffer, -1)
            buffer += b"\n"
            count += 1
        if not count:
            return
        try:
            file.write(buffer)
            file.flush()
            self.written += count
        except OSError:
            self.failed += count
            logger.exception("writing %d events to %s failed", count, self._path)


def _open_for_append(path: str) -> IO[bytes]:
    # A seam for tests that check no disk I/O happens outside the writer thread.
    return open(path, "ab")
