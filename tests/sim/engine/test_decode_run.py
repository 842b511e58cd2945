"""A steady decode fast-forwarded by `DecodeRun` gives exactly what stepping the engine gives."""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field

import pytest

from sim.engine.clock import VirtualClock
from sim.engine.decode_run import DecodeRun, Delivery
from sim.engine.engine import Engine, EngineConfig, EngineRequest, RequestStats, StepOutput
from sim.engine.presets import deployment_from_names
from sim.engine.roofline import CostModel

DEP = deployment_from_names("h200-sxm", "llama-3.1-8b")
BS = DEP.block_size


def arrivals(seed: int, hold: bool = False) -> list[EngineRequest]:
    """Requests sharing prefixes of one document, at random times, some long decodes."""
    rng = random.Random(seed)
    document = list(range(5000, 5000 + 40 * BS))
    out: list[EngineRequest] = []
    t = 0.0
    for i in range(14):
        t += rng.expovariate(30.0)
        prompt = document[: rng.randrange(0, len(document))]
        prompt += [rng.randrange(10**6) for _ in range(rng.randrange(1, 300))]
        held = hold and i % 3 == 0
        max_tokens = 1 if held else rng.randrange(1, 220)
        out.append(EngineRequest(f"r{i}", prompt, max_tokens, t, hold_blocks_on_finish=held))
    return out


@dataclass
class Replay:
    """What a replay saw: every request's tokens, their times and its end; KV usage reads."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    times: dict[str, list[float]] = field(default_factory=dict)
    finished: dict[str, RequestStats] = field(default_factory=dict)
    usage: list[tuple[float, float]] = field(default_factory=list)  # (time, after it)
    runs: int = 0
    cut: int = 0

    def outputs(self, outputs: list[StepOutput], now: float) -> None:
        for out in outputs:
            self.delivered(out.request_id, out.token_ids, [now] if out.token_ids else [])
            if out.stats is not None:
                self.finished[out.request_id] = out.stats

    def delivered(self, request_id: str, tokens: list[int], times: list[float]) -> None:
        self.tokens.setdefault(request_id, []).extend(tokens)
        self.times.setdefault(request_id, []).extend(times)

    def run_steps(self, delivery: Delivery | None) -> None:
        if delivery is not None:
            times, outputs = delivery
            for request_id, tokens in outputs:
                self.delivered(request_id, tokens, times)


def replay(engine: Engine, clock: VirtualClock, requests: list[EngineRequest],
           runs: bool, reads: int = 0) -> Replay:  # fmt: skip
    """The simulator's way of driving one engine; with `runs`, steady decodes run as
    `DecodeRun`s, applied at random reads (`reads` as seed) and cut short by arrivals."""
    seen = Replay()
    pending = deque(requests)
    probes = random.Random(reads)
    while pending or engine.has_work():
        now = clock.now()
        if engine.num_held:
            engine.expire_held()
        duration = engine.begin_step()
        if duration is None:
            wake = engine.next_held_deadline() if engine.has_work() else None
            arrival = pending[0].arrival_time if pending else math.inf
            t = min(arrival, math.inf if wake is None else wake)
            assert t < math.inf, "stalled"
            clock.advance_to(max(t, now))
            while pending and pending[0].arrival_time <= clock.now():
                engine.add_request(pending.popleft())
            continue
        seen.usage.append((now, engine.kv_usage))
        end = now + duration
        run = DecodeRun.plan(engine, end, 48) if runs and engine.steady_decode() else None
        if run is not None:
            seen.runs += 1
            end = run.ends[-1]
            while True:
                arrival = pending[0].arrival_time if pending else math.inf
                t = min(arrival, clock.now() + probes.expovariate(1 / 0.04))
                if t >= end:
                    seen.run_steps(run.advance(run.steps - 1))
                    break
                clock.advance_to(t)
                predicted = run.kv_usage(run.steps_by(t))  # as the steps will leave it
                seen.run_steps(run.advance(run.steps_by(t)))
                seen.usage.append((t, engine.kv_usage))
                assert engine.kv_usage == predicted
                if t == arrival:
                    seen.cut += 1
                    end = run.truncate()
                    break
        while pending and pending[0].arrival_time < end:
            request = pending.popleft()
            clock.advance_to(max(request.arrival_time, clock.now()))
            engine.add_request(request)
        clock.advance_to(end)
        seen.outputs(engine.finish_step(), end)
    return seen


def make(blocks: int, **options: object) -> tuple[Engine, VirtualClock]:
    clock = VirtualClock()
    config = EngineConfig(DEP, noise_sigma=0.05, seed=11, num_gpu_blocks_override=blocks,
                          **options)  # type: ignore[arg-type]  # fmt: skip
    engine = Engine(config, clock)
    engine.held_timeout_s = 0.15
    return engine, clock


def usage_at(stepwise: Replay, t: float) -> float:
    """KV usage of the step-by-step engine at time `t` (after everything at `t`)."""
    at = bisect_right([u[0] for u in stepwise.usage], t)
    return stepwise.usage[at - 1][1]


@pytest.mark.parametrize(
    ("blocks", "options", "hold"),
    [
        (120, {}, False),  # preemptions: decodes run out of blocks
        (20000, {"chunked_prefill": 256}, False),
        (20000, {"enable_prefix_caching": False}, False),
        (20000, {"eos_probability": 0.01}, False),  # EOS draws: never a run
        (900, {}, True),  # held prefill legs expire during decodes
    ],
)
def test_runs_replay_the_steps_exactly(blocks: int, options: dict[str, object], hold: bool) -> None:
    base, base_clock = make(blocks, **options)
    stepwise = replay(base, base_clock, arrivals(5, hold), runs=False)
    next_step = base.cost_model.sample_step_time(3, 900, 0, 0, 0.0)
    for reads in range(3):
        engine, clock = make(blocks, **options)
        fast = replay(engine, clock, arrivals(5, hold), runs=True, reads=reads)
        assert fast.tokens == stepwise.tokens
        assert fast.times == stepwise.times
        assert fast.finished == stepwise.finished
        for t, usage in fast.usage:
            assert usage == usage_at(stepwise, t)
        assert (engine.num_preemptions, engine.generation_tokens_total, engine.kv_usage,
                engine.blocks.num_cached_blocks, engine.prefix_cache_hits) == (
                base.num_preemptions, base.generation_tokens_total, base.kv_usage,
                base.blocks.num_cached_blocks, base.prefix_cache_hits)  # fmt: skip
        # the noise draws continue where the step-by-step engine's do
        assert engine.cost_model.sample_step_time(3, 900, 0, 0, 0.0) == next_step
        if "eos_probability" in options:
            assert fast.runs == 0
        else:
            assert fast.runs > 0 and fast.cut > 0
    if blocks == 120:
        assert base.num_preemptions > 0


def test_noise_factors_are_the_next_draws_and_can_be_handed_back() -> None:
    a = CostModel(DEP, noise_sigma=0.1, seed=4)
    b = CostModel(DEP, noise_sigma=0.1, seed=4)
    stepwise = [b.sample_step_time(1, 100, 0, 0, 0.0) for _ in range(9)]
    quiet = CostModel(DEP).sample_step_time(1, 100, 0, 0, 0.0)
    first = a.noise_factors(5)
    a.unread(first[2:])
    second = a.noise_factors(1)
    a.unread(second)
    drawn = [quiet * f for f in first[:2]]
    drawn += [a.sample_step_time(1, 100, 0, 0, 0.0) for _ in range(7)]
    assert drawn == stepwise


@pytest.mark.parametrize(
    ("size", "context", "steps"),
    [
        (7, 5000, 40),  # memory-bound (small batches are)
        (1, 100, 1),
        (300, 30_000, 50),  # compute-bound throughout
        (160, 160, 200),  # compute-bound, memory-bound from about 13k tokens of context on
        (160, 50_000, 30),
    ],
)
def test_decode_step_ends_are_sample_step_time_sums(size: int, context: int, steps: int) -> None:
    a = CostModel(DEP, noise_sigma=0.1, seed=2)
    b = CostModel(DEP, noise_sigma=0.1, seed=2)
    ends = a.decode_step_ends(size, context, 1.5, a.noise_factors(steps))
    end, expected = 1.5, []
    for k in range(steps):
        end += b.sample_step_time(size, context + size * k, 0, 0, 0.0)
        expected.append(end)
    assert ends == expected
