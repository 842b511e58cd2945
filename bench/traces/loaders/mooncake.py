"""Mooncake JSONL traces: `{"timestamp": ms, "input_length", "output_length", "hash_ids"}`.

`hash_ids` name the 512-token blocks of the whole prompt; two requests whose lists share a
leading run share that KV prefix. There are no session ids, so sessions are rebuilt:

1. The shared system prefix is the longest run of leading blocks common to more than
   `system_share` (default 50%) of all requests. It is a system prompt, not a conversation.
2. In timestamp order (stable), each request looks for the longest earlier request whose block
   list is a proper prefix of its own and longer than the system prefix. If that request is
   the latest turn of its conversation, this request is that conversation's next turn;
   otherwise (no match, or the match was already continued) it starts a new conversation.
   Conversations are indexed by their latest turn's full block list (a later request with an
   identical list takes the index over).

A later turn gets `new_input_tokens = input_length - previous input_length - previous
output_length` (floored at 0), `think_s = 0` and `arrival_s = timestamp / 1000`; a first turn's
`new_input_tokens` is `input_length` minus the system prefix tokens it carries.

What the shared file (FAST25-release synthetic_trace.jsonl, 3,993 requests, 0 to 1,022.025 s)
shows: `ceil(input_length / 512) == len(hash_ids)` on every row, so `input_length` counts the
whole prompt, shared blocks included, and a later turn's length includes its history (hence
the subtraction above). No request's block list strictly extends another's, so every request
is its own single-turn session (3,993 sessions). No block is common to most requests: the most
frequent one is in 24 requests (0.6%) and block 0 in one, so the system prefix is empty there
(the upstream README's "block 0 shared by almost all requests" does not hold for this file).
Reuse is across sessions instead: 1,782 requests start with a block an earlier request started
with, and 213 repeat an earlier request's entire block list.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from pathlib import Path

import msgspec

from bench.traces.loaders.common import first_line
from bench.traces.model import Conversation, Trace, TraceTurn


class MooncakeRecord(msgspec.Struct, frozen=True):
    """One request; unknown fields are tolerated (later releases add some)."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()


_RECORD_DECODER = msgspec.json.Decoder(MooncakeRecord)


def sniff(head: bytes) -> bool:
    line = first_line(head)
    return line.startswith(b"{") and b'"hash_ids"' in line and b'"input_length"' in line


def read_records(path: str | Path) -> list[MooncakeRecord]:
    with Path(path).open("rb") as handle:
        return [_RECORD_DECODER.decode(line) for line in handle if line.strip()]


def shared_system_prefix(block_lists: list[tuple[int, ...]], share: float = 0.5) -> tuple[int, ...]:
    """The leading blocks common to more than `share` of all lists (0.5 <= share < 1)."""
    if not 0.5 <= share < 1:
        raise ValueError("share must be in [0.5, 1)")
    threshold = share * len(block_lists)
    candidates = block_lists
    prefix: list[int] = []
    while True:
        depth = len(prefix)
        counts = Counter(h[depth] for h in candidates if len(h) > depth)
        if not counts:
            return tuple(prefix)
        # With share >= 0.5 at most one block can pass, so ties cannot matter.
        block, count = counts.most_common(1)[0]
        if count <= threshold:
            return tuple(prefix)
        candidates = [h for h in candidates if len(h) > depth and h[depth] == block]
        prefix.append(block)


class _Node:
    """A block-trie node; `owner` is the (conversation, turn) whose list ends here, if any."""

    __slots__ = ("children", "owner")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.owner: tuple[int, int] | None = None


def rebuild_sessions(
    records: list[MooncakeRecord], *, block_tokens: int = 512, system_share: float = 0.5
) -> tuple[Conversation, ...]:
    """Group requests into conversations (see the module docstring for the rule)."""
    ordered = sorted(records, key=lambda r: r.timestamp)
    system_prefix = shared_system_prefix([r.hash_ids for r in ordered], system_share)
    system_blocks = len(system_prefix)
    root = _Node()
    sessions: list[list[MooncakeRecord]] = []
    for record in ordered:
        blocks = record.hash_ids
        node = root
        match: tuple[int, int] | None = None
        for depth, block in enumerate(blocks[:-1], start=1):
            child = node.children.get(block)
            if child is None:
                break
            node = child
            if node.owner is not None and depth > system_blocks:
                match = node.owner
        if match is not None and match[1] == len(sessions[match[0]]) - 1:
            position = (match[0], len(sessions[match[0]]))
            sessions[match[0]].append(record)
        else:
            position = (len(sessions), 0)
            sessions.append([record])
        node = root
        for block in blocks:
            node = node.children.setdefault(block, _Node())
        node.owner = position
    return tuple(
        _conversation(f"mooncake-{i}", turns, system_prefix, block_tokens)
        for i, turns in enumerate(sessions)
    )


def _conversation(
    session_id: str,
    records: list[MooncakeRecord],
    system_prefix: tuple[int, ...],
    block_tokens: int,
) -> Conversation:
    first = records[0]
    system_tokens = 0
    if system_prefix and first.hash_ids[: len(system_prefix)] == system_prefix:
        system_tokens = min(len(system_prefix) * block_tokens, first.input_length)
    turns = [_turn(first, first.input_length - system_tokens)]
    for previous, record in itertools.pairwise(records):
        carried = previous.input_length + previous.output_length
        turns.append(_turn(record, max(0, record.input_length - carried)))
    return Conversation(session_id, tuple(turns), system_prefix_tokens=system_tokens)


def _turn(record: MooncakeRecord, new_input_tokens: int) -> TraceTurn:
    return TraceTurn(
        arrival_s=record.timestamp / 1000.0,
        new_input_tokens=new_input_tokens,
        output_tokens=record.output_length,
        prefix_blocks=record.hash_ids,
    )


def load_mooncake(
    path: str | Path,
    *,
    block_tokens: int = 512,
    system_share: float = 0.5,
    name: str | None = None,
) -> Trace:
    path = Path(path)
    records = read_records(path)
    for record in records:
        if record.timestamp < 0 or not math.isfinite(record.timestamp):
            raise ValueError(f"{path}: bad timestamp {record.timestamp!r}")
    conversations = rebuild_sessions(records, block_tokens=block_tokens, system_share=system_share)
    return Trace(
        name=name or path.stem,
        conversations=conversations,
        block_tokens=block_tokens,
        source=f"mooncake:{path.name}",
    )
