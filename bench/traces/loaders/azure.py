"""Azure LLM inference traces (2023): CSV `TIMESTAMP,ContextTokens,GeneratedTokens`.

Timestamps are wall-clock text such as `2023-11-16 18:15:46.6805900` (seven fractional digits).
They are parsed exactly, to integer nanoseconds, so offsets carry no rounding from a float
epoch. `arrival_s` is the offset from the earliest row (the first row in the published files,
which are sorted). Each row is its own single-turn session `azure-<row>` (row counted from 0
after the header), with `ContextTokens` as new input, `GeneratedTokens` as output and no prefix
blocks (the trace has no session or prefix information).
"""

from __future__ import annotations

import csv
from datetime import date
from functools import lru_cache
from pathlib import Path

from bench.traces.loaders.common import csv_columns
from bench.traces.model import Conversation, Trace, TraceTurn

COLUMNS = ["timestamp", "contexttokens", "generatedtokens"]
_NS_PER_S = 1_000_000_000


def sniff(head: bytes) -> bool:
    return csv_columns(head) == COLUMNS


@lru_cache(maxsize=64)
def _day_ns(day: str) -> int:
    return date.fromisoformat(day).toordinal() * 86_400 * _NS_PER_S


def parse_timestamp_ns(text: str) -> int:
    """`YYYY-MM-DD HH:MM:SS[.f{1,9}]` (or a `T` separator) as integer ns since 0001-01-01."""
    value = text.strip()
    if len(value) < 19 or value[10] not in " T":
        raise ValueError(f"bad timestamp {text!r}")
    day, time_of_day = value[:10], value[11:]
    clock, _, fraction = time_of_day.partition(".")
    hours, minutes, seconds = clock.split(":")
    if len(fraction) > 9 or (fraction and not fraction.isdigit()):
        raise ValueError(f"bad fractional seconds in {text!r}")
    whole = int(hours) * 3600 + int(minutes) * 60 + int(seconds)
    return _day_ns(day) + whole * _NS_PER_S + int(fraction.ljust(9, "0"))


def load_azure(path: str | Path, *, name: str | None = None) -> Trace:
    path = Path(path)
    stamps: list[int] = []
    sizes: list[tuple[int, int]] = []
    with path.open(newline="", encoding="utf-8-sig") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None or [c.strip().lower() for c in header] != COLUMNS:
            raise ValueError(f"{path}: expected header TIMESTAMP,ContextTokens,GeneratedTokens")
        for line, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) != 3:
                raise ValueError(f"{path}:{line}: expected 3 columns, got {len(row)}")
            stamps.append(parse_timestamp_ns(row[0]))
            sizes.append((int(row[1]), int(row[2])))
    start = min(stamps, default=0)
    order = sorted(range(len(stamps)), key=stamps.__getitem__)
    conversations = tuple(
        Conversation(
            f"azure-{i}",
            (TraceTurn((stamps[i] - start) / _NS_PER_S, sizes[i][0], sizes[i][1]),),
        )
        for i in order
    )
    return Trace(
        name=name or path.stem,
        conversations=conversations,
        source=f"azure:{path.name}",
    )
