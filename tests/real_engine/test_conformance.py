"""The simulated worker against a live vLLM 0.32 engine: one scenario list replayed on both,
the wire compared where the router reads it (`sim.worker.conformance`): replies' keys and
value types, streamed chunks, errors, the pages' metric names, types and labels, and what one
handoff leaves in each side's counters.

The two run different models (the simulator's tokenizer is not the tiny model's), so values
are compared as meanings: the decode side's `external_kv_transfer` tokens grow by its own
prompt, its bytes by its own whole blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from bench.stack.up import free_port_block
from sim.worker.conformance import ROUTER_METRICS, compare_json, compare_metrics, compare_reply
from tests.procs import Process
from tests.real_engine.conftest import MODEL, engine_counters, words
from tests.vllm_wire import handoff, request

SIM_MODEL = str(MODEL)  # served under the same name, so that replies' `model` agree


@pytest.fixture(scope="module")
def simulated() -> Iterator[list[str]]:
    """Two simulated workers shaped as the engines: the tiny model's KV, blocks of 128."""
    base = free_port_block("127.0.0.1", 2)
    proc = Process(
        ["sim-cluster", "--base-port", str(base), "--workers", "2", "--noise", "0",
         "--model", "tiny-llama", "--block-size", "128", "--num-gpu-blocks-override", "8192",
         "--max-model-len", "4096", "--served-model-name", SIM_MODEL,
         "--scheduling-policy", "priority"]
    )  # fmt: skip
    urls = [f"http://127.0.0.1:{base + i}" for i in range(2)]
    proc.wait_healthy(urls)
    yield urls
    assert proc.stop() == 0, proc.output()


def _scenarios(seed: int) -> list[tuple[str, str, dict[str, Any]]]:
    prompt = words(seed, 200)
    return [
        ("chat", "/v1/chat/completions", {"model": str(MODEL), "max_tokens": 4,
         "messages": [{"role": "user", "content": prompt}], "ignore_eos": True}),
        ("completion", "/v1/completions", {"model": str(MODEL), "prompt": prompt,
         "max_tokens": 4, "ignore_eos": True}),
        ("chat stream", "/v1/chat/completions", {"model": str(MODEL), "max_tokens": 4,
         "messages": [{"role": "user", "content": prompt}], "ignore_eos": True,
         "stream": True, "stream_options": {"include_usage": True}}),
        ("completion stream", "/v1/completions", {"model": str(MODEL), "prompt": prompt,
         "max_tokens": 4, "ignore_eos": True, "stream": True,
         "stream_options": {"include_usage": True}}),
        ("too long", "/v1/completions", {"model": str(MODEL), "prompt": words(seed, 6000),
         "max_tokens": 4}),
        ("max_tokens over the context", "/v1/completions", {"model": str(MODEL),
         "prompt": "x", "max_tokens": 100_000}),
        ("unknown model", "/v1/completions", {"model": "no-such-model", "prompt": "x",
         "max_tokens": 4}),
        ("priority", "/v1/completions", {"model": str(MODEL), "prompt": prompt,
         "max_tokens": 2, "priority": 5}),
    ]  # fmt: skip


def test_every_scenario_answers_alike(fleet: list[str], simulated: list[str]) -> None:
    differences = []
    for name, path, body in _scenarios(41):
        real_status, real = request(fleet[0] + path, body)
        sim_status, sim = request(simulated[0] + path, body)
        if real_status != sim_status:
            differences.append(f"{name}: status {real_status} real, {sim_status} simulated")
            continue
        if isinstance(real, list) and isinstance(sim, list):
            # streams: the first chunk, the last content chunk and the usage chunk
            for label, pick in (("first", 0), ("last content", -2), ("usage", -1)):
                found = compare_json(real[pick], sim[pick])
                differences += [f"{name} ({label} chunk): {d}" for d in found]
            # (not the number of chunks: a busy engine sends several tokens in one)
        elif isinstance(real, dict) and isinstance(sim, dict):
            found = compare_reply(real, sim) if real_status == 200 else compare_json(
                {"error": {k: real["error"].get(k) for k in ("message", "type", "code")}},
                {"error": {k: sim["error"].get(k) for k in ("message", "type", "code")}},
            )  # fmt: skip
            differences += [f"{name}: {d}" for d in found]
    assert differences == [], "\n".join(differences)


def test_a_handoff_reads_alike_on_both(fleet: list[str], simulated: list[str]) -> None:
    prompt = words(42, 700)
    sides = {"real": (fleet[0], fleet[1]), "simulated": (simulated[0], simulated[1])}
    replies, grew = {}, {}
    for side, (prefill, decode) in sides.items():
        before = engine_counters(decode)
        replies[side] = handoff(prefill, decode, str(MODEL), prompt)
        after = engine_counters(decode)
        grew[side] = {key: after[key] - before.get(key, 0.0) for key in after}
    (real_first, real_second), (sim_first, sim_second) = replies["real"], replies["simulated"]
    assert compare_reply(real_first, sim_first) == []
    assert compare_reply(real_second, sim_second) == []
    for side, (_, second) in replies.items():
        usage = second["usage"]
        tokens = usage["prompt_tokens"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0, side
        assert grew[side]["external_kv_transfer"] == tokens, side
        assert grew[side]["local_compute"] == 0, side
        assert grew[side]["vllm:nixl_xfer_time_seconds_count"] == 1, side
        blocks = -(-tokens // 128)
        assert grew[side]["vllm:nixl_bytes_transferred_sum"] == blocks * 128 * 1024, side


@pytest.mark.parametrize("which", [0, 1])
def test_pages_carry_the_router_metrics_alike(
    fleet: list[str], simulated: list[str], which: int
) -> None:
    real = request(fleet[which] + "/metrics")[1]
    sim = request(simulated[which] + "/metrics")[1]
    assert compare_metrics(real, sim, ROUTER_METRICS) == []
