from __future__ import annotations

import math

import pytest

from sim.engine.clock import MonotonicClock, VirtualClock
from sim.engine.engine import Engine, EngineConfig, EngineRequest, RequestStats, StepOutput
from sim.engine.kvcache import extend_block_hashes
from sim.engine.presets import deployment_from_names
from sim.worker.tokenizer import WordGenerator

DEP = deployment_from_names("h200-sxm", "llama-3.1-8b")
BS = DEP.block_size


def make(**overrides: object) -> tuple[Engine, VirtualClock]:
    options: dict[str, object] = {"noise_sigma": 0.0, **overrides}
    clock = VirtualClock()
    return Engine(EngineConfig(DEP, **options), clock), clock  # type: ignore[arg-type]


def req(rid: str, prompt: list[int] | int, max_tokens: int = 4, **kw: object) -> EngineRequest:
    tokens = list(range(1000, 1000 + prompt)) if isinstance(prompt, int) else prompt
    return EngineRequest(rid, tokens, max_tokens, 0.0, **kw)  # type: ignore[arg-type]


def step(engine: Engine, clock: VirtualClock) -> list[StepOutput]:
    duration = engine.begin_step()
    assert duration is not None
    clock.advance_to(clock.now() + duration)
    return engine.finish_step()


def stats_of(out: StepOutput) -> RequestStats:
    assert out.stats is not None
    return out.stats


def run(engine: Engine, clock: VirtualClock) -> dict[str, StepOutput]:
    """Step until idle; the finishing output of every request."""
    done: dict[str, StepOutput] = {}
    while engine.has_work():
        for out in step(engine, clock):
            if out.finish_reason is not None:
                done[out.request_id] = out
    return done


def test_idle_ttft_equals_predicted_prefill() -> None:
    engine, clock = make()
    model = engine.cost_model
    engine.add_request(req("a", 3000, max_tokens=3))
    first = WordGenerator.token_id_at(WordGenerator(0).request_key("a"), 0)
    assert step(engine, clock) == [StepOutput("a", [first], None, None)]
    assert clock.now() == model.predict_prefill_s(3000)
    done = run(engine, clock)["a"]
    stats = stats_of(done)
    assert done.finish_reason == "length"
    assert stats.first_token_time - stats.arrival_time == model.predict_prefill_s(3000)
    decode = model.predict_decode_step_s(1, 3001) + model.predict_decode_step_s(1, 3002)
    assert stats.finished_time == pytest.approx(stats.first_token_time + decode)
    assert (stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens) == (3000, 3, 0)
    assert (engine.prompt_tokens_total, engine.generation_tokens_total) == (3000, 3)
    assert engine.kv_usage == 0.0


def test_generated_tokens_are_the_word_generator_words() -> None:
    engine, clock = make(seed=5)
    engine.add_request(req("r", 40, max_tokens=20))
    ids: list[int] = []
    while engine.has_work():
        for out in step(engine, clock):
            ids.extend(out.token_ids)
    assert ids == WordGenerator.token_ids_for(WordGenerator(5).words("r", 0, 20))


@pytest.mark.parametrize(("prompt", "cached"), [(100, 96), (64, 48), (65, 64), (16, 0), (5, 0)])
def test_prefix_hit_on_identical_prompt(prompt: int, cached: int) -> None:
    engine, clock = make()
    engine.add_request(req("a", prompt, max_tokens=1))
    run(engine, clock)
    engine.add_request(req("b", prompt, max_tokens=1))
    start = clock.now()
    stats = run(engine, clock)["b"].stats
    assert stats is not None and stats.cached_tokens == cached
    assert clock.now() - start == engine.cost_model.predict_prefill_s(prompt - cached, cached)
    assert (engine.prefix_cache_queries, engine.prefix_cache_hits) == (2 * prompt, cached)


def test_prefix_caching_disabled_recomputes() -> None:
    engine, clock = make(enable_prefix_caching=False)
    for rid in ("a", "b"):
        engine.add_request(req(rid, 100, max_tokens=1))
        stats = run(engine, clock)[rid].stats
        assert stats is not None and stats.cached_tokens == 0


def test_next_turn_hits_blocks_filled_by_generated_tokens() -> None:
    engine, clock = make()
    prompt = list(range(40))
    engine.add_request(req("t1", prompt, max_tokens=30))
    answer: list[int] = []
    while engine.has_work():
        for out in step(engine, clock):
            answer.extend(out.token_ids)
    turn2 = prompt + answer + [7, 8, 9]
    # KV exists for the prompt and all but the last generated token: 69 tokens, 4 full blocks.
    assert engine.cached_prefix_tokens(turn2) == 64
    engine.add_request(req("t2", turn2, max_tokens=1))
    stats = run(engine, clock)["t2"].stats
    assert stats is not None and stats.cached_tokens == 64


@pytest.mark.parametrize("chunk", [512, 1000, 4096])
def test_chunked_prefill_interleaves_decodes(chunk: int) -> None:
    engine, clock = make(chunked_prefill=chunk)
    engine.add_request(req("d", 32, max_tokens=100))
    step(engine, clock)  # "d" prefilled; it now decodes every step
    engine.add_request(req("p", list(range(5000, 9096)), max_tokens=1))
    steps = 0
    while True:
        outs = step(engine, clock)
        steps += 1
        assert [o.request_id for o in outs if o.request_id == "d"] == ["d"]
        assert engine.last_step_tokens == 1 + min(chunk, 4096 - (steps - 1) * chunk)
        if any(o.request_id == "p" for o in outs):
            break
    assert steps == math.ceil(4096 / chunk)


def test_unchunked_prompt_waits_for_budget_but_oversized_runs_alone() -> None:
    engine, clock = make(max_num_batched_tokens=1000)
    engine.add_request(req("a", 600, max_tokens=2))
    engine.add_request(req("b", list(range(600)), max_tokens=2))
    step(engine, clock)
    assert (engine.last_step_tokens, engine.num_running, engine.num_waiting) == (600, 1, 1)
    step(engine, clock)  # a's decode and b's prefill
    assert engine.last_step_tokens == 601
    run(engine, clock)
    engine.add_request(req("big", list(range(10_000, 12_500)), max_tokens=1))
    engine.add_request(req("small", list(range(20_000, 20_010)), max_tokens=1))
    step(engine, clock)
    assert (engine.last_step_tokens, engine.num_waiting) == (2500, 1)
    step(engine, clock)
    assert engine.last_step_tokens == 10


def test_max_num_seqs_caps_running() -> None:
    engine, clock = make(max_num_seqs=2)
    for i in range(5):
        engine.add_request(req(f"r{i}", 10, max_tokens=3))
    step(engine, clock)
    assert (engine.num_running, engine.num_waiting, engine.last_step_requests) == (2, 3, 2)
    assert len(run(engine, clock)) == 5


def test_held_prefill_leg_keeps_blocks_until_released() -> None:
    engine, clock = make()
    prompt = list(range(100))
    engine.add_request(req("p", prompt, max_tokens=1, hold_blocks_on_finish=True))
    out = run(engine, clock)["p"]
    assert out.finish_reason == "length" and out.stats is not None and out.stats.held_blocks
    held = engine.held_request("p")
    assert held is not None
    assert held.token_ids == prompt
    assert len(held.block_ids) == 7
    assert held.deadline == clock.now() + 480.0
    assert engine.kv_usage == 7 / engine.blocks.num_blocks
    assert engine.next_held_deadline() == held.deadline
    assert engine.release_held("p") and not engine.release_held("p")
    assert (engine.kv_usage, engine.held_request("p"), engine.next_held_deadline()) == (
        0.0,
        None,
        None,
    )
    assert engine.cached_prefix_tokens(prompt) == 96  # released blocks stay cached


def test_held_prefill_leg_expires() -> None:
    engine, clock = make()
    engine.held_timeout_s = 2.0
    engine.add_request(req("p1", 50, max_tokens=1, hold_blocks_on_finish=True))
    run(engine, clock)
    clock.advance_to(1.0)
    engine.add_request(req("p2", list(range(60)), max_tokens=1, hold_blocks_on_finish=True))
    run(engine, clock)
    first = engine.next_held_deadline()
    assert first is not None and first < 2.1
    clock.advance_to(first - 1e-9)
    assert engine.expire_held() == 0
    clock.advance_to(first)
    assert engine.expire_held() == 1
    assert engine.held_request("p1") is None and engine.held_request("p2") is not None
    clock.advance_to(10.0)
    assert engine.expire_held() == 1
    assert (engine.kv_usage, engine.next_held_deadline()) == (0.0, None)


def test_stop_is_not_held_and_respects_min_tokens() -> None:
    engine, clock = make(eos_probability=1.0)
    engine.add_request(req("p", 30, max_tokens=5, hold_blocks_on_finish=True))
    engine.add_request(req("m", 30, max_tokens=5, min_tokens=3))
    engine.add_request(req("i", 30, max_tokens=5, ignore_eos=True))
    done = run(engine, clock)
    assert [(done[r].finish_reason, done[r].token_ids) for r in ("p", "m")] == [
        ("stop", []),
        ("stop", []),
    ]
    completion = {r: stats_of(done[r]).completion_tokens for r in done}
    assert completion == {"p": 0, "m": 3, "i": 5}
    assert done["i"].finish_reason == "length"
    assert engine.held_request("p") is None and engine.kv_usage == 0.0


def test_preloaded_tokens_skip_recompute_and_register_hashes() -> None:
    engine, clock = make()
    prompt = list(range(200, 300))
    engine.add_request(req("d", prompt, max_tokens=1, preloaded_tokens=100))
    start = clock.now()
    stats = run(engine, clock)["d"].stats
    assert stats is not None
    assert (stats.cached_tokens, stats.preloaded_tokens, stats.local_hit_tokens) == (99, 99, 0)
    # vLLM 0.32 counts the whole pulled prompt as transferred, its recomputed last token too
    assert prompt_sources(engine) == (0, 0, 100)
    assert clock.now() - start == engine.cost_model.predict_prefill_s(1, 99)
    assert engine.prefix_cache_hits == 0
    assert engine.cached_prefix_tokens(prompt) == 96
    engine.add_request(req("next", [*prompt, 1, 2, 3], max_tokens=1))
    nxt = run(engine, clock)["next"].stats
    assert nxt is not None and (nxt.cached_tokens, nxt.preloaded_tokens) == (96, 0)
    assert nxt.local_hit_tokens == 96
    assert prompt_sources(engine) == (7, 96, 100)
    assert engine.prompt_tokens_total == sum(prompt_sources(engine))


def test_partial_preload_after_a_local_hit() -> None:
    engine, clock = make()
    prompt = list(range(64))
    engine.add_request(req("warm", prompt[:32], max_tokens=1))
    run(engine, clock)
    engine.add_request(req("d", prompt, max_tokens=1, preloaded_tokens=50))
    stats = run(engine, clock)["d"].stats
    assert stats is not None and (stats.cached_tokens, stats.preloaded_tokens) == (50, 18)
    assert stats.local_hit_tokens == 32
    assert prompt_sources(engine) == (32 + 14, 32, 18)  # "warm" whole, "d" past the pull
    assert engine.cached_prefix_tokens(prompt) == 64


def prompt_sources(engine: Engine) -> tuple[int, int, int]:
    """vllm:prompt_tokens_by_source: local_compute, local_cache_hit, external_kv_transfer."""
    return (
        engine.prompt_tokens_computed,
        engine.prompt_tokens_local_hit,
        engine.prompt_tokens_external,
    )


def test_preemption_under_tiny_cache_completes_everything() -> None:
    engine, clock = make(num_gpu_blocks_override=8)
    for i in range(4):
        engine.add_request(req(f"r{i}", list(range(i * 100, i * 100 + 20)), max_tokens=40))
    done = run(engine, clock)
    assert engine.num_preemptions > 0
    assert sum(stats_of(o).num_preemptions for o in done.values()) == engine.num_preemptions
    assert {r: stats_of(o).completion_tokens for r, o in done.items()} == {
        f"r{i}": 40 for i in range(4)
    }
    assert engine.generation_tokens_total == 160 and engine.prompt_tokens_total == 80
    assert engine.kv_usage == 0.0


def test_abort_frees_blocks_and_silences_the_frozen_step() -> None:
    engine, clock = make()
    engine.add_request(req("a", 100, max_tokens=50))
    engine.add_request(req("b", 100, max_tokens=50))
    step(engine, clock)
    duration = engine.begin_step()
    assert duration is not None
    assert engine.abort_request("a")
    engine.add_request(req("late", 10, max_tokens=1))  # does not join the frozen step
    clock.advance_to(clock.now() + duration)
    assert [o.request_id for o in engine.finish_step()] == ["b"]
    assert engine.abort_request("b") and engine.abort_request("late")
    assert not engine.abort_request("a") and not engine.abort_request("nope")
    assert (engine.kv_usage, engine.has_work(), engine.num_running, engine.num_waiting) == (
        0.0,
        False,
        0,
        0,
    )
    assert engine.begin_step() is None


def test_abort_releases_a_held_leg() -> None:
    engine, clock = make()
    engine.add_request(req("p", 40, max_tokens=1, hold_blocks_on_finish=True))
    run(engine, clock)
    assert engine.abort_request("p")
    assert engine.kv_usage == 0.0 and engine.held_request("p") is None


def test_same_seed_same_run_with_noise() -> None:
    def trace(seed: int) -> list[tuple[float, str, tuple[int, ...], str | None]]:
        engine, clock = make(seed=seed, noise_sigma=0.1, eos_probability=0.05)
        for i in range(6):
            engine.add_request(req(f"r{i}", 50 + 30 * i, max_tokens=30))
        out = []
        while engine.has_work():
            for o in step(engine, clock):
                out.append((clock.now(), o.request_id, tuple(o.token_ids), o.finish_reason))
        return out

    assert trace(1) == trace(1)
    assert trace(1) != trace(2)


def test_given_block_hashes_change_nothing_but_are_checked() -> None:
    def trace(share: bool) -> list[tuple[float, str, tuple[int, ...], int]]:
        engine, clock = make(seed=2, noise_sigma=0.05)
        prompts = [list(range(200 + 7 * i)) for i in range(5)]  # shared prefixes
        for i, prompt in enumerate(prompts):
            hashes: list[int] = []
            extend_block_hashes(prompt, hashes, BS, len(prompt) // BS - i % 2)
            kw = {"block_hashes": hashes} if share else {}
            engine.add_request(req(f"r{i}", prompt, max_tokens=20, **kw))
        out = []
        while engine.has_work():
            for o in step(engine, clock):
                cached = o.stats.cached_tokens if o.stats is not None else -1
                out.append((clock.now(), o.request_id, tuple(o.token_ids), cached))
        return out

    assert trace(True) == trace(False)
    engine, _ = make()
    wrong: list[int] = []
    extend_block_hashes(list(range(64)), wrong, 2 * BS, 2)  # another block size
    with pytest.raises(ValueError, match="block_hashes"):
        engine.add_request(req("x", list(range(64)), block_hashes=wrong))


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "message"),
    [
        (0, 10, "The decoder prompt cannot be empty"),
        (10, 0, "max_tokens must be at least 1, got 0."),
        (
            4000,
            200,
            "This model's maximum context length is 4096 tokens. However, you requested 4200 "
            "tokens (4000 in the messages, 200 in the completion). Please reduce the length "
            "of the messages or completion.",
        ),
        (4000, 96, None),
    ],
)
def test_validate(prompt: int, max_tokens: int, message: str | None) -> None:
    engine, _ = make(max_model_len=4096)
    assert engine.validate(prompt, max_tokens) == message


def test_validate_rejects_what_the_cache_cannot_hold() -> None:
    engine, _ = make(num_gpu_blocks_override=4)
    assert engine.validate(60, 4) is None
    problem = engine.validate(60, 5)
    assert problem is not None and "needs 5 KV cache blocks" in problem


def test_add_request_rejects_invalid_and_duplicate() -> None:
    engine, _ = make(max_model_len=100)
    engine.add_request(req("a", 10))
    with pytest.raises(ValueError, match="already"):
        engine.add_request(req("a", 10))
    with pytest.raises(ValueError, match="maximum context length"):
        engine.add_request(req("b", 99, max_tokens=2))
    with pytest.raises(ValueError, match="min_tokens"):
        engine.add_request(req("c", 10, max_tokens=2, min_tokens=3))
    with pytest.raises(ValueError, match="preloaded"):
        engine.add_request(req("d", 10, preloaded_tokens=11))


def test_step_protocol_misuse() -> None:
    engine, _ = make()
    with pytest.raises(RuntimeError):
        engine.finish_step()
    engine.add_request(req("a", 10))
    assert engine.begin_step() is not None
    with pytest.raises(RuntimeError):
        engine.begin_step()


def test_engine_config_validation() -> None:
    with pytest.raises(ValueError):
        EngineConfig(DEP, max_model_len=200_000)
    with pytest.raises(ValueError):
        EngineConfig(DEP, chunked_prefill=0)
    assert Engine(EngineConfig(DEP), MonotonicClock()).max_model_len == 131072


def test_clocks() -> None:
    clock = VirtualClock(start=5.0)
    clock.advance_to(7.5)
    clock.advance_to(7.5)
    with pytest.raises(ValueError):
        clock.advance_to(7.0)
    assert clock.now() == 7.5
    real = MonotonicClock()
    assert real.now() <= real.now()


def test_preemption_picks_the_most_recently_admitted() -> None:
    engine, clock = make(num_gpu_blocks_override=4)
    engine.add_request(req("first", list(range(16)), max_tokens=40))
    engine.add_request(req("second", list(range(100, 116)), max_tokens=40))
    tokens: dict[str, list[int]] = {"first": [], "second": []}
    done: dict[str, StepOutput] = {}
    while engine.has_work():
        for out in step(engine, clock):
            tokens[out.request_id].extend(out.token_ids)
            if out.finish_reason:
                done[out.request_id] = out
    assert engine.num_preemptions == 1
    assert [stats_of(done[r]).num_preemptions for r in ("first", "second")] == [0, 1]
    words = WordGenerator(0)
    assert tokens["second"] == words.token_ids_for(words.words("second", 0, 40))
    # the victim waited for the survivor to finish, then recomputed prompt + 17 generated
    assert stats_of(done["first"]).finished_time < stats_of(done["second"]).finished_time


@pytest.mark.parametrize(
    ("policy", "priorities", "admitted"),
    [
        # arrival order, whatever the requests say: fcfs refuses priorities, see below
        ("fcfs", [0, 0, 0, 0], ["r0", "r1", "r2", "r3"]),
        # the lowest value first; equal values in arrival order
        ("priority", [30, 10, 20, 10], ["r1", "r3", "r2", "r0"]),
        ("priority", [0, 0, 0, 0], ["r0", "r1", "r2", "r3"]),
    ],
)
def test_the_queue_is_admitted_in_priority_order(
    policy: str, priorities: list[int], admitted: list[str]
) -> None:
    engine, clock = make(max_num_seqs=1, scheduling_policy=policy)
    engine.add_request(req("busy", 10, max_tokens=3))
    step(engine, clock)  # "busy" holds the only slot while the others queue
    for i, priority in enumerate(priorities):
        engine.add_request(req(f"r{i}", 10 + i, max_tokens=1, priority=priority))
    done = run(engine, clock)
    order = sorted(admitted, key=lambda rid: stats_of(done[rid]).first_scheduled_time)
    assert order == admitted


def test_a_preempted_request_goes_ahead_of_its_equals_only() -> None:
    engine, _ = make(scheduling_policy="priority")
    for rid, priority in (("early", 1), ("same", 5), ("again", 5), ("late", 9)):
        engine.add_request(req(rid, 10, max_tokens=1, priority=priority))
    assert [seq.request_id for seq in engine.waiting] == ["early", "same", "again", "late"]
    again = engine.waiting[2]
    del engine.waiting[2]  # as if admitted, then preempted (recompute: it starts over)
    engine.preempt(again)
    assert [seq.request_id for seq in engine.waiting] == ["early", "again", "same", "late"]


def test_fcfs_ignores_priorities() -> None:
    """vLLM 0.32 without --scheduling-policy priority: accepted, arrival order kept."""
    engine, _ = make()
    for rid, priority in (("a", 9), ("b", 1), ("c", 5)):
        engine.add_request(req(rid, 10, max_tokens=1, priority=priority))
    assert [seq.request_id for seq in engine.waiting] == ["a", "b", "c"]
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(DEP, scheduling_policy="lifo")  # type: ignore[arg-type]
