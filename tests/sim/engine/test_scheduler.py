"""Property test of the engine's scheduler: random arrivals, holds, preloads and aborts."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from sim.engine.clock import VirtualClock
from sim.engine.engine import Engine, EngineConfig, EngineRequest, StepOutput
from sim.engine.presets import deployment_from_names
from sim.worker.tokenizer import WordGenerator

DEP = deployment_from_names("h200-sxm", "llama-3.1-8b")
BS = DEP.block_size


@dataclass
class Case:
    request: EngineRequest
    abort_after: int | None  # abort (inside a frozen step) once this many tokens came out


@dataclass
class Workload:
    config: EngineConfig
    cases: list[Case]


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    num_blocks = draw(st.integers(4, 40))
    chunk = draw(st.none() | st.integers(1, 64))
    # Without chunking, a budget below the longest prompt would make it run alone (tested
    # elsewhere); keep it above so every step must respect the budget exactly.
    budget = draw(st.integers(1, 300)) if chunk else draw(st.integers(100, 300))
    config = EngineConfig(
        DEP,
        noise_sigma=draw(st.sampled_from([0.0, 0.05])),
        seed=draw(st.integers(0, 3)),
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=budget,
        chunked_prefill=chunk,
        enable_prefix_caching=draw(st.booleans()),
        num_gpu_blocks_override=num_blocks,
    )
    capacity = num_blocks * BS
    families = [list(range(f * 1000, f * 1000 + 60)) for f in range(3)]
    cases = []
    for i in range(draw(st.integers(1, 12))):
        prompt_len = draw(st.integers(1, min(60, capacity - 1)))
        max_tokens = draw(st.integers(1, min(40, capacity - prompt_len)))
        family = families[draw(st.integers(0, 2))]
        shared = draw(st.integers(0, prompt_len))
        prompt = family[:shared] + [50_000 + i * 100 + k for k in range(prompt_len - shared)]
        preloaded = draw(st.integers(0, prompt_len)) if draw(st.booleans()) else 0
        request = EngineRequest(
            f"r{i}",
            prompt,
            max_tokens,
            arrival_time=draw(st.floats(0.0, 0.2)),
            hold_blocks_on_finish=draw(st.booleans()),
            preloaded_tokens=preloaded,
        )
        abort_after = draw(st.none() | st.integers(0, 5)) if draw(st.booleans()) else None
        cases.append(Case(request, abort_after))
    cases.sort(key=lambda c: c.request.arrival_time)
    return Workload(config, cases)


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_every_request_finishes_and_the_cache_drains(work: Workload) -> None:
    clock = VirtualClock()
    engine = Engine(work.config, clock)
    engine.held_timeout_s = 0.05
    blocks = engine.blocks
    config = work.config
    by_id = {c.request.request_id: c for c in work.cases}
    emitted: dict[str, list[int]] = {rid: [] for rid in by_id}
    finished: dict[str, StepOutput] = {}
    aborted: set[str] = set()
    pending = list(work.cases)

    def arrive(until: float) -> None:
        while pending and pending[0].request.arrival_time <= until:
            engine.add_request(pending.pop(0).request)

    while pending or engine.has_work():
        arrive(clock.now())
        duration = engine.begin_step()
        if duration is None:
            wakeups = [t for t in (engine.next_held_deadline(),) if t is not None]
            if pending:
                wakeups.append(pending[0].request.arrival_time)
            assert wakeups, "work that can never be scheduled"
            clock.advance_to(max(clock.now(), min(wakeups)))
            engine.expire_held()
            continue
        assert 0 < engine.last_step_tokens <= config.max_num_batched_tokens
        assert engine.last_step_requests <= engine.num_running <= config.max_num_seqs
        end = clock.now() + duration
        arrive(end)  # arrivals during the step wait for the next one
        for rid, case in by_id.items():
            if (
                case.abort_after is not None
                and rid not in finished
                and rid not in aborted
                and len(emitted[rid]) >= case.abort_after
                and engine.abort_request(rid)
            ):
                aborted.add(rid)
        clock.advance_to(end)
        for out in engine.finish_step():
            assert out.request_id not in aborted and out.request_id not in finished
            emitted[out.request_id].extend(out.token_ids)
            if out.finish_reason is not None:
                finished[out.request_id] = out
        assert 0 <= blocks.num_free_blocks <= blocks.num_blocks
        assert all(blocks.ref_count(b) >= 0 for b in range(blocks.num_blocks))
        engine.expire_held()

    assert set(finished) | aborted == set(by_id) and not set(finished) & aborted
    words = WordGenerator(config.seed)
    for rid, out in finished.items():
        request = by_id[rid].request
        assert out.finish_reason == "length" and out.stats is not None
        assert out.stats.completion_tokens == request.max_tokens == len(emitted[rid])
        assert emitted[rid] == words.token_ids_for(words.words(rid, 0, request.max_tokens))
        assert out.stats.held_blocks == request.hold_blocks_on_finish
        engine.release_held(rid)
    assert engine.next_held_deadline() is None
    assert engine.kv_usage == 0.0 and blocks.num_free_blocks == blocks.num_blocks
    assert engine.generation_tokens_total == sum(len(e) for e in emitted.values())
