"""A run's files: summary.json, requests.jsonl, report.md, report.html and the figures.

Used by live replay, `bench compare` and the discrete-event simulator alike. Layout of
`out_dir` after `write_run_outputs`:

    summary.json     `bench.results.summary.Summary` (schema in bench/results/summary.py)
    requests.jsonl   one `RequestResult` per line, as its JSON object: the client's
                     timestamps (sent_at, first_chunk_at, chunk_times, done_at; monotonic
                     seconds), status, token counts, objectives, and the router's stage fields
                     (action, recomputed_tokens, transferred_bytes, exposed_transfer_ms,
                     predicted_ttft_ms; null or 0 when not joined)
    report.md        objectives, one row per run, why requests were not good, per-class
                     attainment, figures
    report.html      the same document; images by relative path
    ttft_cdf.png, itl_cdf.png, slo_by_class.png, decisions.png

Figures group results by `RequestResult.policy`, which names the run
(`bench.results.report.run_label`: the policy, plus `@{rate}x` when a policy ran at several rates).
A figure with nothing to draw (e.g. decisions when no router fields were joined) is left out and
any stale copy removed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from bench.results.report import Image, build_report, render_html, render_markdown, run_label
from bench.results.summary import RequestResult, Summary, write_summary

SUMMARY = "summary.json"
REQUESTS = "requests.jsonl"
REPORT_MD = "report.md"
REPORT_HTML = "report.html"

_requests_decoder = msgspec.json.Decoder(RequestResult)


def write_requests(results: Sequence[RequestResult], path: str | Path) -> None:
    encoder = msgspec.json.Encoder()
    buffer = bytearray()
    for result in results:
        encoder.encode_into(result, buffer, -1)
        buffer += b"\n"
    Path(path).write_bytes(buffer)


def read_requests(path: str | Path) -> list[RequestResult]:
    with open(path, "rb") as file:
        return [_requests_decoder.decode(line) for line in file if line.strip()]


def group_results(
    results: Sequence[RequestResult], labels: Sequence[str] = ()
) -> dict[str, list[RequestResult]]:
    """Results by `policy` label: `labels` first (in order, when present), then the rest."""
    groups: dict[str, list[RequestResult]] = {label: [] for label in labels}
    for result in results:
        groups.setdefault(result.policy, []).append(result)
    return {label: members for label, members in groups.items() if members}


def write_run_outputs(
    out_dir: Path,
    summary: Summary,
    results: Sequence[RequestResult],
    title: str,
    notes: Sequence[str] = (),
) -> None:
    """Write every file of a run (see the module docstring) into `out_dir`, creating it."""
    from bench.results import plots  # matplotlib, the `bench` extra: only where figures are drawn

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_summary(summary, out_dir / SUMMARY)
    write_requests(results, out_dir / REQUESTS)
    labels = [run_label(run, summary.runs) for run in summary.runs]
    groups = group_results(results, labels)
    attainment = {label: run.per_class for label, run in zip(labels, summary.runs, strict=True)}
    drawings: list[tuple[str, str, Callable[[Path], bool]]] = [
        ("ttft_cdf.png", "TTFT CDF (client)", lambda p: plots.ttft_cdf(p, groups)),
        ("itl_cdf.png", "Inter-token gap CDF (client)", lambda p: plots.itl_cdf(p, groups)),
        ("slo_by_class.png", "SLO attainment per workload class",
         lambda p: plots.slo_by_class(p, attainment)),
        ("decisions.png", "Router decisions over time",
         lambda p: plots.decisions_over_time(p, groups)),
    ]  # fmt: skip
    figures: list[Image] = []
    for name, caption, draw in drawings:
        path = out_dir / name
        if draw(path):
            figures.append(Image(name, caption))
        else:
            path.unlink(missing_ok=True)
    blocks = build_report(summary, title, notes, figures)
    (out_dir / REPORT_MD).write_text(render_markdown(blocks), encoding="utf-8")
    (out_dir / REPORT_HTML).write_text(render_html(blocks, title), encoding="utf-8")
