"""The adaptive policy's estimates, calibrated against the simulator's engine, not its numbers.

The policy starts from an H200 prior; the engine models an A100 (a third of the FLOP/s, under
half the bandwidth). The policy sees only outcomes, as it does behind the live router.
"""

from __future__ import annotations

import random

import pytest

from policies.adaptive.policy import AdaptiveParams, AdaptivePolicy
from policies.types import Outcome
from sim.engine.clock import VirtualClock
from sim.engine.engine import Engine, EngineConfig, EngineRequest, RequestStats
from sim.engine.presets import deployment_from_names


def _run_one(engine: Engine, clock: VirtualClock, request: EngineRequest) -> RequestStats:
    engine.add_request(request)
    while True:
        duration = engine.begin_step()
        assert duration is not None
        clock.advance_to(clock.now() + duration)
        for output in engine.finish_step():
            if output.request_id == request.request_id and output.stats is not None:
                return output.stats


@pytest.mark.parametrize("gpu", ["a100-80g", "h100-sxm"])
def test_estimates_converge_to_the_engine_within_15_percent_after_200_turns(gpu: str) -> None:
    clock = VirtualClock()
    config = EngineConfig(deployment=deployment_from_names(gpu, "llama-3.1-8b", 1),
                          noise_sigma=0.02, seed=3)  # fmt: skip
    engine = Engine(config, clock)
    policy = AdaptivePolicy(AdaptiveParams(gpu="h200-sxm", model="llama-3.1-8b"))
    rng = random.Random(11)
    shared = [rng.randrange(1 << 30) for _ in range(4096)]
    for turn in range(200):
        prefix = rng.choice([0, 512, 2048])
        fresh = rng.choice([64, 256, 1024, 4096])
        prompt = shared[:prefix] + [rng.randrange(1 << 30) for _ in range(fresh)]
        request = EngineRequest(f"r{turn}", prompt, max_tokens=rng.choice([8, 32, 128]),
                                arrival_time=clock.now(), ignore_eos=True)  # fmt: skip
        stats = _run_one(engine, clock, request)
        policy.observe(Outcome(
            request_id=request.request_id, session_id=f"s{turn}", action="colocate",
            prefill_worker="w0", decode_worker="w0", prompt_tokens=stats.prompt_tokens,
            cached_tokens=stats.cached_tokens, completion_tokens=stats.completion_tokens, ok=True,
            queue_ms=(stats.first_scheduled_time - stats.arrival_time) * 1000,
            prefill_ms=(stats.first_token_time - stats.first_scheduled_time) * 1000,
            decode_ms=(stats.finished_time - stats.first_token_time) * 1000,
        ))  # fmt: skip
    model = engine.cost_model
    worst = 0.0
    for uncached, cached in [(100, 0), (700, 1024), (3000, 0), (6000, 2048), (12000, 0)]:
        truth = model.predict_prefill_s(uncached, cached) * 1000
        estimate = policy.estimates.prefill_ms(uncached, cached, worker="w0")
        worst = max(worst, abs(estimate - truth) / truth)
    for context in (300, 2000, 8000):
        truth = model.predict_decode_step_s(1, context) * 1000
        estimate = policy.estimates.decode_step_ms(1, context, worker="w0")
        worst = max(worst, abs(estimate - truth) / truth)
    assert worst < 0.15
