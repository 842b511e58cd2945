"""How close the policy's predictions come to what the router measured, turn by turn.

The router records, for every completed turn its policy predicted, the predicted terms and
their measured counterparts (`StageEvents.predicted` and `.realised`: the TTFT, and a split
turn's exposed transfer). This reads a router's events file (`serve --events FILE`) in the
order turns finished and reports, per window of turns, the median of |predicted / realised -
1| for each: an online cost model that learns shows it falling towards 0.

    .venv/bin/python -m bench.scripts.prediction_error EVENTS.jsonl --window 100 --after 200
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import msgspec

from router.obs.events import StageEvents

TERMS = ("ttft_ms", "exposed_transfer_ms")
# A realised term below this is too short to compare a ratio against (a colocated turn has no
# transfer; a transfer of a few microseconds is below the clocks' resolution).
MIN_REALISED_MS = 0.05


class TermErrors(msgspec.Struct, frozen=True):
    term: str
    turns: int
    median: float | None  # median |predicted / realised - 1|, None without any turn


def read_events(path: Path) -> Iterator[StageEvents]:
    decode = msgspec.json.Decoder(StageEvents).decode
    with path.open("rb") as lines:
        for line in lines:
            if line.strip():
                yield decode(line)


def relative_errors(events: Iterable[StageEvents], term: str) -> list[float]:
    """|predicted / realised - 1| of `term` for each completed turn that predicted it, in
    the order given."""
    out = []
    for record in events:
        predicted, realised = record.predicted, record.realised
        if predicted is None or realised is None or record.outcome != "completed":
            continue
        guess, measured = getattr(predicted, term), getattr(realised, term)
        if guess > 0.0 and measured >= MIN_REALISED_MS:
            out.append(abs(guess / measured - 1.0))
    return out


def summarise(errors: list[float], term: str, after: int) -> TermErrors:
    tail = errors[after:]
    return TermErrors(term, len(tail), statistics.median(tail) if tail else None)


def windows(errors: list[float], size: int) -> list[tuple[int, float]]:
    """(first turn's index, median) per window of `size` turns."""
    return [(start, statistics.median(errors[start : start + size]))
            for start in range(0, len(errors), size)]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scripts.prediction_error",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("events", type=Path, help="a router's events file (JSON lines)")
    parser.add_argument("--window", type=int, default=100, help="turns per window")
    parser.add_argument(
        "--after",
        type=int,
        default=200,
        help="the summary counts the turns after this many (default 200)",
    )
    parser.add_argument("--json", action="store_true", help="the summary as JSON")
    args = parser.parse_args(argv)
    if args.window < 1 or args.after < 0:
        parser.error("--window must be at least 1 and --after at least 0")
    events = sorted(read_events(args.events), key=lambda e: e.done or 0.0)
    summaries = []
    for term in TERMS:
        errors = relative_errors(events, term)
        summaries.append(summarise(errors, term, args.after))
        if not args.json:
            print(f"{term}: {len(errors)} turns predicted")
            for start, median in windows(errors, args.window):
                print(f"  turns {start:>5}..{start + args.window - 1:<5} "
                      f"median |predicted/realised - 1| = {median:.3f}")  # fmt: skip
    if args.json:
        sys.stdout.buffer.write(msgspec.json.encode(summaries) + b"\n")
    else:
        for summary in summaries:
            text = "n/a" if summary.median is None else f"{summary.median:.3f}"
            print(f"{summary.term} after {args.after} turns: {summary.turns} turns, "
                  f"median {text}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
