"""ShareGPT-style JSON: `[{"id", "conversations": [{"from": "human"|"gpt", "value": text}]}]`.

Also read as JSON Lines (one such object a line). Roles: `human`/`user` ask, `gpt`/`chatgpt`/
`assistant`/`bard`/`bing`/`model` answer, a `system` message before the first question is the
session's system prefix; anything else is ignored. Each question followed by an answer is a
turn; consecutive questions are merged into the next turn's input, consecutive answers into
the previous turn's output, answers before the first question and a final unanswered question
are dropped, and an entry left with no turn is skipped. Token counts are whitespace-separated
words (the sim tokenizer), floored at 1 (a request always sends and asks for something).

Arrivals are synthesised: sessions start as a Poisson process at `rate_rps` (default
`DEFAULT_RATE_RPS` = 1.0 sessions per second) drawn with `random.Random(seed)` (default 0), in
file order. A later turn's `arrival_s` is its session's start (the replay waits for the
previous answer) and its `think_s` is exponential with mean `think_mean_s` (default 0: none),
drawn from the same generator. Session ids are the entries' `id` (`sharegpt-<index>` when
absent), made unique with a `#n` suffix.
"""

from __future__ import annotations

import random
from pathlib import Path

import msgspec

from bench.traces.loaders.common import first_line, unique_id
from bench.traces.model import Conversation, Trace, TraceTurn

DEFAULT_RATE_RPS = 1.0
_ASK = frozenset({"human", "user"})
_ANSWER = frozenset({"gpt", "chatgpt", "assistant", "bard", "bing", "model"})


class _Message(msgspec.Struct, frozen=True):
    role: str = msgspec.field(name="from", default="")
    value: str | None = None


class _Entry(msgspec.Struct, frozen=True):
    id: str | int | None = None
    conversations: list[_Message] = []


def sniff(head: bytes) -> bool:
    start = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if start.startswith(b"["):
        return b'"conversations"' in start
    line = first_line(head)
    return line.startswith(b"{") and b'"conversations"' in line


def read_entries(path: str | Path) -> list[_Entry]:
    data = Path(path).read_bytes()
    if data.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):
        return msgspec.json.decode(data.lstrip(b"\xef\xbb\xbf"), type=list[_Entry])
    decoder = msgspec.json.Decoder(_Entry)
    return [decoder.decode(line) for line in data.splitlines() if line.strip()]


def _words(message: _Message) -> int:
    return len(message.value.split()) if message.value else 0


def turn_sizes(messages: list[_Message]) -> tuple[int, list[tuple[int, int]]]:
    """(system prefix words, [(input words, output words), ...]) of one entry."""
    system = 0
    turns: list[list[int]] = []
    pending: int | None = None
    for message in messages:
        role = message.role.lower()
        if role == "system" and not turns and pending is None:
            system += _words(message)
        elif role in _ASK:
            pending = (pending or 0) + _words(message)
        elif role in _ANSWER:
            if pending is not None:
                turns.append([max(1, pending), _words(message)])
                pending = None
            elif turns:
                turns[-1][1] += _words(message)
    return system, [(new_input, max(1, output)) for new_input, output in turns]


def load_sharegpt(
    path: str | Path,
    *,
    rate_rps: float = DEFAULT_RATE_RPS,
    seed: int = 0,
    think_mean_s: float = 0.0,
    name: str | None = None,
) -> Trace:
    if not rate_rps > 0:
        raise ValueError("rate_rps must be > 0")
    if think_mean_s < 0:
        raise ValueError("think_mean_s must be >= 0")
    path = Path(path)
    rng = random.Random(seed)
    now = 0.0
    taken: set[str] = set()
    conversations: list[Conversation] = []
    for index, entry in enumerate(read_entries(path)):
        system, sizes = turn_sizes(entry.conversations)
        if not sizes:
            continue
        now += rng.expovariate(rate_rps)
        turns = []
        for number, (new_input, output) in enumerate(sizes):
            think = rng.expovariate(1.0 / think_mean_s) if number and think_mean_s else 0.0
            turns.append(TraceTurn(now, new_input, output, think_s=think))
        raw_id = "" if entry.id is None else str(entry.id)
        session_id = unique_id(raw_id or f"sharegpt-{index}", taken)
        conversations.append(Conversation(session_id, tuple(turns), system))
    return Trace(
        name=name or path.stem,
        conversations=tuple(conversations),
        source=f"sharegpt:{path.name}",
    )
