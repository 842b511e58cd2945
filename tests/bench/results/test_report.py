"""The report document: run labels, exact tables, objectives, max goodput, both renderings."""

from __future__ import annotations

import msgspec
import pytest

from bench.results.report import (
    Block,
    Bullets,
    Heading,
    Image,
    Paragraph,
    Table,
    build_report,
    render_html,
    render_markdown,
    run_label,
)
from bench.results.summary import (
    ItlStats,
    MissCauses,
    Objectives,
    RunSummary,
    Summary,
    TailStats,
    TtftStats,
)


def _run(policy: str = "colocate", rate: float = 1.0, attainment: float = 1.0,
         **changes: object) -> RunSummary:  # fmt: skip
    run = RunSummary(
        policy=policy, rate_scale=rate, duration_s=10.0, first_token_convention="decode",
        stall_ms=250.0, objectives=Objectives(), requests=10, completed=9, rejected=1, errors=0,
        good=8, slo_attainment=attainment, goodput_rps=0.8,
        ttft_ms=TtftStats(12.25, 40.5, 99.0), itl_ms=ItlStats(5.0, 6.5, 20.125, 130.0),
        tpot_ms=TailStats(5.5, 7.0), stalls=0, recomputed_tokens=512,
        transferred_bytes=3 * 2**30 // 2, exposed_transfer_ms=TailStats(None, None),
        actions={"handoff": 7, "reject": 1, "colocate": 2}, per_class={"a": 1.0, "b": 0.5},
    )  # fmt: skip
    return msgspec.structs.replace(run, **changes)


@pytest.mark.parametrize(
    ("runs", "expected"),
    [
        ([("colocate", 1.0)], ["colocate"]),
        ([("colocate", 1.0), ("threshold", 1.0)], ["colocate", "threshold"]),
        ([("colocate", 0.5), ("colocate", 2.0), ("threshold", 1.0)],
         ["colocate@0.5x", "colocate@2x", "threshold"]),
    ],
)  # fmt: skip
def test_run_label(runs: list[tuple[str, float]], expected: list[str]) -> None:
    summaries = [_run(policy, rate) for policy, rate in runs]
    assert [run_label(run, summaries) for run in summaries] == expected


def test_tables_are_exact() -> None:
    run = _run(max_goodput_rps=3.25, evicted_tokens=128)
    blocks = build_report(Summary([run]), "T", [], [])
    tables = [b for b in blocks if isinstance(b, Table)]
    outcome, latency, placement, per_class = tables
    assert outcome.rows == (("colocate", "1x", "10", "9", "1", "0", "8", "100.0%", "0.80", "3.25"),)
    assert latency.rows == (
        ("colocate", "1x", "12.2", "40.5", "99.0", "5.0", "6.5", "20.1", "130.0", "5.5", "7.0",
         "0"),
    )  # fmt: skip
    assert placement.rows == (
        ("colocate", "1x", "decode", "handoff 7, reject 1, colocate 2", "512", "128", "1.50 GiB",
         "-", "-"),
    )  # fmt: skip
    assert per_class.header == ("class", "colocate")
    assert per_class.rows == (("a", "100%"), ("b", "50%"))
    assert not any(isinstance(b, Heading) and b.text == "Max goodput rate" for b in blocks)


def test_why_requests_were_not_good_per_run() -> None:
    misses = MissCauses(rejected=1, failed=0, ttft_late=4, ttft_late_foreseen=3, itl_over=2)
    runs = [_run(rate=1.0, good=3, misses=misses), _run(rate=2.0)]
    blocks = build_report(Summary(runs), "T", [], [])
    at = blocks.index(Heading(2, "Why requests were not good"))
    table = blocks[at + 2]
    assert isinstance(table, Table)
    assert table.header == ("run", "rate", "not good", "rejected", "failed",
                            "TTFT late (foreseen)", "ITL p99 over")  # fmt: skip
    # Only runs summarised with the causes (files written before them have none).
    assert table.rows == (("colocate@1x", "1x", "7", "1", "0", "4 (3)", "2"),)
    assert "Why requests were not good" not in render_markdown(
        build_report(Summary([_run()]), "T", [], [])
    )


def test_objectives_always_printed_and_per_run_when_they_differ() -> None:
    same = build_report(Summary([_run(), _run("threshold")]), "T", ["n"], [])
    assert same[:3] == [Heading(1, "T"), Bullets(("n",)), Heading(2, "Objectives")]
    assert isinstance(same[3], Paragraph) and "1000 ms + 0.2 ms per prompt token" in same[3].text
    tight = _run("threshold", objectives=Objectives(200.0, 0.0, 30.0))
    differ = build_report(Summary([_run(), tight]), "T", [], [])
    bullets = differ[2]
    assert isinstance(bullets, Bullets) and len(bullets.items) == 2
    assert bullets.items[1].startswith(
        "threshold: A request is good when it completes, its TTFT is at most 200 ms + 0 ms"
    )
    empty = build_report(Summary([]), "T", [], [])
    assert empty[1] == Heading(2, "Objectives")
    assert empty[-1] == Paragraph("No runs were recorded.")


def test_max_goodput_rate_over_replayed_rates() -> None:
    points = [("colocate", 1.0, 1.0), ("colocate", 2.0, 0.95), ("colocate", 4.0, 0.5),
              ("threshold", 1.0, 0.8), ("threshold", 2.0, 0.7), ("adaptive", 1.0, 1.0)]  # fmt: skip
    runs = [_run(policy, rate, attainment) for policy, rate, attainment in points]
    blocks = build_report(Summary(runs), "T", [], [])
    at = blocks.index(Heading(2, "Max goodput rate"))
    table = blocks[at + 2]
    assert isinstance(table, Table)
    assert table.rows == (
        ("colocate", "2x", "1x 100%, 2x 95%, 4x 50%"),
        ("threshold", "-", "1x 80%, 2x 70%"),
    )


def test_markdown_rendering() -> None:
    blocks: list[Block] = [Heading(1, "Title"), Paragraph("Some text."), Bullets(("a", "b")),
              Table(("x", "y|z"), (("1", "a|b"),)), Image("f.png", "A figure")]  # fmt: skip
    assert render_markdown(blocks) == (
        "# Title\n\nSome text.\n\n- a\n- b\n\n| x | y\\|z |\n|---|---|\n| 1 | a\\|b |\n\n"
        "![A figure](f.png)\n"
    )


def test_html_rendering_escapes() -> None:
    blocks: list[Block] = [Heading(2, "a < b"), Paragraph("x & y"), Table(("<h>",), (("<c>",),)),
              Image("f.png", "it's")]  # fmt: skip
    page = render_html(blocks, "T & U")
    assert "<title>T &amp; U</title>" in page
    assert "<h2>a &lt; b</h2>" in page and "<p>x &amp; y</p>" in page
    assert "<thead><tr><th>&lt;h&gt;</th></tr></thead><tbody><tr><td>&lt;c&gt;</td></tr>" in page
    assert "<img src='f.png' alt='it&#x27;s'>" in page
