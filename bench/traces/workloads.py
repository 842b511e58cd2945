"""Synthetic workload matrices: every combination of prompt length, answer length and cache
reuse mode, as a replayable `Trace`.

A cell (workload class) is one (prompt tokens P, output tokens G, reuse mode, turns T):
- `none`: single-turn sessions of P new tokens, no block shared with any other request;
- `system-prefix`: single-turn sessions of a system prompt of `system_prefix_tokens` (N)
  tokens, identical in every session of the trace, then P new tokens; the full blocks of the
  system prompt carry the same block ids everywhere (the blocks are ids 0..N//block_tokens-1);
- `multi-turn`: sessions of T turns, each adding P new tokens to the history and answering G;
  turn k's `prefix_blocks` repeat turn k-1's blocks that its prompt filled completely.
`turns` only applies to `multi-turn`; the other modes give one cell per (P, G).
Labels: `p{P}-g{G}-{mode}`, plus `-t{T}` for multi-turn, e.g. `p4096-g256-multi-turn-t4`.

Each cell gets `sessions_per_class` sessions; their order is shuffled, then session starts
follow the arrival process: Poisson at `rate_rps` sessions per second, gamma inter-arrival
gaps with mean 1/rate_rps and coefficient of variation `cv` (shape 1/cv^2; cv 1 is Poisson,
larger is burstier), or a closed loop of `concurrency` sessions in flight (all arrivals 0,
`Trace.concurrency` set). A later turn's arrival is its session's start (the replay waits for
the previous answer) and its think time is drawn from `think`. The shuffle, the arrivals and
the think times use three generators seeded from `seed`, so changing the think-time model
leaves the arrivals unchanged. Same spec, same trace.
"""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path
from typing import Literal

import msgspec

from bench.traces.model import Conversation, Trace, TraceTurn, write_native

ReuseMode = Literal["none", "system-prefix", "multi-turn"]


class ArrivalSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How sessions start: `poisson`, `gamma` (burstiness `cv`) or closed-loop `concurrency`."""

    process: Literal["poisson", "gamma", "concurrency"] = "poisson"
    rate_rps: float = 1.0
    cv: float = 1.0
    concurrency: int = 1

    def __post_init__(self) -> None:
        if not (self.rate_rps > 0 and self.cv > 0 and self.concurrency > 0):
            raise ValueError("rate_rps, cv and concurrency must be > 0")


class ThinkSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Pause between an answer and the next question: mean `mean_s`, lognormal shape `sigma`."""

    distribution: Literal["exponential", "lognormal", "fixed"] = "exponential"
    mean_s: float = 0.0
    sigma: float = 1.0

    def __post_init__(self) -> None:
        if self.mean_s < 0 or self.sigma <= 0:
            raise ValueError("think mean_s must be >= 0 and sigma > 0")


class WorkloadSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The matrix to generate; every list must be non-empty and free of repeats."""

    name: str = "matrix"
    prompt_tokens: tuple[int, ...] = (1024,)
    output_tokens: tuple[int, ...] = (128,)
    reuse: tuple[ReuseMode, ...] = ("none",)
    turns: tuple[int, ...] = (1,)
    sessions_per_class: int = 8
    system_prefix_tokens: int = 2048
    arrival: ArrivalSpec = ArrivalSpec()
    think: ThinkSpec = ThinkSpec()
    seed: int = 0
    block_tokens: int = 512
    ttft_slo_ms: float | None = None
    itl_slo_ms: float | None = None

    def __post_init__(self) -> None:
        for field in ("prompt_tokens", "output_tokens", "reuse", "turns"):
            values = getattr(self, field)
            if not values or len(set(values)) != len(values):
                raise ValueError(f"{field} must be non-empty without repeats")
        sizes = (*self.prompt_tokens, *self.output_tokens, *self.turns)
        if min(sizes) < 1 or self.sessions_per_class < 1 or self.block_tokens < 1:
            raise ValueError("token counts, turns, sessions_per_class, block_tokens must be >= 1")
        if self.system_prefix_tokens < 0:
            raise ValueError("system_prefix_tokens must be >= 0")


class _Cell(msgspec.Struct, frozen=True):
    klass: str
    prompt: int
    output: int
    reuse: ReuseMode
    turns: int


def cells(spec: WorkloadSpec) -> list[_Cell]:
    """The workload classes of `spec`, in list order (reuse, then prompt, output, turns)."""
    result: list[_Cell] = []
    for reuse, prompt, output in itertools.product(
        spec.reuse, spec.prompt_tokens, spec.output_tokens
    ):
        base = f"p{prompt}-g{output}-{reuse}"
        if reuse == "multi-turn":
            result.extend(_Cell(f"{base}-t{t}", prompt, output, reuse, t) for t in spec.turns)
        else:
            result.append(_Cell(base, prompt, output, reuse, 1))
    return result


class BlockIds:
    """Hands out block ids: the system prompt's full blocks first, then fresh ones."""

    def __init__(self, block_tokens: int, system_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.system = tuple(range(system_tokens // block_tokens))
        self.next = len(self.system)

    def extend(self, shared: tuple[int, ...], tokens: int) -> tuple[int, ...]:
        """`shared` followed by fresh ids up to the blocks covering `tokens`."""
        total = math.ceil(tokens / self.block_tokens)
        fresh = max(0, total - len(shared))
        start, self.next = self.next, self.next + fresh
        return shared[:total] + tuple(range(start, start + fresh))


def think_time(spec: ThinkSpec, rng: random.Random) -> float:
    if spec.mean_s == 0:
        return 0.0
    if spec.distribution == "fixed":
        return spec.mean_s
    if spec.distribution == "exponential":
        return rng.expovariate(1.0 / spec.mean_s)
    return rng.lognormvariate(math.log(spec.mean_s) - spec.sigma**2 / 2, spec.sigma)


def _gap(spec: ArrivalSpec, rng: random.Random) -> float:
    if spec.process == "concurrency":
        return 0.0
    if spec.process == "poisson":
        return rng.expovariate(spec.rate_rps)
    shape = 1.0 / spec.cv**2
    return rng.gammavariate(shape, 1.0 / (spec.rate_rps * shape))


def _session(
    spec: WorkloadSpec,
    cell: _Cell,
    number: int,
    start_s: float,
    blocks: BlockIds,
    think_rng: random.Random,
) -> Conversation:
    system = spec.system_prefix_tokens if cell.reuse == "system-prefix" else 0
    shared = blocks.system if system else ()
    context = system
    turns = []
    for k in range(cell.turns):
        context += cell.prompt
        prefix = blocks.extend(shared, context)
        turns.append(
            TraceTurn(
                arrival_s=start_s,
                new_input_tokens=cell.prompt,
                output_tokens=cell.output,
                prefix_blocks=prefix,
                think_s=think_time(spec.think, think_rng) if k else 0.0,
                ttft_slo_ms=spec.ttft_slo_ms,
                itl_slo_ms=spec.itl_slo_ms,
                klass=cell.klass,
            )
        )
        # The next turn re-reads only the blocks this prompt filled completely.
        shared = prefix[: context // spec.block_tokens]
        context += cell.output
    return Conversation(f"{cell.klass}-{number}", tuple(turns), system_prefix_tokens=system)


def generate_matrix(spec: WorkloadSpec, path: str | Path | None = None) -> Trace:
    """The trace for `spec`; also written in the native format to `path` when given."""
    order_rng = random.Random(f"{spec.seed}:order")
    arrival_rng = random.Random(f"{spec.seed}:arrival")
    think_rng = random.Random(f"{spec.seed}:think")
    sessions = [(c, n) for c in cells(spec) for n in range(spec.sessions_per_class)]
    order_rng.shuffle(sessions)
    blocks = BlockIds(spec.block_tokens, spec.system_prefix_tokens)
    now = 0.0
    conversations = []
    for cell, number in sessions:
        now += _gap(spec.arrival, arrival_rng)
        conversations.append(_session(spec, cell, number, now, blocks, think_rng))
    trace = Trace(
        name=spec.name,
        conversations=tuple(conversations),
        block_tokens=spec.block_tokens,
        source=f"matrix:seed={spec.seed}",
        concurrency=spec.arrival.concurrency if spec.arrival.process == "concurrency" else None,
    )
    if path is not None:
        write_native(trace, path)
    return trace


def read_spec(path: str | Path) -> WorkloadSpec:
    """A spec from a JSON file (content starting with `{`) or else a TOML file."""
    data = Path(path).read_bytes()
    if data.lstrip().startswith(b"{"):
        return msgspec.json.decode(data, type=WorkloadSpec)
    return msgspec.toml.decode(data, type=WorkloadSpec)
