"""Adaptive's verdict on a workload, adaptive's max goodput against the best baseline's, and
the report of a run's verdicts (shared by the simulator's acceptance and the live one)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from experiments.acceptance_workloads import Measured, Verdict, Workload


def verdict(workload: Workload, measured: list[Measured]) -> Verdict:
    """Adaptive against the best searched baseline (the first of equals, in variant order);
    screened baselines failed where adaptive passed (over `needs`): beaten by construction,
    they are the best only when no baseline was searched."""
    adaptive = next(m for m in measured if m.label == "adaptive")
    baselines = [m for m in measured if not m.label.startswith("adaptive")]
    searched = [m for m in baselines if not m.screened]
    best = max(searched or baselines, key=lambda m: m.max_goodput_rps)
    ours, theirs = adaptive.max_goodput_rps, best.max_goodput_rps
    ratio = ours / theirs if theirs > 0 else (math.inf if ours > 0 else 1.0)
    beaten = best.screened and adaptive.best_scale is not None
    passed = adaptive.failure is None and (ratio >= workload.needs or beaten)
    return Verdict(workload.name, workload.needs, best.label, best.max_goodput_rps,
                   adaptive.max_goodput_rps, ratio, passed, measured)  # fmt: skip


def rps_text(m: Measured) -> str:
    """A variant's max goodput as the tables show it: "<" an upper bound (screened), ">=" a
    lower bound (nothing failed)."""
    if m.failure:
        return "failed"
    if m.screened:
        return f"<{m.max_goodput_rps:.3g}"
    unbounded = m.best_scale is not None and m.failing_scale is None
    return (">=" if unbounded else "") + f"{m.max_goodput_rps:.3g}"


def _baseline_rps(v: Verdict) -> str:
    return next((rps_text(m) for m in v.measured if m.label == v.baseline), f"{v.baseline_rps:.3g}")


def _ratio(v: Verdict) -> str:
    screened = any(m.screened and m.label == v.baseline for m in v.measured)
    return (">" if screened else "") + f"{v.ratio:.2f}"


def render(
    verdicts: Sequence[Verdict], command: str, notes: Sequence[str], workers: int | None = None
) -> str:
    """The report: verdicts, each baseline's best variant, with `workers` each workload's split
    grid (max goodput by family and K), every variant's max goodput, adaptive's shortfalls."""
    lines = [
        "# Adaptive acceptance: max goodput (>= 90% of requests meet TTFT and ITL objectives)",
        "", f"Command: `{command}`", "", *[f"- {note}" for note in notes], "",
        "| workload | needs | best baseline | its max goodput/s | adaptive max goodput/s "
        "| ratio | verdict |", "|---|---:|---|---:|---:|---:|---|",
    ]  # fmt: skip
    lines += [f"| {v.workload} | {v.needs:g}x | {v.baseline} | {_baseline_rps(v)} | "
              f"{v.adaptive_rps:.3g} | {_ratio(v)} | {'pass' if v.passed else 'FAIL'} |"
              for v in verdicts]  # fmt: skip
    lines += ["", f"{sum(v.passed for v in verdicts)} of {len(verdicts)} workloads pass.", ""]
    lines += _best_per_policy(verdicts)
    if workers is not None:
        lines += _grids(verdicts, workers)
    lines += ["## Max goodput per variant (requests/s)", ""]
    for v in verdicts:
        lines.append(f"- {v.workload}: " + ", ".join(f"{m.label} {rps_text(m)}"
                                                     for m in v.measured))  # fmt: skip
    return "\n".join([*lines, "", *_shortfalls(verdicts), ""])


def _best_per_policy(verdicts: Sequence[Verdict]) -> list[str]:
    """Each baseline policy's best variant (its K and threshold in the label) per workload."""
    policies = ["colocate", "round-robin", "disaggregate", "threshold"]
    lines = ["## Each baseline's best variant (max goodput/s, layout)", "",
             "| workload | " + " | ".join(policies) + " | adaptive | ratio | verdict |",
             "|---|" + "---|" * (len(policies) + 3)]  # fmt: skip
    for v in verdicts:
        cells = []
        for policy in policies:
            ms = [m for m in v.measured if m.label.split(" ")[0] == policy]
            best = max(ms, key=lambda m: m.max_goodput_rps, default=None)
            cells.append("-" if best is None else f"{rps_text(best)} ({best.label})")
        lines.append(f"| {v.workload} | " + " | ".join(cells) + f" | {v.adaptive_rps:.3g} | "
                     f"{_ratio(v)} | {'pass' if v.passed else 'FAIL'} |")  # fmt: skip
    return [*lines, ""]


def _grids(verdicts: Sequence[Verdict], workers: int) -> list[str]:
    from experiments.acceptance_grid import grid_rows

    lines = ["## The split grid (max goodput/s by K prefill workers; . not searched)", ""]
    for v in verdicts:
        rows = grid_rows(v.measured, workers)
        if not rows:
            continue
        ks = range(1, workers)
        lines += [f"{v.workload}:", "", "| family | " + " | ".join(f"K={k}" for k in ks) + " |",
                  "|---|" + "---:|" * len(ks)]  # fmt: skip
        lines += [f"| {family} | " + " | ".join(cells) + " |" for family, cells in rows]
        lines.append("")
    return lines


def _shortfalls(verdicts: Sequence[Verdict]) -> list[str]:
    """Why adaptive's requests were not good at the lowest rate it failed (`MissCauses`)."""
    rows = []
    for v in verdicts:
        m = next((m for m in v.measured if m.label == "adaptive"), None)
        run = m.failing if m is not None else None
        if m is None or run is None or run.misses is None:
            continue
        c = run.misses
        # pooled over the probe's replicas; the counts are its first replay's
        good = next(p.attainment for p in m.probes if p.rate_scale == m.failing_scale)
        rows.append(f"| {v.workload} | {m.failing_scale:.4g}x | {good:.2%} | "
                    f"{run.requests - run.good} of {run.requests} | {c.rejected} | {c.failed} | "
                    f"{c.ttft_late} ({c.ttft_late_foreseen}) | {c.itl_over} |")  # fmt: skip
    if not rows:
        return []
    return [
        "", "## Where adaptive fell short", "",
        "Its probe at the lowest rate that failed (good: over all its replays; the counts: "
        "its first replay's): each request that was not good counted once (TTFT late: in "
        "parentheses, placed predicting it late, best effort).", "",
        "| workload | rate | good | not good | rejected | failed | TTFT late (foreseen) "
        "| ITL p99 over |", "|---|---:|---:|---:|---:|---:|---:|---:|", *rows,
    ]  # fmt: skip
