"""The trace model: conversations of turns with arrival times, and its native file format.

A trace is what the bench replays: sessions (conversations), each a sequence of turns. A turn's
prompt is the whole context so far: the conversation's system prefix, every earlier turn's new
input and answer, then its own new input. So turn i of a conversation sends
`Conversation.context_tokens(i)` content tokens and asks for `output_tokens` back.

Timing: `arrival_s` is an offset from the trace start (time 0). For a session's first turn it is
when the turn is sent; for a later turn it is the earliest start: the replay sends it at
max(arrival_s, completion of the previous turn + think_s). With `Trace.concurrency` set the
trace is closed-loop: the replay keeps at most that many sessions in flight and starts the next
session (in `iter_turns` order) when one finishes, ignoring first-turn arrivals.

Native format (JSONL, UTF-8, one JSON object a line):

    line 1, the header:
        {"format": "session-router-trace", "version": 1, "name": str, "block_tokens": int,
         "source": str, "concurrency": int | null}
    every further line, one conversation:
        {"session_id": str, "system_prefix_tokens": int (default 0),
         "turns": [{"arrival_s": float, "new_input_tokens": int, "output_tokens": int,
                    "prefix_blocks": [int, ...], "think_s": float (default 0.0),
                    "ttft_slo_ms": float | null, "itl_slo_ms": float | null,
                    "klass": str (default "")}, ...]}

Fields at their default value may be omitted (the writer omits empty lists, nulls, empty
strings and a zero system prefix); unknown fields and other versions are errors. Blank lines
and a UTF-8 BOM are ignored. `write_native` then `read_native` gives back an equal `Trace`
(floats are written in their shortest round-tripping form).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Literal, NamedTuple

import msgspec

FORMAT: Literal["session-router-trace"] = "session-router-trace"
VERSION = 1


class TraceTurn(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One turn: `prefix_blocks` are ids of `block_tokens`-token prompt blocks (may be empty)."""

    arrival_s: float
    new_input_tokens: int
    output_tokens: int
    prefix_blocks: tuple[int, ...] = ()
    think_s: float = 0.0
    ttft_slo_ms: float | None = None
    itl_slo_ms: float | None = None
    klass: str = ""

    def __post_init__(self) -> None:
        if self.new_input_tokens < 0 or self.output_tokens < 0:
            raise ValueError("token counts must be >= 0")
        if self.arrival_s < 0 or self.think_s < 0:
            raise ValueError("arrival_s and think_s must be >= 0")


class Conversation(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One session: its turns in order, after a system prefix shared by every turn."""

    session_id: str
    turns: tuple[TraceTurn, ...]
    system_prefix_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.turns:
            raise ValueError(f"conversation {self.session_id!r} has no turns")
        if self.system_prefix_tokens < 0:
            raise ValueError("system_prefix_tokens must be >= 0")

    def context_tokens(self, turn_index: int) -> int:
        """Content tokens turn `turn_index` sends: system prefix, history and its new input."""
        tokens = self.system_prefix_tokens
        for turn in self.turns[:turn_index]:
            tokens += turn.new_input_tokens + turn.output_tokens
        return tokens + self.turns[turn_index].new_input_tokens


class ScheduledTurn(NamedTuple):
    """A turn in replay order, with the conversation it belongs to."""

    conversation: Conversation
    turn_index: int
    turn: TraceTurn


class Trace(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A named set of conversations to replay; `source` says where it came from."""

    name: str
    conversations: tuple[Conversation, ...]
    block_tokens: int = 512
    source: str = ""
    concurrency: int | None = None

    def __post_init__(self) -> None:
        if self.block_tokens <= 0:
            raise ValueError("block_tokens must be > 0")
        if self.concurrency is not None and self.concurrency <= 0:
            raise ValueError("concurrency must be > 0 when set")
        if len({c.session_id for c in self.conversations}) != len(self.conversations):
            raise ValueError("session ids must be unique within a trace")

    @property
    def num_turns(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    @property
    def duration_s(self) -> float:
        """The latest arrival offset (the trace starts at 0); 0.0 for an empty trace."""
        return max((t.arrival_s for c in self.conversations for t in c.turns), default=0.0)

    def iter_turns(self) -> Iterator[ScheduledTurn]:
        """Every turn in arrival order.

        A later turn never sorts before an earlier turn of its session: its key is the running
        maximum of the session's arrivals. Ties keep conversation, then turn, order.
        """
        keyed: list[tuple[float, int, int]] = []
        for ci, conversation in enumerate(self.conversations):
            ready = 0.0
            for ti, turn in enumerate(conversation.turns):
                ready = max(ready, turn.arrival_s)
                keyed.append((ready, ci, ti))
        keyed.sort()
        for _, ci, ti in keyed:
            conversation = self.conversations[ci]
            yield ScheduledTurn(conversation, ti, conversation.turns[ti])

    def slice(self, limit: int) -> Trace:
        """The first `limit` turns in `iter_turns` order: each session keeps a prefix of turns."""
        if limit < 0:
            raise ValueError("limit must be >= 0")
        kept: dict[str, int] = {}
        for n, scheduled in enumerate(self.iter_turns()):
            if n >= limit:
                break
            kept[scheduled.conversation.session_id] = scheduled.turn_index + 1
        conversations = tuple(
            msgspec.structs.replace(c, turns=c.turns[: kept[c.session_id]])
            for c in self.conversations
            if c.session_id in kept
        )
        return msgspec.structs.replace(self, conversations=conversations)

    def scaled(self, rate_scale: float) -> Trace:
        """Arrivals divided by `rate_scale` (2.0 = twice the request rate); think times kept."""
        if not rate_scale > 0:
            raise ValueError("rate_scale must be > 0")
        conversations = tuple(
            msgspec.structs.replace(
                c,
                turns=tuple(
                    msgspec.structs.replace(t, arrival_s=t.arrival_s / rate_scale) for t in c.turns
                ),
            )
            for c in self.conversations
        )
        return msgspec.structs.replace(self, conversations=conversations)


class _Header(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format: Literal["session-router-trace"]
    version: int
    name: str
    block_tokens: int = 512
    source: str = ""
    concurrency: int | None = None


_ENCODER = msgspec.json.Encoder()
_HEADER_DECODER = msgspec.json.Decoder(_Header)
_CONVERSATION_DECODER = msgspec.json.Decoder(Conversation)


def encode_native(trace: Trace) -> bytes:
    """The native JSONL bytes of `trace` (header line, then one line per conversation)."""
    header = _Header(
        FORMAT, VERSION, trace.name, trace.block_tokens, trace.source, trace.concurrency
    )
    lines = [_ENCODER.encode(header)]
    lines.extend(_ENCODER.encode(c) for c in trace.conversations)
    return b"\n".join(lines) + b"\n"


def decode_native(data: bytes) -> Trace:
    """Parse native JSONL bytes; ValueError (msgspec's errors are ValueErrors) on bad input."""
    lines = [line for line in data.removeprefix(b"\xef\xbb\xbf").splitlines() if line.strip()]
    if not lines:
        raise ValueError("empty trace file: expected a session-router-trace header line")
    header = _HEADER_DECODER.decode(lines[0])
    if header.version != VERSION:
        raise ValueError(f"unsupported {FORMAT} version {header.version} (expected {VERSION})")
    conversations = tuple(_CONVERSATION_DECODER.decode(line) for line in lines[1:])
    return Trace(
        name=header.name,
        conversations=conversations,
        block_tokens=header.block_tokens,
        source=header.source,
        concurrency=header.concurrency,
    )


def write_native(trace: Trace, path: str | Path) -> None:
    Path(path).write_bytes(encode_native(trace))


def read_native(path: str | Path) -> Trace:
    return decode_native(Path(path).read_bytes())


def is_native(head: bytes) -> bool:
    """Whether the first bytes of a file look like a native trace header."""
    first = head.lstrip(b"\xef\xbb\xbf \t\r\n").split(b"\n", 1)[0]
    return first.startswith(b"{") and b'"session-router-trace"' in first


def load_trace(path: str | Path) -> Trace:
    """Load any supported trace, choosing the format by content (never by file extension).

    Formats tried, in order: native, Mooncake JSONL, Azure CSV, BurstGPT CSV, ShareGPT JSON.
    Foreign formats load with their loader's defaults (see `bench.traces.loaders`).
    """
    # The loaders build on this module's model, so they are imported here, not at the top.
    from bench.traces.loaders import load_foreign

    path = Path(path)
    with path.open("rb") as handle:
        head = handle.read(65536)
    if is_native(head):
        return read_native(path)
    return load_foreign(path, head)
