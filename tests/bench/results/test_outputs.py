"""A run's files from hand-made results: all written, readable back, figures non-empty."""

from __future__ import annotations

import itertools
from pathlib import Path

import msgspec
import pytest

from bench.results.outputs import (
    group_results,
    read_requests,
    requests_file,
    write_requests,
    write_run_outputs,
)
from bench.results.report import run_label
from bench.results.summary import Objectives, RequestResult, Summary, read_summary, summarise

PNG = b"\x89PNG\r\n\x1a\n"
FIGURES = ("ttft_cdf.png", "itl_cdf.png", "slo_by_class.png", "good_over_time.png", "decisions.png")


def _results(label: str, count: int, *, routed: bool, start: float = 100.0) -> list[RequestResult]:
    """`count` requests 0.25 s apart; every fourth rejected; TTFT grows with the index; times
    to the microsecond, as the records file keeps them."""
    out = []
    for i in range(count):
        sent = start + 0.25 * i
        rejected = i % 4 == 3
        first = sent + 0.0625 * (1 + i % 3)
        chunks = [] if rejected else [round(first + 0.0078125 * k, 6) for k in range(8)]
        action = (
            ("reject" if rejected else ("handoff" if i % 2 else "colocate")) if routed else None
        )
        out.append(RequestResult(
            request_id=f"{label}-{i}", session_id=f"s{i % 5}", turn_index=i // 5,
            klass=("short", "long")[i % 2], policy=label, sent_at=sent,
            first_chunk_at=chunks[0] if chunks else None, chunk_times=chunks,
            done_at=chunks[-1] if chunks else sent + 0.001,
            status="rejected" if rejected else "completed", http_status=429 if rejected else 200,
            error="turn rejected" if rejected else "", prompt_tokens=1000 + i,
            completion_tokens=len(chunks), action=action,
            transferred_bytes=2**20 if action == "handoff" else 0,
            exposed_transfer_ms=1.5 if action == "handoff" else None,
        ))  # fmt: skip
    return out


def _summary(groups: dict[tuple[str, float], list[RequestResult]]) -> Summary:
    runs = [summarise(results, policy, rate, 10.0, "decode")
            for (policy, rate), results in groups.items()]  # fmt: skip
    return Summary(runs)


def test_writes_every_file_and_reads_back(tmp_path: Path) -> None:
    groups = {("colocate", 1.0): _results("colocate", 24, routed=True),
              ("disaggregate", 1.0): _results("disaggregate", 24, routed=True)}  # fmt: skip
    summary = _summary(groups)
    results = [r for rs in groups.values() for r in rs]
    write_run_outputs(tmp_path / "new" / "dir", summary, results, "A <test> run", ["note one"])
    out = tmp_path / "new" / "dir"
    assert read_summary(out / "summary.json") == summary
    assert read_requests(out / "requests.jsonl") == results
    for name in FIGURES:
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, name
    md = (out / "report.md").read_text()
    page = (out / "report.html").read_text()
    assert md.startswith("# A <test> run\n\n- note one\n\n## Objectives\n\nA request is good")
    assert "at most 1000 ms + 0.2 ms per prompt token" in md
    assert "inter-token gaps is at most 100 ms" in md
    assert "<h1>A &lt;test&gt; run</h1>" in page and "at most 100 ms" in page
    for name in FIGURES:
        assert f"]({name})" in md and f"<img src='{name}'" in page
    # one row per run, with the same cells in both renderings
    assert "| colocate | 1x | 24 | 18 | 6 | 0 | 18 | 75.0% | 1.80 | - |" in md
    assert ("<tr><td>colocate</td><td>1x</td><td>24</td><td>18</td><td>6</td><td>0</td>"
            "<td>18</td><td>75.0%</td><td>1.80</td><td>-</td></tr>") in page  # fmt: skip
    # the requests report no cached tokens: each colocated returning turn's context was evicted
    placement = "| colocate | 1x | decode | colocate 12, handoff 6, reject 6 | 0 | 5070 | 6.00 MiB"
    assert placement in md


def test_results_without_router_fields(tmp_path: Path) -> None:
    results = _results("live", 12, routed=False)
    (tmp_path / "decisions.png").write_bytes(b"stale")
    write_run_outputs(tmp_path, _summary({("live", 1.0): results}), results, "client only")
    assert not (tmp_path / "decisions.png").exists()
    for name in FIGURES[:4]:
        assert (tmp_path / name).read_bytes().startswith(PNG)
    md = (tmp_path / "report.md").read_text()
    assert "decisions.png" not in md
    assert "| live | 1x | decode | - | 0 | 0 | 0 B | - | - |" in md


def test_many_runs_policies_by_rates(tmp_path: Path) -> None:
    policies, rates = ("colocate", "disaggregate", "threshold"), (0.5, 1.0, 2.0)
    runs = []
    results: list[RequestResult] = []
    for policy, rate in itertools.product(policies, rates):
        label = f"{policy}@{rate:g}x"
        batch = _results(label, 8 if rate < 2 else 4, routed=True)
        if policy == "threshold" and rate == 2.0:  # everything rejected at the top rate
            batch = [msgspec.structs.replace(r, status="rejected", chunk_times=[],
                                             first_chunk_at=None) for r in batch]  # fmt: skip
        results += batch
        runs.append(summarise(batch, policy, rate, 10.0, "decode"))
    summary = Summary(runs)
    assert [run_label(run, runs) for run in runs][:2] == ["colocate@0.5x", "colocate@1x"]
    write_run_outputs(tmp_path, summary, results, "sweep")
    for name in FIGURES:
        assert (tmp_path / name).read_bytes().startswith(PNG)
    md = (tmp_path / "report.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| colocate@")]
    assert len(rows) == 3 * 4  # one row per colocate run in each of the four tables
    # every fourth request rejected, none otherwise missed: 2 of 8 at each rate
    assert "| colocate@1x | 1x | 2 | 2 | 0 | 0 (0) | 0 |" in md
    assert "## Max goodput rate" in md
    # attainment is 75% at every rate (every fourth request rejected): never >= 90%
    assert "| colocate | - | 0.5x 75%, 1x 75%, 2x 75% |" in md
    assert "| threshold | - | 0.5x 75%, 1x 75%, 2x 0% |" in md


@pytest.mark.parametrize(("limit", "name"), [(10**9, "requests.jsonl"), (100, "requests.jsonl.gz")])
def test_records_are_compressed_past_the_limit(tmp_path: Path, limit: int, name: str) -> None:
    results = _results("colocate", 24, routed=True)
    other = "requests.jsonl.gz" if name == "requests.jsonl" else "requests.jsonl"
    (tmp_path / other).write_bytes(b"stale")
    written = write_requests(results, tmp_path / "requests.jsonl", compress_over_bytes=limit)
    assert written == tmp_path / name == requests_file(tmp_path)
    assert not (tmp_path / other).exists()
    assert read_requests(written) == results


def test_records_keep_times_to_the_microsecond(tmp_path: Path) -> None:
    [result] = _results("colocate", 1, routed=True, start=1234.5678912345)
    assert result.sent_at != round(result.sent_at, 6)
    path = write_requests([result], tmp_path / "requests.jsonl")
    [back] = read_requests(path)
    assert back.sent_at == 1234.567891 and back.sent_at == pytest.approx(result.sent_at, abs=1e-6)
    assert back.chunk_times == pytest.approx(result.chunk_times, abs=1e-6)
    assert msgspec.structs.replace(back, sent_at=0.0, first_chunk_at=None, chunk_times=[],
        done_at=None) == msgspec.structs.replace(result, sent_at=0.0, first_chunk_at=None,
        chunk_times=[], done_at=None)  # fmt: skip


def test_no_runs(tmp_path: Path) -> None:
    write_run_outputs(tmp_path, Summary([]), [], "nothing", ["stopped before any run"])
    assert read_summary(tmp_path / "summary.json") == Summary([])
    assert read_requests(tmp_path / "requests.jsonl") == []
    assert not any((tmp_path / name).exists() for name in FIGURES)
    md = (tmp_path / "report.md").read_text()
    assert "No runs were recorded." in md and "A request is good" in md


@pytest.mark.parametrize(
    ("labels", "expected"),
    [((), ["b", "a"]), (("a", "b"), ["a", "b"]), (("c", "a"), ["a", "b"])],
)
def test_group_results_order(labels: tuple[str, ...], expected: list[str]) -> None:
    results = _results("b", 2, routed=False) + _results("a", 1, routed=False)
    groups = group_results(results, labels)
    assert list(groups) == expected
    assert [r.request_id for r in groups["b"]] == ["b-0", "b-1"]


def test_objectives_are_the_runs_own(tmp_path: Path) -> None:
    results = _results("p", 4, routed=False)
    run = summarise(results, "p", 1.0, 1.0, "prefill", stall_ms=50.0,
                    objectives=Objectives(300.0, 0.0, 25.0))  # fmt: skip
    write_run_outputs(tmp_path, Summary([run]), results, "custom")
    md = (tmp_path / "report.md").read_text()
    assert "at most 300 ms + 0 ms per prompt token" in md
    assert "at most 25 ms" in md and "gaps over 50 ms" in md
