"""BurstGPT traces: CSV `Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`.

`Timestamp` is seconds since the collection started; `arrival_s` is the offset from the
earliest kept row. BurstGPT's README documents failed requests as rows whose `Response tokens`
is 0 (the `*_without_fails_*` files drop them); they are skipped unless `include_failed`.
Each turn's `klass` is `"<Model>/<Log Type>"`, e.g. `ChatGPT/Conversation log`.

Releases with a session column (`Session ID`, `SessionID`, `session_id`, `Conversation ID`;
matched ignoring case, spaces and underscores) group rows into sessions, in timestamp order.
A later turn then gets `new_input_tokens = Request tokens - previous Request tokens - previous
Response tokens` (floored at 0) when `request_includes_history` (the default, as a chat
request carries its history), else `Request tokens`; `think_s = 0`, the arrival being the
trace's own timestamp. Without a session column every row is its own session
`burstgpt-<row>` (row counted from 0 after the header).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import NamedTuple

from bench.traces.loaders.common import csv_columns
from bench.traces.model import Conversation, Trace, TraceTurn

_REQUIRED = ("timestamp", "model", "requesttokens", "responsetokens")
_SESSION_COLUMNS = ("sessionid", "conversationid", "session", "conversation")


def _norm(column: str) -> str:
    return column.strip().strip('"').lower().replace(" ", "").replace("_", "")


def sniff(head: bytes) -> bool:
    columns = {_norm(c) for c in csv_columns(head)}
    return all(c in columns for c in _REQUIRED)


class _Row(NamedTuple):
    row: int
    timestamp: float
    request: int
    response: int
    session: str
    klass: str


def _read_rows(path: Path, include_failed: bool) -> list[_Row]:
    rows: list[_Row] = []
    with path.open(newline="", encoding="utf-8-sig") as handle:
        reader = csv.reader(handle)
        header = [_norm(c) for c in next(reader, [])]
        missing = [c for c in _REQUIRED if c not in header]
        if missing:
            raise ValueError(f"{path}: not a BurstGPT CSV (missing columns {missing})")
        at = {name: header.index(name) for name in _REQUIRED}
        log_at = header.index("logtype") if "logtype" in header else None
        session_at = next((header.index(c) for c in _SESSION_COLUMNS if c in header), None)
        for index, row in enumerate(reader):
            if not row:
                continue
            timestamp = float(row[at["timestamp"]])
            if not math.isfinite(timestamp):
                raise ValueError(f"{path}: bad timestamp {row[at['timestamp']]!r}")
            response = int(float(row[at["responsetokens"]]))
            if response == 0 and not include_failed:
                continue
            model = row[at["model"]].strip()
            log_type = row[log_at].strip() if log_at is not None else ""
            session = row[session_at].strip() if session_at is not None else ""
            rows.append(
                _Row(
                    index,
                    timestamp,
                    int(float(row[at["requesttokens"]])),
                    response,
                    session,
                    f"{model}/{log_type}" if log_type else model,
                )
            )
    return rows


def load_burstgpt(
    path: str | Path,
    *,
    include_failed: bool = False,
    request_includes_history: bool = True,
    name: str | None = None,
) -> Trace:
    path = Path(path)
    rows = sorted(_read_rows(path, include_failed), key=lambda r: r.timestamp)
    start = rows[0].timestamp if rows else 0.0
    groups: dict[str, list[_Row]] = {}
    for row in rows:
        # A row without a session value is a session of its own.
        key = f"session:{row.session}" if row.session else f"row:{row.row}"
        groups.setdefault(key, []).append(row)
    conversations: list[Conversation] = []
    for group in groups.values():
        turns: list[TraceTurn] = []
        previous: _Row | None = None
        for row in group:
            new_input = row.request
            if previous is not None and request_includes_history:
                new_input = max(0, row.request - previous.request - previous.response)
            turns.append(TraceTurn(row.timestamp - start, new_input, row.response, klass=row.klass))
            previous = row
        first = group[0]
        session_id = (
            f"burstgpt-session-{first.session}" if first.session else f"burstgpt-{first.row}"
        )
        conversations.append(Conversation(session_id, tuple(turns)))
    return Trace(
        name=name or path.stem,
        conversations=tuple(conversations),
        source=f"burstgpt:{path.name}",
    )
