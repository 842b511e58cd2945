"""The prediction error report: |predicted / realised - 1| per term, from an events file."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from bench.scripts.prediction_error import main, relative_errors, summarise, windows
from policies.types import Prediction
from router.obs.events import StageEvents


def _event(i: int, ttft: tuple[float, float], transfer: tuple[float, float] = (0.0, 0.0),
           outcome: str = "completed") -> StageEvents:  # fmt: skip
    return StageEvents(
        request_id=f"r{i}", session_id="s", done=float(i), outcome=outcome,  # type: ignore[arg-type]
        predicted=Prediction(ttft_ms=ttft[0], exposed_transfer_ms=transfer[0]),
        realised=Prediction(ttft_ms=ttft[1], exposed_transfer_ms=transfer[1]),
    )  # fmt: skip


def test_relative_errors_skip_terms_not_predicted_or_not_measured() -> None:
    events = [
        _event(0, (150.0, 100.0), (10.0, 8.0)),
        _event(1, (50.0, 100.0)),  # colocated: no transfer either way
        _event(2, (0.0, 100.0)),  # not predicted
        _event(3, (100.0, 100.0), outcome="error"),
    ]
    assert relative_errors(events, "ttft_ms") == [pytest.approx(0.5), pytest.approx(0.5)]
    assert relative_errors(events, "exposed_transfer_ms") == [pytest.approx(0.25)]


def test_summary_counts_only_turns_after_the_warm_up() -> None:
    errors = [1.0] * 5 + [0.1, 0.2, 0.3]
    summary = summarise(errors, "ttft_ms", after=5)
    assert summary.turns == 3 and summary.median == pytest.approx(0.2)
    assert summarise(errors, "ttft_ms", after=10).median is None
    assert windows(errors, 4) == [(0, 1.0), (4, pytest.approx(0.25))]


def test_command_reads_an_events_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "events.jsonl"
    records = [_event(i, (100.0 + (50.0 if i < 3 else 5.0), 100.0)) for i in range(6)]
    path.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in records))
    assert main([str(path), "--after", "3", "--json"]) == 0
    summaries = msgspec.json.decode(capsys.readouterr().out)
    ttft = next(s for s in summaries if s["term"] == "ttft_ms")
    assert ttft["turns"] == 3 and ttft["median"] == pytest.approx(0.05)
