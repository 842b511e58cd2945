"""The report's figures, drawn with matplotlib's Agg renderer (no display, no pyplot state).

Each function takes the runs' results grouped by run label (`RequestResult.policy`) and writes
one PNG, returning False (and writing nothing) when there is nothing to draw.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from bench.results.summary import Objectives, RequestResult, is_good, itl_gaps_ms, ttft_ms

Groups = Mapping[str, Sequence[RequestResult]]
_MAX_POINTS = 2000
_BUCKETS = 30
# One colour per action everywhere, in the order actions stack.
ACTION_COLOURS = {
    "colocate": "#4c72b0", "handoff": "#dd8452", "migrate": "#55a868",
    "recompute": "#c44e52", "reject": "#8172b3",
}  # fmt: skip
_OTHER_COLOUR = "#937860"


def _thin(ordered: list[float]) -> tuple[list[float], list[float]]:
    """Points of the empirical CDF of sorted values, at most `_MAX_POINTS` of them."""
    n = len(ordered)
    step = max(1, math.ceil(n / _MAX_POINTS))
    index = list(range(0, n, step))
    if index[-1] != n - 1:
        index.append(n - 1)
    return [ordered[i] for i in index], [(i + 1) / n for i in index]


def _cdf(path: Path, samples: Mapping[str, list[float]], title: str, xlabel: str) -> bool:
    drawn = {label: sorted(values) for label, values in samples.items() if values}
    if not drawn:
        return False
    figure = Figure(figsize=(8, 4.5), layout="constrained")
    axes = figure.add_subplot()
    # zero gaps (chunks that arrived in one read) cannot sit on a log axis: they are masked,
    # while the curve still starts at their share
    low = min((v for values in drawn.values() for v in values if v > 0), default=0.0)
    high = max(values[-1] for values in drawn.values())
    for label, ordered in drawn.items():
        xs, ys = _thin(ordered)
        axes.step(xs, ys, where="post", label=f"{label} (n={len(ordered)})")
    if low > 0 and high / low > 20:
        axes.set_xscale("log", nonpositive="mask")
    axes.set_ylim(0, 1.02)
    axes.set_xlabel(xlabel)
    axes.set_ylabel("fraction")
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    _legend(axes, len(drawn))
    figure.savefig(path, dpi=100)
    return True


def _legend(axes: Axes, entries: int) -> None:
    if entries > 10:
        axes.legend(fontsize="x-small", ncols=2, loc="lower right")
    else:
        axes.legend(fontsize="small", loc="lower right")


def ttft_cdf(path: Path, groups: Groups) -> bool:
    samples = {
        label: [t for r in results if r.status == "completed" and (t := ttft_ms(r)) is not None]
        for label, results in groups.items()
    }
    return _cdf(path, samples, "Time to first token (client), completed requests", "TTFT (ms)")


def itl_cdf(path: Path, groups: Groups) -> bool:
    samples: dict[str, list[float]] = {}
    for label, results in groups.items():
        gaps: list[float] = []
        for r in results:
            if r.status == "completed":
                gaps.extend(itl_gaps_ms(r))
        samples[label] = gaps
    return _cdf(path, samples, "Inter-token gaps (client), all completed requests", "ITL (ms)")


def slo_by_class(path: Path, attainment: Mapping[str, Mapping[str, float]]) -> bool:
    """Grouped bars: per workload class, each run's fraction of good requests."""
    classes = sorted({k for per_class in attainment.values() for k in per_class})
    if not classes:
        return False
    runs = list(attainment)
    figure = Figure(figsize=(max(8.0, 0.25 * len(classes) * len(runs) + 2), 4.5),
                    layout="constrained")  # fmt: skip
    axes = figure.add_subplot()
    width = 0.8 / len(runs)
    for i, label in enumerate(runs):
        values = [attainment[label].get(k, math.nan) for k in classes]
        xs = [c + (i - (len(runs) - 1) / 2) * width for c in range(len(classes))]
        axes.bar(xs, values, width=width, label=label)
    axes.set_xticks(range(len(classes)), [k or "(no class)" for k in classes],
                    rotation=30, ha="right", fontsize="small")  # fmt: skip
    axes.axhline(0.9, color="grey", linestyle="--", linewidth=1)
    axes.set_ylim(0, 1.05)
    axes.set_ylabel("SLO attainment (good / requests)")
    axes.set_title("SLO attainment per workload class")
    figure.legend(loc="outside upper center", ncols=min(len(runs), 6),
                  fontsize="x-small" if len(runs) > 10 else "small")  # fmt: skip
    figure.savefig(path, dpi=100)
    return True


def _bucket_width(span_s: float) -> float:
    """A round bucket width giving about `_BUCKETS` buckets over `span_s` seconds."""
    raw = max(span_s, 1e-3) / _BUCKETS
    magnitude: float = 10.0 ** math.floor(math.log10(raw))
    return next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)


def decisions_over_time(path: Path, groups: Groups) -> bool:
    """Stacked counts of the router's actions per time bucket, one panel per run."""
    panels = {label: [r for r in results if r.action] for label, results in groups.items()}
    panels = {label: decided for label, decided in panels.items() if decided}
    if not panels:
        return False
    seen = Counter(r.action or "" for decided in panels.values() for r in decided)
    actions = [a for a in ACTION_COLOURS if a in seen] + sorted(set(seen) - set(ACTION_COLOURS))
    cols = min(len(panels), 3)
    rows = math.ceil(len(panels) / cols)
    figure = Figure(figsize=(5 * cols, 3 * rows), layout="constrained")
    grid = figure.subplots(rows, cols, squeeze=False)
    for (label, decided), axes in zip(panels.items(), grid.flat, strict=False):
        start = min(r.sent_at for r in groups[label])
        width = _bucket_width(max(r.sent_at for r in decided) - start)
        counts: Counter[tuple[int, str]] = Counter(
            (int((r.sent_at - start) // width), r.action or "") for r in decided
        )
        buckets = range(max(b for b, _ in counts) + 1)
        xs = [b * width for b in buckets]
        bottom = [0] * len(xs)
        for action in actions:
            heights = [counts[(b, action)] for b in buckets]
            axes.bar(xs, heights, width=width, bottom=bottom, align="edge", label=action,
                     color=ACTION_COLOURS.get(action, _OTHER_COLOUR))  # fmt: skip
            bottom = [a + b for a, b in zip(bottom, heights, strict=True)]
        axes.set_title(label, fontsize="small")
        axes.set_xlabel(f"time since start (s), {width:g} s buckets")
        axes.set_ylabel("turns decided")
    for axes in list(grid.flat)[len(panels) :]:
        axes.set_visible(False)
    handles, labels = next(iter(grid.flat)).get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside upper center", ncols=len(actions))
    figure.savefig(path, dpi=100)
    return True


def good_over_time(path: Path, groups: Groups, objectives: Mapping[str, Objectives]) -> bool:
    """Good requests per second by when they were sent, one line per run (its objectives from
    `objectives`, by label), over the same buckets for every run: where a load changes, which
    placement keeps up shows at a glance."""
    starts = {label: min(r.sent_at for r in results)
              for label, results in groups.items() if results}  # fmt: skip
    if not starts:
        return False
    span = max(max(r.sent_at for r in groups[label]) - start for label, start in starts.items())
    width = _bucket_width(span)
    buckets = int(span // width) + 1
    figure = Figure(figsize=(8, 4.5), layout="constrained")
    axes = figure.add_subplot()
    for label, start in starts.items():
        sent = Counter(int((r.sent_at - start) // width) for r in groups[label])
        good = Counter(int((r.sent_at - start) // width) for r in groups[label]
                       if is_good(r, objectives.get(label, Objectives())))  # fmt: skip
        xs = [(b + 0.5) * width for b in range(buckets)]
        line = axes.plot(xs, [good[b] / width for b in range(buckets)], label=f"{label} good",
                         linewidth=2)  # fmt: skip
        axes.plot(xs, [sent[b] / width for b in range(buckets)], linestyle=":", linewidth=1,
                  color=line[0].get_color())  # fmt: skip
    axes.set_xlabel(f"time since start (s), by when sent; {width:g} s buckets")
    axes.set_ylabel("requests/s (dotted: sent)")
    axes.set_ylim(bottom=0)
    axes.set_title("Good requests over time")
    _legend(axes, len(starts))
    figure.savefig(path, dpi=100)
    return True
