"""report.md and report.html: one document, two renderings, built from a `Summary`.

The document states the objectives used, then one row per run in four tables (requests and
goodput; client latency; placement; why requests were not good), the max goodput rate where
several rates were replayed, SLO attainment per workload class, and the figures (linked by
relative path).
"""

from __future__ import annotations

import html
from collections import defaultdict
from collections.abc import Sequence
from typing import NamedTuple

from bench.results.summary import Objectives, RunSummary, Summary, max_goodput_rate


class Heading(NamedTuple):
    level: int
    text: str


class Paragraph(NamedTuple):
    text: str


class Bullets(NamedTuple):
    items: tuple[str, ...]


class Table(NamedTuple):
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


class Image(NamedTuple):
    path: str
    caption: str


Block = Heading | Paragraph | Bullets | Table | Image
_DASH = "-"


def run_label(run: RunSummary, runs: Sequence[RunSummary]) -> str:
    """How a run is named in tables, figures and `RequestResult.policy`: its policy, plus
    `@{rate}x` when the same policy was run at several rates (e.g. `colocate@2x`)."""
    if sum(1 for other in runs if other.policy == run.policy) > 1:
        return f"{run.policy}@{run.rate_scale:g}x"
    return run.policy


def _ms(value: float | None) -> str:
    return _DASH if value is None else f"{value:.1f}"


def _bytes(value: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value} B"


def _max_goodput(run: RunSummary) -> str:
    value = run.max_goodput_rps  # set when a search (bench simulate) produced it
    return _DASH if value is None else f"{value:.2f}"


def objectives_text(objectives: Objectives, stall_ms: float) -> str:
    return (
        f"A request is good when it completes, its TTFT is at most {objectives.ttft_base_ms:g} ms"
        f" + {objectives.ttft_per_prompt_token_ms:g} ms per prompt token, and the p99 of its own"
        f" inter-token gaps is at most {objectives.itl_ms:g} ms. A turn's own objectives from"
        f" the trace, when it has them, win. Stalls are gaps over {stall_ms:g} ms. Latency"
        " statistics cover completed requests; TTFT and ITL are measured at the client."
    )


def _objectives(runs: Sequence[RunSummary], labels: Sequence[str]) -> list[Block]:
    blocks: list[Block] = [Heading(2, "Objectives")]
    distinct = {(run.objectives, run.stall_ms) for run in runs}
    if len(distinct) <= 1:
        objectives, stall = next(iter(distinct), (Objectives(), 250.0))
        blocks.append(Paragraph(objectives_text(objectives, stall)))
        return blocks
    items = [f"{label}: {objectives_text(run.objectives, run.stall_ms)}"
             for label, run in zip(labels, runs, strict=True)]  # fmt: skip
    blocks.append(Bullets(tuple(items)))
    return blocks


def _tables(runs: Sequence[RunSummary], labels: Sequence[str]) -> list[Block]:
    outcome, latency, placement = [], [], []
    for label, run in zip(labels, runs, strict=True):
        key = (label, f"{run.rate_scale:g}x")
        outcome.append((*key, str(run.requests), str(run.completed), str(run.rejected),
                        str(run.errors), str(run.good), f"{run.slo_attainment:.1%}",
                        f"{run.goodput_rps:.2f}", _max_goodput(run)))  # fmt: skip
        t, i, tp = run.ttft_ms, run.itl_ms, run.tpot_ms
        times = (t.p50, t.p90, t.p99, i.p50, i.p90, i.p99, i.max, tp.p50, tp.p99)
        latency.append((*key, *map(_ms, times), str(run.stalls)))
        actions = ", ".join(f"{a} {n}" for a, n in run.actions.items()) or _DASH
        exposed = run.exposed_transfer_ms
        placement.append((*key, run.first_token_convention, actions,
                          str(run.recomputed_tokens), str(run.evicted_tokens),
                          _bytes(run.transferred_bytes),
                          _ms(exposed.p50), _ms(exposed.p99)))  # fmt: skip
    return [
        Heading(2, "Requests and goodput"),
        Table(("run", "rate", "requests", "completed", "rejected", "errors", "good",
               "SLO attainment", "goodput (req/s)", "max goodput (req/s)"),
              tuple(outcome)),
        Heading(2, "Latency at the client (ms)"),
        Table(("run", "rate", "TTFT p50", "TTFT p90", "TTFT p99", "ITL p50", "ITL p90",
               "ITL p99", "ITL max", "TPOT p50", "TPOT p99", "stalls"), tuple(latency)),
        Heading(2, "Placement (router)"),
        Table(("run", "rate", "first token", "actions", "recomputed tokens",
               "evicted tokens", "transferred",
               "exposed transfer p50 (ms)", "exposed transfer p99 (ms)"), tuple(placement)),
    ]  # fmt: skip


def _max_goodput_rates(runs: Sequence[RunSummary]) -> list[Block]:
    points: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for run in runs:
        points[run.policy].append((run.rate_scale, run.slo_attainment))
    swept = {policy: pts for policy, pts in points.items() if len(pts) > 1}
    if not swept:
        return []
    rows = []
    for policy, pts in swept.items():
        best = max_goodput_rate(pts)
        rates = ", ".join(f"{r:g}x {a:.0%}" for r, a in sorted(pts))
        rows.append((policy, _DASH if best is None else f"{best:g}x", rates))
    return [
        Heading(2, "Max goodput rate"),
        Paragraph("The highest replayed rate scale at which at least 90% of requests were good."),
        Table(("policy", "max goodput rate", "attainment by rate"), tuple(rows)),
    ]


def _per_class(runs: Sequence[RunSummary], labels: Sequence[str]) -> list[Block]:
    classes = sorted({k for run in runs for k in run.per_class})
    if not classes or classes == [""]:
        return []
    rows = tuple(
        (k, *(f"{run.per_class[k]:.0%}" if k in run.per_class else _DASH for run in runs))
        for k in classes
    )
    return [Heading(2, "SLO attainment per workload class"), Table(("class", *labels), rows)]


def _misses(runs: Sequence[RunSummary], labels: Sequence[str]) -> list[Block]:
    rows = []
    for run, label in zip(runs, labels, strict=True):
        if (m := run.misses) is not None:
            late = f"{m.ttft_late} ({m.ttft_late_foreseen})"
            counts = (run.requests - run.good, m.rejected, m.failed)
            rows.append((label, f"{run.rate_scale:g}x", *map(str, counts), late, str(m.itl_over)))
    if not rows:
        return []
    why = (
        "Each request that missed counted once: rejected, failed, TTFT over its objective (in "
        "parentheses: placed with a predicted TTFT already over it, best effort), else the p99 "
        "of its gaps over its ITL objective."
    )
    header = ("run", "rate", "not good", "rejected", "failed", "TTFT late (foreseen)",
              "ITL p99 over")  # fmt: skip
    return [Heading(2, "Why requests were not good"), Paragraph(why), Table(header, tuple(rows))]


def build_report(
    summary: Summary, title: str, notes: Sequence[str], figures: Sequence[Image]
) -> list[Block]:
    runs = summary.runs
    labels = [run_label(run, runs) for run in runs]
    blocks: list[Block] = [Heading(1, title)]
    if notes:
        blocks.append(Bullets(tuple(notes)))
    blocks += _objectives(runs, labels)
    if not runs:
        blocks.append(Paragraph("No runs were recorded."))
        return blocks
    blocks += _tables(runs, labels)
    blocks += _misses(runs, labels)
    blocks += _max_goodput_rates(runs)
    blocks += _per_class(runs, labels)
    if figures:
        blocks.append(Heading(2, "Figures"))
        blocks += figures
    return blocks


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(blocks: Sequence[Block]) -> str:
    parts: list[str] = []
    for block in blocks:
        if isinstance(block, Heading):
            parts.append(f"{'#' * block.level} {block.text}")
        elif isinstance(block, Paragraph):
            parts.append(block.text)
        elif isinstance(block, Bullets):
            parts.append("\n".join(f"- {item}" for item in block.items))
        elif isinstance(block, Table):
            lines = ["| " + " | ".join(map(_md_cell, block.header)) + " |",
                     "|" + "---|" * len(block.header)]  # fmt: skip
            lines += ["| " + " | ".join(map(_md_cell, row)) + " |" for row in block.rows]
            parts.append("\n".join(lines))
        else:
            parts.append(f"![{block.caption}]({block.path})")
    return "\n\n".join(parts) + "\n"


_STYLE = (
    "body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em}"
    "table{border-collapse:collapse;margin:1em 0;font-size:0.9em}"
    "th,td{border:1px solid #ccc;padding:4px 8px;text-align:right}"
    "th:first-child,td:first-child{text-align:left}th{background:#f3f3f3}"
    "figure{margin:1.5em 0}img{max-width:100%}"
)


def render_html(blocks: Sequence[Block], title: str) -> str:
    esc = html.escape
    parts = [f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{esc(title)}</title>"
             f"<style>{_STYLE}</style></head><body>"]  # fmt: skip
    for block in blocks:
        if isinstance(block, Heading):
            parts.append(f"<h{block.level}>{esc(block.text)}</h{block.level}>")
        elif isinstance(block, Paragraph):
            parts.append(f"<p>{esc(block.text)}</p>")
        elif isinstance(block, Bullets):
            parts.append("<ul>" + "".join(f"<li>{esc(i)}</li>" for i in block.items) + "</ul>")
        elif isinstance(block, Table):
            head = "".join(f"<th>{esc(cell)}</th>" for cell in block.header)
            body = "".join(
                "<tr>" + "".join(f"<td>{esc(cell)}</td>" for cell in row) + "</tr>"
                for row in block.rows
            )
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        else:
            parts.append(f"<figure><img src='{esc(block.path)}' alt='{esc(block.caption)}'>"
                         f"<figcaption>{esc(block.caption)}</figcaption></figure>")  # fmt: skip
    parts.append("</body></html>\n")
    return "\n".join(parts)
