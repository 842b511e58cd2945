"""What the acceptance of `adaptive` measures: its workloads (recorded traces, matrix classes),
the contending variants, and the records of each search and verdict."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path

import msgspec

from bench.results.summary import RunSummary
from bench.traces.model import Trace, load_trace
from bench.traces.phases import (
    PhasedSpec,
    generate_phased,
    mix_shift,
    ramp_shift,
    returning_burst,
    stitch,
)
from bench.traces.workloads import WorkloadSpec, cells, generate_matrix

TRACES = (("mooncake", "mooncake_synthetic_trace.jsonl"),
          ("azure-conv", "azure2023_AzureLLMInferenceTrace_conv.csv"),
          ("azure-code", "azure2023_AzureLLMInferenceTrace_code.csv"))  # fmt: skip
# Adaptive's bar where the mix is what a fixed layout cannot serve: mixed multi-turn sessions,
# a load that changes, a recorded conversation trace (issue 41); 1.0 elsewhere.
MULTI_TURN_NEEDS = 1.3
CONVERSATION_TRACES = frozenset(("mooncake", "azure-conv"))
# Replica k of a probe runs the engines with seeds `seed + REPLICA_SEED_STRIDE * k` (worker i
# adds i): apart from every other replica's for clusters of fewer workers.
REPLICA_SEED_STRIDE = 1000


class Variant(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One contender: a policy, its parameters and its layout: `prefill_workers` prefill
    workers (None: the default) and the rest decode, or with `mixed` every worker mixed."""

    label: str
    policy: str
    params: dict[str, str] = {}
    prefill_workers: int | None = None
    mixed: bool = False


class TraceSource(msgspec.Struct, frozen=True):
    """A recorded trace; at scale s, its first turns within `span_s` x s s (>= `min_turns`);
    the same turns for every replica (only the engines' noise differs)."""

    trace: Trace
    min_turns: int
    span_s: float

    def at(self, scale: float, replica: int = 0) -> Trace:
        window = self.span_s * scale
        turns = itertools.takewhile(lambda t: t.turn.arrival_s <= window, self.trace.iter_turns())
        return self.trace.slice(max(self.min_turns, sum(1 for _ in turns)))


class MatrixSource(msgspec.Struct, frozen=True):
    """Generated sessions; at scale s, those starting within `span_s` x s s (>= `min_sessions`
    a class): more sessions extend one arrival sequence (its generator has its own seed).
    Replica k draws its sessions with the spec's seed + k."""

    spec: WorkloadSpec
    min_sessions: int
    span_s: float

    def at(self, scale: float, replica: int = 0) -> Trace:
        classes = len(cells(self.spec))
        wanted = math.ceil(self.spec.arrival.rate_rps * scale * self.span_s / classes)
        per_class = max(self.min_sessions, wanted)
        spec = msgspec.structs.replace(
            self.spec, sessions_per_class=per_class, seed=self.spec.seed + replica
        )
        return generate_matrix(spec)


class PhasedSource(msgspec.Struct, frozen=True):
    """A non-stationary timeline (`bench.traces.phases`): at scale s, stretched by s, so that
    replayed at s its phases last what the spec says in wall time at s times its rates.
    Replica k draws its sessions with the spec's seed + k."""

    spec: PhasedSpec

    def at(self, scale: float, replica: int = 0) -> Trace:
        seeded = msgspec.structs.replace(self.spec, seed=self.spec.seed + replica)
        return generate_phased(seeded.stretched(scale))


class StitchedSource(msgspec.Struct, frozen=True):
    """Recorded traces one after the other: at scale s, each part's first turns within
    `span_s` x s / parts s (at least `min_turns` / parts), stitched (`phases.stitch`)."""

    parts: tuple[tuple[str, Trace], ...]
    min_turns: int
    span_s: float

    def at(self, scale: float, replica: int = 0) -> Trace:
        each = len(self.parts)
        windows = [(name, TraceSource(trace, -(-self.min_turns // each), self.span_s / each))
                   for name, trace in self.parts]  # fmt: skip
        return stitch("stitched", [(name, w.at(scale, replica)) for name, w in windows])


Source = TraceSource | MatrixSource | PhasedSource | StitchedSource


class Workload(msgspec.Struct, frozen=True):
    name: str
    source: Source
    needs: float  # adaptive's max goodput / the best baseline's at least


class Offered(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One probe: scale, attainment, turns, arrival rate (turns / their scaled span); over
    `replicas` replays, the attainment pooled (good requests over all) and turns and rate
    those of the first."""

    rate_scale: float
    attainment: float
    turns: int
    rps: float
    replicas: int = 1


def offered_rps(probes: Sequence[Offered], scale: float | None) -> float:
    """The arrival rate of the probe at `scale` (0 when there is none)."""
    return max((p.rps for p in probes if p.rate_scale == scale), default=0.0)


class Measured(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A variant's search: max goodput 0 if nothing passed, a lower bound if nothing failed.

    `screened`: not searched but probed once, at adaptive's highest passing scale over the
    workload's `needs`, and it failed there: `max_goodput_rps` is that probe's rate, a strict
    upper bound, and adaptive passed `needs` times the rate scale it failed at.
    """

    label: str
    best_scale: float | None
    failing_scale: float | None
    max_goodput_rps: float
    probes: list[Offered]
    best: RunSummary | None
    failure: str | None = None
    failing: RunSummary | None = None  # the probe at `failing_scale`: why it fell short
    screened: bool = False


class Verdict(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    workload: str
    needs: float
    baseline: str
    baseline_rps: float
    adaptive_rps: float
    ratio: float
    passed: bool
    measured: list[Measured]


def fixed_variants(split: bool = False) -> list[Variant]:
    """The variants with one layout: colocate first (the pilot), round-robin, adaptive on
    mixed workers (judged: it splits per turn), with `split` adaptive on the default fixed
    split (for reference); the split families are `acceptance_grid`'s."""
    out = [Variant("colocate", "colocate"), Variant("round-robin", "round-robin"),
           Variant("adaptive", "adaptive", mixed=True)]  # fmt: skip
    return [*out, Variant("adaptive (fixed split)", "adaptive")] if split else out


def trace_workloads(directory: Path, min_turns: int, span_s: float) -> list[Workload]:
    traces = [(name, load_trace(directory / filename)) for name, filename in TRACES]
    return [Workload(n, TraceSource(t, min_turns, span_s), needs_of(t, n)) for n, t in traces]


def nonstationary_workloads(
    directory: Path, min_turns: int, span_s: float, rate_rps: float
) -> list[Workload]:
    """The non-stationary workloads over `span_s` wall seconds a probe (needs 1.3): the mix
    shift (two cycles of long-prompt then long-answer phases), the ramp whose mix turns, the
    burst of returning long sessions (`rate_rps` sessions/s at scale 1), and the recorded traces
    stitched in sequence (conversation, code, Mooncake)."""
    specs = [mix_shift(span_s / 4, rate_rps, 2), ramp_shift(span_s, rate_rps),
             returning_burst(span_s, rate_rps)]  # fmt: skip
    out = [Workload(spec.name, PhasedSource(spec), MULTI_TURN_NEEDS) for spec in specs]
    order = ("azure-conv", "azure-code", "mooncake")
    files = dict(TRACES)
    parts = tuple((name, load_trace(directory / files[name])) for name in order)
    out.append(Workload("stitched", StitchedSource(parts, min_turns, span_s), MULTI_TURN_NEEDS))
    return out


def matrix_workloads(spec: WorkloadSpec, min_turns: int, span_s: float) -> list[Workload]:
    """A workload per class of `spec` (`rate_rps`: its sessions/s at scale 1; needs 1.0), and
    its multi-turn classes interleaved ("mixed-multi-turn", `rate_rps` over them all; 1.2)."""
    workloads, multi = [], []
    for cell in cells(spec):
        one = msgspec.structs.replace(spec, name=cell.klass, prompt_tokens=(cell.prompt,),
            output_tokens=(cell.output,), reuse=(cell.reuse,), turns=(cell.turns,))  # fmt: skip
        source = MatrixSource(one, -(-min_turns // cell.turns), span_s)
        workloads.append(Workload(cell.klass, source, 1.0))
        multi += [cell.turns] if cell.turns > 1 else []
    if len(multi) > 1:
        whole = msgspec.structs.replace(spec, name="mixed-multi-turn", reuse=("multi-turn",))
        source = MatrixSource(whole, -(-min_turns // sum(multi)), span_s)
        workloads.append(Workload("mixed-multi-turn", source, MULTI_TURN_NEEDS))
    return workloads


def needs_of(trace: Trace, name: str = "") -> float:
    """1.3 for a recorded conversation trace or one with multi-turn sessions, else 1.0."""
    multi = any(len(c.turns) > 1 for c in trace.conversations)
    return MULTI_TURN_NEEDS if multi or name in CONVERSATION_TRACES else 1.0
