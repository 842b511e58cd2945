"""`session-router demo` (what `make demo` runs): `bench compare` on the bundled demo trace.

The demo trace (`bench.traces.workloads.demo_trace`: 36 sessions, 72 turns over about 40 s; short
and long prompts; single-turn, shared-system-prompt and 4-turn sessions) is replayed live, once per
policy, against a fresh simulated 4 x H200 / Llama-3.1-8B cluster and router. At rate scale
`DEMO_RATE_SCALE` the arrivals span about 10 s; with think times (kept) and start-up each
policy takes about 20 s, so three or four policies finish inside two minutes on two cores.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from bench.compare import DEFAULT_CLUSTER, CompareSpec, compare, comparison_table
from bench.results.outputs import REPORT_HTML, REPORT_MD
from bench.traces.workloads import demo_trace
from policies import available_policies

DEMO_OUT = Path("bench-out/demo")
DEMO_RATE_SCALE = 4.0


def demo_policies() -> tuple[str, ...]:
    """The three baselines that differ most, plus `adaptive` when it is registered."""
    base = ("colocate", "disaggregate", "threshold")
    return (*base, "adaptive") if "adaptive" in available_policies() else base


async def run_demo(
    out_dir: Path = DEMO_OUT,
    policies: Sequence[str] | None = None,
    rate_scale: float = DEMO_RATE_SCALE,
    progress: bool = True,
    stop: asyncio.Event | None = None,
    console: Console | None = None,
) -> int:
    console = console or Console()
    chosen = tuple(policies) if policies else demo_policies()
    trace = demo_trace()
    spec = CompareSpec(policies=chosen, cluster=DEFAULT_CLUSTER, rate_scale=rate_scale)
    console.print(
        f"session-router demo: replaying the bundled trace ({trace.num_turns} turns of "
        f"{len(trace.conversations)} sessions: short and long prompts, single and multi-turn) "
        f"at {rate_scale:g}x its rate against a simulated {spec.cluster}, once per policy: "
        f"{', '.join(chosen)}. Each policy gets a fresh cluster and router."
    )
    summary = await compare(trace, spec, out_dir, progress=progress, stop=stop)
    console.print(comparison_table(summary))
    console.print(f"report: {out_dir / REPORT_MD}  (and {out_dir / REPORT_HTML}, with figures)")
    return 0 if len(summary.runs) == len(chosen) else 130
