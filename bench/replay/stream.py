"""The replay client's HTTP side: one streamed OpenAI request, timestamped chunk by chunk.

Per read from the socket the client takes one `perf_counter` timestamp, then classifies the
complete SSE frames in it with byte checks only: a content frame (non-empty `content` or
`text`) gets that timestamp; `[DONE]` ends the stream. JSON is parsed only for the usage
frame and an error frame; the answer text is decoded from the kept content frames after the
stream ends, and only on request. `LagProbe` measures how late such timestamps can be.

Status: "completed" when the stream ends with `[DONE]` and no error frame; "rejected" for
HTTP 429; "error" for any other non-200 status, an error frame, a stream that ends without
`[DONE]`, a connection failure or the per-request timeout (`error` says which).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

import aiohttp
import msgspec

from bench.results.summary import Status
from router.turn.usage import Usage

Api = Literal["chat", "completions"]

_SEP = b"\n\n"
_DONE = b"data: [DONE]"
_ERROR = b'data: {"error"'
_USAGE = b'"usage":'
_QUOTE = b'"'
_CONTENT_KEYS: dict[Api, tuple[bytes, bytes]] = {
    "chat": (b'"content":"', b'"content": "'),
    "completions": (b'"text":"', b'"text": "'),
}
PATHS: dict[Api, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


class _UsageFrame(msgspec.Struct):
    usage: Usage | None = None


class _ErrorBody(msgspec.Struct):
    message: str = ""


class _ErrorFrame(msgspec.Struct):
    error: _ErrorBody | str | None = None


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    text: str | None = None


class _TextFrame(msgspec.Struct):
    choices: list[_Choice] = []


_decode_usage = msgspec.json.Decoder(_UsageFrame).decode
_decode_error = msgspec.json.Decoder(_ErrorFrame).decode
_decode_text = msgspec.json.Decoder(_TextFrame).decode


@dataclass(slots=True)
class StreamOutcome:
    """What the client saw of one streamed request (times are `perf_counter` seconds)."""

    status: Status = "error"
    http_status: int = 0
    error: str = ""
    chunk_times: list[float] = field(default_factory=list)
    done_at: float | None = None
    usage: Usage | None = None
    content_frames: list[bytes] = field(default_factory=list)

    def answer_text(self) -> str:
        """The streamed text, decoded from the kept content frames (`keep_text=True`)."""
        parts: list[str] = []
        for frame in self.content_frames:
            try:
                choices = _decode_text(frame[frame.find(b"{") :]).choices
            except msgspec.DecodeError:  # not JSON after all: no text from this frame
                continue
            for choice in choices:
                text = choice.delta.content if choice.delta is not None else choice.text
                if text:
                    parts.append(text)
        return "".join(parts)


def error_text(raw: bytes) -> str:
    try:
        body = _decode_error(raw).error
    except msgspec.DecodeError:
        return raw[:500].decode(errors="replace")
    if isinstance(body, _ErrorBody):
        return body.message
    return body or raw[:500].decode(errors="replace")


async def read_stream(
    response: aiohttp.ClientResponse, api: Api, keep_text: bool, outcome: StreamOutcome
) -> None:
    """Timestamp and classify the SSE frames of a 200 response into `outcome`."""
    compact, spaced = _CONTENT_KEYS[api]
    times = outcome.chunk_times
    stamp = times.append
    kept = outcome.content_frames
    clock = time.perf_counter
    pending = b""
    done = False
    async for data in response.content.iter_any():
        now = clock()
        if pending:
            data = pending + data
        end = data.rfind(_SEP)
        if end < 0:
            pending = data
            continue
        pending = data[end + 2 :]
        for frame in data[:end].split(_SEP):
            at = frame.find(compact)
            size = len(compact)
            if at < 0:
                at = frame.find(spaced)
                size = len(spaced)
            if at >= 0 and frame[at + size : at + size + 1] != _QUOTE:
                stamp(now)
                if keep_text:
                    kept.append(frame)
            elif frame.startswith(_DONE):
                done = True
                outcome.done_at = now
            elif frame.startswith(_ERROR):
                outcome.error = error_text(frame[6:]) or "error event in the stream"
            elif _USAGE in frame:  # `"usage":null` decodes to None and is ignored
                try:
                    outcome.usage = _decode_usage(frame[frame.find(b"{") :]).usage or outcome.usage
                except msgspec.DecodeError:
                    pass
    if not done and pending.strip().startswith(_DONE):  # a last frame without its blank line
        done = True
    if outcome.done_at is None:
        outcome.done_at = clock()
    if outcome.error:
        outcome.status = "error"
    elif not done:
        outcome.status, outcome.error = "error", "stream ended before [DONE]"
    else:
        outcome.status = "completed"


async def stream_request(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: dict[str, str],
    api: Api,
    keep_text: bool,
    timeout_s: float,
    outcome: StreamOutcome,
) -> None:
    """POST one streaming request and fill `outcome`; never raises except on cancellation."""
    try:
        async with session.post(
            url, data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as response:
            outcome.http_status = response.status
            if response.status != 200:
                outcome.status = "rejected" if response.status == 429 else "error"
                outcome.error = error_text(await response.read())
                outcome.done_at = time.perf_counter()
                return
            await read_stream(response, api, keep_text, outcome)
    except TimeoutError:
        outcome.status, outcome.error = "error", f"timed out after {timeout_s:g} s"
    except aiohttp.ClientError as exc:
        outcome.status, outcome.error = "error", f"{type(exc).__name__}: {exc}"
    if outcome.done_at is None:
        outcome.done_at = time.perf_counter()


class LagProbe:
    """Measures how late the client's event loop gets to data that is ready for it.

    A helper thread stamps `perf_counter()` every `interval_s` and hands the stamp to the loop
    (`call_soon_threadsafe`, which wakes it as arriving bytes would); a task on the loop takes
    it from a queue and records the delay. That is the path of a chunk's timestamp (I/O
    callback, then the reading task's wake-up), so the samples' tail bounds the timestamp
    error, with no timer granularity in it.
    """

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.samples: list[float] = []
        self._queue: asyncio.Queue[float] = asyncio.Queue()
        self._quit = threading.Event()
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._collect())
        self._thread = threading.Thread(target=self._tick, args=(loop,), name="lag-probe",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        put = self._queue.put_nowait
        while not self._quit.wait(self.interval_s):
            try:
                loop.call_soon_threadsafe(put, time.perf_counter())
            except RuntimeError:  # the loop closed under us
                return

    async def _collect(self) -> None:
        clock = time.perf_counter
        while True:
            sent = await self._queue.get()
            self.samples.append(clock() - sent)

    async def stop(self) -> None:
        self._quit.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)  # it exits as soon as it sees `_quit`
            self._thread = None
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def quantile_ms(self, q: float) -> float:
        """The q-quantile (0..1, nearest rank) of the samples in ms; 0.0 without samples."""
        ordered = sorted(self.samples)
        return ordered[round(q * (len(ordered) - 1))] * 1000.0 if ordered else 0.0
