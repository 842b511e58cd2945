"""`session-router demo`: a short tour of a simulated cluster, in one process, in seconds.

It starts simulated H200 workers on free ports, runs a multi-turn conversation against one of
them (watch the cached tokens grow turn by turn), then a vLLM NixlConnector-style handoff of a
long prompt from a prefill worker to a decode worker, and prints what the client measured.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import aiohttp

from sim.cluster import SimCluster
from sim.engine import EngineConfig
from sim.presets import deployment_from_names
from sim.server import WorkerOptions

_TOPICS = ["the tides", "a lighthouse keeper", "the northern lights", "an old ship's log"]


def _free_port_block(count: int) -> int:
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base: int = probe.getsockname()[1]
        if base + count >= 65000:
            continue
        try:
            for offset in range(1, count):
                with socket.socket() as other:
                    other.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue


async def _chat_turn(
    session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[str, float, dict[str, Any]]:
    started = time.monotonic()
    ttft = 0.0
    parts: list[str] = []
    usage: dict[str, Any] = {}
    body = {"messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                content = choice["delta"].get("content")
                if content:
                    if not parts:
                        ttft = time.monotonic() - started
                    parts.append(content)
    return "".join(parts), ttft, usage


async def run_demo() -> None:
    base = _free_port_block(2)
    engine = EngineConfig(deployment=deployment_from_names("h200-sxm", "llama-3.1-8b", 1))
    cluster = SimCluster.uniform(WorkerOptions(engine=engine), 2, base)
    await cluster.start()
    prefill_url, decode_url = cluster.urls
    print(f"simulated workers (H200, Llama-3.1-8B): {', '.join(cluster.urls)}\n")
    try:
        async with aiohttp.ClientSession() as session:
            print("A four-turn conversation on one worker (its KV stays resident):")
            messages: list[dict[str, str]] = [
                {"role": "system", "content": "You are a patient storyteller. " * 60}
            ]
            for turn, topic in enumerate(_TOPICS, start=1):
                messages.append({"role": "user", "content": f"Tell me about {topic}. " * 40})
                answer, ttft, usage = await _chat_turn(session, decode_url, messages, 48)
                messages.append({"role": "assistant", "content": answer})
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                print(f"  turn {turn}: prompt {usage['prompt_tokens']:5d} tokens, "
                      f"cached {cached:5d}, TTFT {ttft * 1e3:6.1f} ms")  # fmt: skip
            print("\nA handoff of a 16k-token prompt: prefill on one worker, decode on the other:")
            prompt = " ".join(f"context{i}" for i in range(16000))
            started = time.monotonic()
            async with session.post(
                prefill_url + "/v1/completions",
                json={
                    "prompt": prompt,
                    "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True},
                },
            ) as response:
                params = (await response.json())["kv_transfer_params"]
            prefill_s = time.monotonic() - started
            async with session.post(
                decode_url + "/v1/completions",
                json={"prompt": prompt, "max_tokens": 32, "kv_transfer_params": params},
            ) as response:
                await response.read()
                moved = int(response.headers["x-kv-transfer-bytes"])
                transfer_ms = float(response.headers["x-kv-transfer-ms"])
            print(f"  prefill leg {prefill_s * 1e3:.1f} ms; KV pulled: {moved / 2**30:.2f} GiB "
                  f"in {transfer_ms:.1f} ms over a 400 Gb/s NIC; "
                  f"total {(time.monotonic() - started) * 1e3:.1f} ms")  # fmt: skip
    finally:
        await cluster.stop()
