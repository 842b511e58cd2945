"""A run's files: summary.json, requests.jsonl, report.md, report.html and the figures.

Used by live replay, `bench compare` and the discrete-event simulator alike. Layout of
`out_dir` after `write_run_outputs`:

    summary.json     `bench.results.summary.Summary` (schema in bench/results/summary.py)
    requests.jsonl   one `RequestResult` per line, as its JSON object: the client's
                     timestamps (sent_at, first_chunk_at, chunk_times, done_at; monotonic
                     seconds, rounded to the microsecond), status, token counts, objectives,
                     and the router's stage fields (action, recomputed_tokens,
                     transferred_bytes, exposed_transfer_ms, predicted_ttft_ms; null or 0
                     when not joined); past `COMPRESS_OVER_BYTES` of JSON it is written
                     gzip-compressed as requests.jsonl.gz instead (`requests_file` finds it)
    report.md        objectives, one row per run, why requests were not good, per-class
                     attainment, figures
    report.html      the same document; images by relative path
    ttft_cdf.png, itl_cdf.png, slo_by_class.png, decisions.png, good_over_time.png

Figures group results by `RequestResult.policy`, which names the run
(`bench.results.report.run_label`: the policy, plus `@{rate}x` when a policy ran at several rates).
A figure with nothing to draw (e.g. decisions when no router fields were joined) is left out and
any stale copy removed.
"""

from __future__ import annotations

import gzip
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


REQUESTS_GZ = REQUESTS + ".gz"
# Above this much JSON the records are gzipped: per-token chunk times make a 12,000-turn run
# about 60 MB of text, which compresses about 3.5-fold once rounded to the microsecond.
COMPRESS_OVER_BYTES = 16 * 2**20
_TIME_DIGITS = 6  # microseconds: far below any gap the reports resolve (ITL is in ms)


def rounded_times(result: RequestResult) -> RequestResult:
    """`result` with its timestamps to the microsecond: the shortest float text of a rounded
    time is half as long as a full double's, and it compresses twice as well."""

    def at(value: float | None) -> float | None:
        return None if value is None else round(value, _TIME_DIGITS)

    return msgspec.structs.replace(
        result,
        sent_at=round(result.sent_at, _TIME_DIGITS),
        first_chunk_at=at(result.first_chunk_at),
        done_at=at(result.done_at),
        chunk_times=[round(t, _TIME_DIGITS) for t in result.chunk_times],
    )


def write_requests(
    results: Sequence[RequestResult],
    path: str | Path,
    compress_over_bytes: int = COMPRESS_OVER_BYTES,
) -> Path:
    """The records as JSON lines at `path`, or gzipped at `path` + ".gz" once they pass
    `compress_over_bytes`; the other of the two files is removed. Returns the path written."""
    path = Path(path)
    packed = path.with_name(path.name + ".gz")
    encoder = msgspec.json.Encoder()
    buffer = bytearray()
    sink: gzip.GzipFile | None = None
    try:
        for result in results:
            encoder.encode_into(rounded_times(result), buffer, -1)
            buffer += b"\n"
            if sink is None and len(buffer) > compress_over_bytes:
                sink = gzip.open(packed, "wb", compresslevel=6)
            if sink is not None and len(buffer) >= 2**20:
                sink.write(buffer)
                buffer.clear()
        if sink is None:
            path.write_bytes(buffer)
            packed.unlink(missing_ok=True)
            return path
        sink.write(buffer)
    finally:
        if sink is not None:
            sink.close()
    path.unlink(missing_ok=True)
    return packed


def requests_file(out_dir: str | Path) -> Path:
    """The records file of the run in `out_dir`: requests.jsonl, else requests.jsonl.gz."""
    plain = Path(out_dir) / REQUESTS
    packed = Path(out_dir) / REQUESTS_GZ
    return packed if packed.exists() and not plain.exists() else plain


def read_requests(path: str | Path) -> list[RequestResult]:
    """The records of a requests.jsonl, or of a requests.jsonl.gz (by its name)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as file:
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
    objectives = {label: run.objectives for label, run in zip(labels, summary.runs, strict=True)}
    drawings: list[tuple[str, str, Callable[[Path], bool]]] = [
        ("ttft_cdf.png", "TTFT CDF (client)", lambda p: plots.ttft_cdf(p, groups)),
        ("itl_cdf.png", "Inter-token gap CDF (client)", lambda p: plots.itl_cdf(p, groups)),
        ("slo_by_class.png", "SLO attainment per workload class",
         lambda p: plots.slo_by_class(p, attainment)),
        ("decisions.png", "Router decisions over time",
         lambda p: plots.decisions_over_time(p, groups)),
        ("good_over_time.png", "Good requests over time",
         lambda p: plots.good_over_time(p, groups, objectives)),
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
