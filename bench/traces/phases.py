"""Non-stationary workloads: a load whose mix and rate change while it runs.

A fixed split or threshold is right for one mix at one rate; these traces change both, so a
placement tuned in hindsight has to pick one layout for every phase.

A `PhasedSpec` is a timeline of `Phase`s, repeated `cycles` times. In a phase, sessions start
as a Poisson process whose rate goes linearly from `rate_rps` to `end_rate_rps` (thinning of a
process at the higher of the two), and each session's class is drawn with weights going
linearly from the classes' `weight` to `end_weights`. `bursts` overlay the timeline: a
`ReturningBurst`'s sessions start between `start_s` and `leave_s` (Poisson at `rate_rps`), and
all their later turns come back together, within `window_s` after `return_at_s`: a crowd of
long contexts returning at once.

A session of a class sends `turns` turns, each adding `prompt_tokens` new tokens to its history
and answering `output_tokens`; a turn's `prefix_blocks` repeat the blocks its predecessor's
prompt filled (as in `bench.traces.workloads`). Classes are labelled `p{P}-g{G}-t{T}`.

`stretched(s)` multiplies every time of the timeline by s and keeps the rates: replayed at rate
scale s (arrivals divided by s) it has the same phases in wall time at s times the rates. The
start order, arrivals, class draws and think times use generators seeded from `seed`; same spec,
same trace.

`stitch` puts recorded traces one after the other: the sessions of each part, renamed and with
their own block ids, start when the previous part's arrivals end.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import msgspec

from bench.traces.model import Conversation, Trace, TraceTurn
from bench.traces.workloads import BlockIds, ThinkSpec, think_time


class SessionClass(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    prompt_tokens: int
    output_tokens: int
    turns: int = 1
    weight: float = 1.0

    def __post_init__(self) -> None:
        if min(self.prompt_tokens, self.output_tokens, self.turns) < 1 or self.weight < 0:
            raise ValueError("a session class needs tokens and turns >= 1 and a weight >= 0")

    @property
    def label(self) -> str:
        return f"p{self.prompt_tokens}-g{self.output_tokens}-t{self.turns}"


def _check_weights(weights: Sequence[float], count: int, what: str) -> None:
    if len(weights) != count or min(weights) < 0 or not sum(weights) > 0:
        raise ValueError(f"{what}: one weight >= 0 per class, not all 0")


class Phase(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`duration_s` of session starts at `rate_rps` (ramping to `end_rate_rps`), classes drawn
    by weight (ramping to `end_weights`)."""

    duration_s: float
    rate_rps: float
    mix: tuple[SessionClass, ...]
    end_rate_rps: float | None = None
    end_weights: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        end = self.rate_rps if self.end_rate_rps is None else self.end_rate_rps
        if not (self.duration_s > 0 and self.rate_rps >= 0 and end >= 0):
            raise ValueError("a phase needs duration_s > 0 and rates >= 0")
        if not self.mix:
            raise ValueError("a phase needs at least one session class")
        _check_weights([c.weight for c in self.mix], len(self.mix), "mix")
        if self.end_weights is not None:
            _check_weights(self.end_weights, len(self.mix), "end_weights")

    def rate_at(self, fraction: float) -> float:
        end = self.rate_rps if self.end_rate_rps is None else self.end_rate_rps
        return self.rate_rps + (end - self.rate_rps) * fraction

    def weights_at(self, fraction: float) -> list[float]:
        start = [c.weight for c in self.mix]
        end = self.end_weights if self.end_weights is not None else start
        return [a + (b - a) * fraction for a, b in zip(start, end, strict=True)]


class ReturningBurst(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Sessions of `session` starting between `start_s` and `leave_s` at `rate_rps`, whose later
    turns all return within `window_s` after `return_at_s`."""

    session: SessionClass
    rate_rps: float
    start_s: float
    leave_s: float
    return_at_s: float
    window_s: float

    def __post_init__(self) -> None:
        if self.session.turns < 2:
            raise ValueError("a returning session needs at least 2 turns")
        ordered = 0 <= self.start_s < self.leave_s <= self.return_at_s
        if not (ordered and self.rate_rps > 0 and self.window_s >= 0):
            raise ValueError("a burst needs 0 <= start_s < leave_s <= return_at_s, a rate > 0")


class PhasedSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    phases: tuple[Phase, ...]
    cycles: int = 1
    bursts: tuple[ReturningBurst, ...] = ()
    think: ThinkSpec = ThinkSpec(distribution="exponential", mean_s=2.0)
    seed: int = 0
    block_tokens: int = 512
    ttft_slo_ms: float | None = None
    itl_slo_ms: float | None = None

    def __post_init__(self) -> None:
        if not self.phases or self.cycles < 1 or self.block_tokens < 1:
            raise ValueError("a phased spec needs phases, cycles >= 1 and block_tokens >= 1")

    @property
    def duration_s(self) -> float:
        """The timeline's length: every phase, `cycles` times."""
        return self.cycles * sum(p.duration_s for p in self.phases)

    def stretched(self, factor: float) -> PhasedSpec:
        """Every time of the timeline times `factor`, rates and think times kept."""
        if not factor > 0:
            raise ValueError("factor must be > 0")
        phases = tuple(msgspec.structs.replace(p, duration_s=p.duration_s * factor)
                       for p in self.phases)  # fmt: skip
        bursts = tuple(
            msgspec.structs.replace(b, start_s=b.start_s * factor, leave_s=b.leave_s * factor,
                                    return_at_s=b.return_at_s * factor,
                                    window_s=b.window_s * factor)
            for b in self.bursts
        )  # fmt: skip
        return msgspec.structs.replace(self, phases=phases, bursts=bursts)


def _starts(phase: Phase, offset: float, rng: random.Random) -> list[tuple[float, float]]:
    """Session starts in `phase` (shifted by `offset`) with their fraction of the phase."""
    peak = max(phase.rate_at(0.0), phase.rate_at(1.0))
    out: list[tuple[float, float]] = []
    if peak <= 0:
        return out
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= phase.duration_s:
            return out
        fraction = t / phase.duration_s
        if rng.random() * peak < phase.rate_at(fraction):
            out.append((offset + t, fraction))


class _Builder:
    """Sessions with unique ids and block ids, think times from one generator."""

    def __init__(self, spec: PhasedSpec) -> None:
        self.spec = spec
        self.blocks = BlockIds(spec.block_tokens, 0)
        self.think_rng = random.Random(f"{spec.seed}:think")
        self.count = 0

    def session(self, klass: SessionClass, arrivals: Sequence[float]) -> Conversation:
        """A session of `klass` whose turn k is due no earlier than `arrivals[k]`."""
        spec, context = self.spec, 0
        shared: tuple[int, ...] = ()
        turns = []
        for k, arrival in enumerate(arrivals):
            context += klass.prompt_tokens
            prefix = self.blocks.extend(shared, context)
            turns.append(TraceTurn(
                arrival_s=arrival, new_input_tokens=klass.prompt_tokens,
                output_tokens=klass.output_tokens, prefix_blocks=prefix,
                think_s=think_time(spec.think, self.think_rng) if k else 0.0,
                ttft_slo_ms=spec.ttft_slo_ms, itl_slo_ms=spec.itl_slo_ms, klass=klass.label,
            ))  # fmt: skip
            shared = prefix[: context // spec.block_tokens]
            context += klass.output_tokens
        self.count += 1
        return Conversation(f"{klass.label}-{self.count}", tuple(turns))


def generate_phased(spec: PhasedSpec) -> Trace:
    """The trace of `spec`: its phases' sessions, then its bursts' (ids in start order)."""
    arrival_rng = random.Random(f"{spec.seed}:arrival")
    mix_rng = random.Random(f"{spec.seed}:mix")
    build = _Builder(spec)
    conversations: list[Conversation] = []
    offset = 0.0
    for _ in range(spec.cycles):
        for phase in spec.phases:
            for start, fraction in _starts(phase, offset, arrival_rng):
                [klass] = mix_rng.choices(phase.mix, weights=phase.weights_at(fraction))
                conversations.append(build.session(klass, [start] * klass.turns))
            offset += phase.duration_s
    for burst in spec.bursts:
        leaving = Phase(burst.leave_s - burst.start_s, burst.rate_rps, (burst.session,))
        for start, _ in _starts(leaving, burst.start_s, arrival_rng):
            back = burst.return_at_s + arrival_rng.random() * burst.window_s
            later = [back] * (burst.session.turns - 1)
            conversations.append(build.session(burst.session, [start, *later]))
    return Trace(spec.name, tuple(conversations), spec.block_tokens, f"phased:seed={spec.seed}")


# The two mixes the presets shift between: long prompts with short answers (prefill-bound;
# wants prefill workers) and short prompts with long answers (decode-bound; wants decode
# workers), both multi-turn so that residency matters.
LONG_PROMPT = SessionClass(prompt_tokens=6144, output_tokens=48, turns=3)
LONG_ANSWER = SessionClass(prompt_tokens=256, output_tokens=768, turns=3)


def mix_shift(phase_s: float = 600.0, rate_rps: float = 1.0, cycles: int = 2) -> PhasedSpec:
    """`phase_s` of long-prompt short-answer sessions, then `phase_s` of short-prompt
    long-answer ones, `cycles` times."""
    phases = (Phase(phase_s, rate_rps, (LONG_PROMPT,)), Phase(phase_s, rate_rps, (LONG_ANSWER,)))
    return PhasedSpec("mix-shift", phases, cycles)


def ramp_shift(duration_s: float = 1200.0, rate_rps: float = 1.0) -> PhasedSpec:
    """A rate ramp from `rate_rps` / 2 to 1.5 x `rate_rps` whose mix goes from mostly
    short-prompt long-answer sessions to mostly long-prompt short-answer ones."""
    mix = (msgspec.structs.replace(LONG_ANSWER, weight=0.85),
           msgspec.structs.replace(LONG_PROMPT, weight=0.15))  # fmt: skip
    phase = Phase(duration_s, rate_rps / 2, mix, rate_rps * 1.5, (0.15, 0.85))
    return PhasedSpec("ramp-shift", (phase,))


RETURNING = SessionClass(prompt_tokens=8192, output_tokens=128, turns=3)


def returning_burst(duration_s: float = 1200.0, rate_rps: float = 1.0) -> PhasedSpec:
    """A steady even mix of both classes at `rate_rps`, and long sessions starting over the
    first quarter at `rate_rps` / 2 whose later turns all return within 2% of the timeline
    after its middle."""
    mix = (LONG_ANSWER, LONG_PROMPT)
    burst = ReturningBurst(RETURNING, rate_rps / 2, 0.0, duration_s / 4, duration_s / 2,
                           duration_s / 50)  # fmt: skip
    return PhasedSpec("returning-burst", (Phase(duration_s, rate_rps, mix),), bursts=(burst,))


def stitch(name: str, parts: Sequence[tuple[str, Trace]], gap_s: float = 0.0) -> Trace:
    """`parts` one after the other: part k's arrivals start `gap_s` after part k-1's last;
    sessions renamed `{part}/{id}`, turns without a class get the part's name, block ids moved
    past every earlier part's (no false sharing between parts)."""
    if not parts or gap_s < 0:
        raise ValueError("stitch needs at least one part and gap_s >= 0")
    block_tokens = {trace.block_tokens for _, trace in parts}
    if len(block_tokens) != 1:
        raise ValueError(f"parts have different block sizes: {sorted(block_tokens)}")
    offset, first_block = 0.0, 0
    conversations: list[Conversation] = []
    for part, trace in parts:
        start = min((t.arrival_s for c in trace.conversations for t in c.turns), default=0.0)
        top = -1
        for c in trace.conversations:
            turns = []
            for t in c.turns:
                blocks = tuple(b + first_block for b in t.prefix_blocks)
                top = max(top, *t.prefix_blocks) if t.prefix_blocks else top
                turns.append(msgspec.structs.replace(
                    t, arrival_s=offset + max(0.0, t.arrival_s - start), prefix_blocks=blocks,
                    klass=t.klass or part,
                ))  # fmt: skip
            conversations.append(msgspec.structs.replace(
                c, session_id=f"{part}/{c.session_id}", turns=tuple(turns)))  # fmt: skip
        offset += max(0.0, trace.duration_s - start) + gap_s
        first_block += top + 1
    sources = "+".join(part for part, _ in parts)
    return Trace(name, tuple(conversations), block_tokens.pop(), f"stitched:{sources}")


PRESETS: dict[str, Callable[[], PhasedSpec]] = {
    "mix-shift": mix_shift, "ramp-shift": ramp_shift, "returning-burst": returning_burst,
}  # fmt: skip


def preset(name: str) -> PhasedSpec:
    """A named preset at its defaults; KeyError names the known ones."""
    if name not in PRESETS:
        raise KeyError(f"no phased preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]()
