"""Relay a worker's response to the client as bytes, reading only what the router must.

Server-sent-event frames are forwarded as soon as they are complete. The router looks inside
a frame only to spot the usage chunk (whose exact token counts it keeps, and drops when the
client did not ask for usage), the end marker, and, once, the first content frame.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass
from typing import Protocol

from router.errors import stream_error_frames
from router.http import UpstreamError, UpstreamTimeout
from router.turn.usage import Usage, usage_of

_SEP = b"\n\n"
_DONE = b"data: [DONE]"
_ERROR = b'data: {"error"'


def answer_usage(body: bytes) -> Usage | None:
    """The usage of a whole answer read at once: a JSON reply's, or an event stream's last
    usage frame."""
    if not body.startswith(b"data:"):
        return usage_of(body)
    at = body.rfind(b'"usage"')
    if at < 0:
        return None
    start = body.rfind(b"data:", 0, at)
    end = body.find(_SEP, at)
    return usage_of(body[start + 5 : end if end >= 0 else len(body)])


def _is_usage_frame(frame: bytes) -> bool:
    return b'"choices":[]' in frame or b'"choices": []' in frame


def _is_role_frame(frame: bytes) -> bool:
    """A role-only frame, in compact or spaced JSON (engines differ in spacing)."""
    return (b'"role":"assistant"' in frame or b'"role": "assistant"' in frame) and (
        b'"content":""' in frame or b'"content": ""' in frame
    )


@dataclass(slots=True)
class RelayResult:
    first_token_at: float | None = None  # monotonic
    last_token_at: float | None = None
    frames: int = 0
    usage: Usage | None = None
    completed: bool = False  # the worker ended the stream with [DONE]
    error: str | None = None  # set when the stream failed mid-way
    timed_out: str | None = None  # the deadline the worker missed ("gap", ...), if that was it


class Downstream(Protocol):
    """Where a relay writes: the client's stream (`router.http.StreamWriter`)."""

    async def write(self, data: bytes) -> None: ...

    async def end(self, last: bytes = b"") -> None: ...


class StreamRelay:
    """Copies one upstream SSE stream to an already prepared client response."""

    def __init__(
        self,
        downstream: Downstream,
        forward_usage: bool,
        drop_first_content: bool = False,
        on_first_content: Callable[[], None] | None = None,
    ) -> None:
        self._downstream = downstream
        self._on_first_content = on_first_content
        self._forward_usage = forward_usage
        self._drop_first_content = drop_first_content
        # with the prefill leg's token already sent, its role frame was sent too
        self._drop_role = drop_first_content
        self.result = RelayResult()

    async def run(self, upstream: AsyncIterable[bytes], first: bytes = b"") -> RelayResult:
        """Relay `upstream` to the client; `first`: its bytes already read, relayed first."""
        result = self.result
        pending = b""
        draining = False  # past [DONE]: read to the end, so that the connection can be reused
        try:
            if first:
                pending = first
                if _SEP in pending:
                    *frames, pending = pending.split(_SEP)
                    out = self._filter(frames)
                    if result.completed:
                        draining = True
                        await self._downstream.end(out)
                    elif out:
                        await self._downstream.write(out)
            async for data in upstream:
                if draining:
                    continue
                if not pending and self._content_only(data):
                    # the common read: whole content frames, relayed as they came
                    result.last_token_at = time.monotonic()
                    result.frames += data.count(_SEP)
                    await self._downstream.write(data)
                    continue
                pending += data
                if _SEP not in pending:
                    continue
                *frames, pending = pending.split(_SEP)
                out = self._filter(frames)
                if result.completed:
                    draining = True
                    await self._downstream.end(out)  # the last frames and the end: one send
                elif out:
                    await self._downstream.write(out)
        except (UpstreamError, TimeoutError) as exc:
            if result.completed:
                return result  # past [DONE]: the answer is whole, only its connection broke
            result.error = f"worker stream failed: {exc or type(exc).__name__}"
            if isinstance(exc, UpstreamTimeout):
                result.timed_out = exc.stage
        if result.completed:
            return result
        if result.error is None:
            result.error = "worker closed the stream before it finished"
        status = 504 if result.timed_out is not None else 502
        await self._downstream.write(stream_error_frames(status, result.error))
        return result

    def _content_only(self, data: bytes) -> bool:
        """Whether `data` is whole frames that `_filter` would pass on unchanged, each one a
        content frame after the first (markers inside a token's text just take the long way)."""
        if self.result.first_token_at is None or not data.endswith(_SEP):
            return False
        # the end marker, an error, a usage frame (either spacing), a role frame, an empty frame
        return not (
            b"[DONE]" in data or b'{"error"' in data or b'"choices":[]' in data
            or b'"choices": []' in data or b'"content":""' in data or b'"content": ""' in data
            or b"\n\n\n" in data
            or data.startswith(b"\n")
        )  # fmt: skip

    def _filter(self, frames: list[bytes]) -> bytes:
        result = self.result
        out: list[bytes] = []
        for frame in frames:
            if not frame:
                continue
            if frame.startswith(_DONE):
                result.completed = True
                out.append(frame + _SEP)
                continue
            if frame.startswith(_ERROR):
                result.error = "worker reported an error mid-stream"
            elif _is_usage_frame(frame):
                result.usage = usage_of(frame[frame.find(b"{") :]) or result.usage
                if not self._forward_usage:
                    continue
            elif _is_role_frame(frame):
                if self._drop_role:
                    continue
            else:
                now = time.monotonic()
                if result.first_token_at is None:
                    result.first_token_at = now
                    if self._on_first_content is not None:
                        self._on_first_content()
                    if self._drop_first_content:
                        # The prefill leg's token was already sent: skip the decode leg's copy.
                        self._drop_first_content = False
                        result.frames += 1
                        continue
                result.last_token_at = now
                result.frames += 1
            out.append(frame + _SEP)
        return b"".join(out)
