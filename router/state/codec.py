"""Decoding of the shared state's Redis replies and invalidation messages into records."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from router.state.records import LinkState, SessionRecord, WorkerRecord


class SessionChange(msgspec.Struct, frozen=True, array_like=True):
    """One session record as a successful write left it, in an invalidation message."""

    session_id: str
    epoch: int
    owner: str
    tokens: int
    bytes: int
    turns: int
    last_seen: float

    def record(self) -> SessionRecord | None:
        if not self.owner:
            return None
        return SessionRecord(
            session_id=self.session_id,
            worker_id=self.owner,
            tokens=self.tokens,
            bytes=self.bytes,
            turns=self.turns,
            epoch=self.epoch,
            last_seen=self.last_seen,
        )


class Invalidation(msgspec.Struct, frozen=True, array_like=True):
    """What one session CAS batch publishes: the writing replica and every record it changed."""

    replica: str
    changes: list[SessionChange]


invalidation_decoder = msgspec.msgpack.Decoder(Invalidation)
worker_encoder = msgspec.msgpack.Encoder()
worker_decoder = msgspec.msgpack.Decoder(WorkerRecord)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def session_from_hash(
    session_id: str, fields: dict[bytes, bytes]
) -> tuple[int, SessionRecord | None]:
    """(epoch, record) from HGETALL of a session hash; (0, None) when it does not exist."""
    if not fields:
        return 0, None
    epoch = int(fields.get(b"epoch", 0))
    owner = fields.get(b"owner", b"").decode()
    if not owner:
        return epoch, None
    return epoch, SessionRecord(
        session_id=session_id,
        worker_id=owner,
        tokens=int(fields.get(b"tokens", 0)),
        bytes=int(fields.get(b"bytes", 0)),
        turns=int(fields.get(b"turns", 0)),
        epoch=epoch,
        last_seen=float(fields.get(b"last_seen", 0)),
    )


def session_from_cas(
    session_id: str, reply: Sequence[Any]
) -> tuple[bool, int, SessionRecord | None]:
    """(ok, epoch, record) from the session CAS script's reply."""
    ok, owner, tokens, nbytes, turns, epoch, last_seen = reply
    owner_text = _text(owner)
    if not owner_text:
        return bool(ok), int(epoch), None
    record = SessionRecord(
        session_id=session_id,
        worker_id=owner_text,
        tokens=int(tokens),
        bytes=int(nbytes),
        turns=int(turns),
        epoch=int(epoch),
        last_seen=float(last_seen),
    )
    return bool(ok), int(epoch), record


def link_from_ledger(
    src: str, dst: str, handoff: Any, migration: Any, count: Any, capacity: Any, observed: Any,
    now_ms: Any,
) -> LinkState:  # fmt: skip
    return LinkState(
        src=src,
        dst=dst,
        capacity_bps=float(capacity),
        observed_bps=float(observed),
        handoff_bytes=int(handoff),
        migration_bytes=int(migration),
        reservations=int(count),
        as_of=int(now_ms) / 1000.0,
    )


class Snapshot(msgspec.Struct, frozen=True):
    """The refresh script's reply: the fleet as every other replica sees it."""

    as_of: float
    workers: list[WorkerRecord]
    inflight: dict[str, int]
    links: list[LinkState]


def snapshot_from_refresh(reply: Sequence[Any]) -> Snapshot:
    now_ms, blobs, flat, rows = reply
    workers = []
    for blob in blobs:
        try:
            workers.append(worker_decoder.decode(blob))
        except msgspec.DecodeError:  # written by an incompatible router version: not ours
            continue
    inflight = {_text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}
    links = [
        link_from_ledger(_text(src), _text(dst), h, m, n, cap, obs, now_ms)
        for src, dst, cap, obs, h, m, n in rows
    ]
    return Snapshot(as_of=int(now_ms) / 1000.0, workers=workers, inflight=inflight, links=links)
