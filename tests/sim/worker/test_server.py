"""The simulated worker over HTTP, in a real `sim-cluster` process, with real clients."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest

from bench.stack.up import free_port_block
from sim.engine.presets import deployment_from_names
from sim.engine.roofline import CostModel
from tests.procs import Process

MODEL = "llama-3.1-8b"


def words(n: int, salt: str = "w") -> str:
    return " ".join(f"{salt}{i}" for i in range(n))


@pytest.fixture(scope="module")
def cluster() -> Iterator[list[str]]:
    base = free_port_block("127.0.0.1", 3)
    proc = Process(
        ["sim-cluster", "--base-port", str(base), "--workers", "3", "--noise", "0",
         "--nic-gbps", "40"]
    )  # fmt: skip
    urls = [f"http://127.0.0.1:{base + i}" for i in range(3)]
    proc.wait_healthy(urls)
    yield urls
    assert proc.stop() == 0, proc.output()


async def post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], path: str = "/v1/completions"
) -> tuple[int, dict[str, Any], dict[str, str]]:
    async with session.post(url + path, json=body) as response:
        return response.status, await response.json(), dict(response.headers)


async def metric(session: aiohttp.ClientSession, url: str, name: str, having: str = "") -> float:
    """Sum of a metric's samples on a worker (only those whose line contains `having`)."""
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and having in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_openai_client_streams_chat_with_usage(cluster: list[str]) -> None:
    client = openai.OpenAI(base_url=cluster[0] + "/v1", api_key="unused")
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "tell me a story about the sea"}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    content: list[str] = []
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                content.append(choice.delta.content)
    assert len("".join(content).split()) == 12
    assert usage is not None
    assert usage.completion_tokens == 12
    rendered = "<|user|> tell me a story about the sea <|assistant|>"
    assert usage.prompt_tokens == len(rendered.split())
    client.close()


def test_openai_client_non_streaming_completion(cluster: list[str]) -> None:
    client = openai.OpenAI(base_url=cluster[0] + "/v1", api_key="unused")
    result = client.completions.create(model=MODEL, prompt=words(40), max_tokens=5)
    assert result.id.startswith("cmpl-")
    assert result.choices[0].finish_reason == "length"
    assert len(result.choices[0].text.split()) == 5
    assert result.usage is not None and result.usage.prompt_tokens == 40
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    client.close()


async def test_same_prompt_twice_hits_prefix_cache(cluster: list[str]) -> None:
    body = {"model": MODEL, "prompt": words(300, "cache"), "max_tokens": 2}
    async with aiohttp.ClientSession() as session:
        status, first, _ = await post(session, cluster[1], body)
        assert status == 200
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        status, second, _ = await post(session, cluster[1], body)
        # full 16-token blocks of the prompt, less the block holding the recomputed last token
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 288


async def test_request_id_is_honoured(cluster: list[str]) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(
            cluster[0] + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
            headers={"X-Request-Id": "abc123"},
        ) as response:
            body = await response.json()
            assert response.headers["X-Request-Id"] == "abc123"
    assert body["id"] == "chatcmpl-abc123"
    assert body["object"] == "chat.completion"


async def test_pd_handoff_pulls_kv_and_frees_prefill_blocks(cluster: list[str]) -> None:
    prefill, decode = cluster[0], cluster[2]
    prompt = words(1000, "pd")
    async with aiohttp.ClientSession() as session:
        status, first, _ = await post(
            session, prefill,
            {"model": MODEL, "prompt": prompt, "max_tokens": 1, "stream": False,
             "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                    "remote_engine_id": None, "remote_block_ids": None,
                                    "remote_host": None, "remote_port": None}},
        )  # fmt: skip
        assert status == 200
        assert first["choices"][0]["finish_reason"] == "length"
        params = first["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        [blocks] = params["remote_block_ids"]  # one KV group
        assert len(blocks) == 63  # ceil(1000 / 16) blocks held
        assert params["remote_num_tokens"] == 1000 and params["transfer_mode"] == "pull"
        assert {"remote_engine_id", "remote_request_id", "remote_host", "remote_port",
                "tp_size"} <= params.keys()  # fmt: skip
        assert await metric(session, prefill, "vllm:kv_cache_usage_perc") > 0

        moved = await metric(session, decode, "vllm:nixl_bytes_transferred_sum")
        status, second, _ = await post(
            session,
            decode,
            {"model": MODEL, "prompt": prompt, "max_tokens": 8, "kv_transfer_params": params},
        )
        assert status == 200
        # whole blocks: 63 x 16 tokens x 128 KiB
        assert await metric(session, decode, "vllm:nixl_bytes_transferred_sum") - moved == (
            63 * 16 * 131072)  # fmt: skip
        assert second["usage"]["completion_tokens"] == 8
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # the decode worker computed only the last prompt token itself
        assert await metric(session, decode, "vllm:prompt_tokens_total") >= 1
        for _ in range(50):
            if await metric(session, prefill, "vllm:kv_cache_usage_perc") == 0:
                break
            await asyncio.sleep(0.02)
        assert await metric(session, prefill, "vllm:kv_cache_usage_perc") == 0
        async with session.get(f"{prefill}/kv/held/{params['remote_request_id']}") as held:
            assert held.status == 404


async def test_decode_leg_with_expired_source_falls_back_to_local_prefill(
    cluster: list[str],
) -> None:
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1],
              "remote_engine_id": "gone", "remote_request_id": "never-held",
              "remote_host": "127.0.0.1", "remote_port": int(cluster[0].rsplit(":", 1)[1]),
              "tp_size": 1}  # fmt: skip
    failed = "vllm:nixl_num_failed_transfers_total"
    async with aiohttp.ClientSession() as session:
        before = await metric(session, cluster[2], failed)
        status, body, _ = await post(
            session, cluster[2],
            {"model": MODEL, "prompt": words(50, "fb"), "max_tokens": 3,
             "kv_transfer_params": params},
        )  # fmt: skip
        assert await metric(session, cluster[2], failed) == before + 1
    assert status == 200
    assert body["usage"]["completion_tokens"] == 3


async def _held_prefill(session: aiohttp.ClientSession, url: str, prompt: str) -> Any:
    _, body, _ = await post(
        session, url,
        {"model": MODEL, "prompt": prompt, "max_tokens": 1,
         "kv_transfer_params": {"do_remote_decode": True}},
    )  # fmt: skip
    return body["kv_transfer_params"]


async def _pull_ms(session: aiohttp.ClientSession, url: str, prompt: str, params: Any) -> float:
    """What the decode worker's vllm:nixl_xfer_time_seconds recorded for this one pull (the
    pulls timed together go to different workers)."""
    name = "vllm:nixl_xfer_time_seconds"
    count, total = (
        await metric(session, url, name + "_count"),
        await metric(session, url, name + "_sum"),
    )
    status, _, _ = await post(
        session, url, {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                       "kv_transfer_params": params},
    )  # fmt: skip
    assert status == 200
    assert await metric(session, url, name + "_count") == count + 1
    return (await metric(session, url, name + "_sum") - total) * 1000


async def test_two_concurrent_pulls_share_one_nic(cluster: list[str]) -> None:
    source, first, second = cluster
    async with aiohttp.ClientSession() as session:
        prompt = words(4000, "solo")
        alone = await _pull_ms(session, first, prompt, await _held_prefill(session, source, prompt))
        prompts = [words(4000, "pairA"), words(4000, "pairB")]
        params = [await _held_prefill(session, source, p) for p in prompts]
        together = await asyncio.gather(
            _pull_ms(session, first, prompts[0], params[0]),
            _pull_ms(session, second, prompts[1], params[1]),
        )
    # 4000 tokens (250 blocks of 16) x 128 KiB over a 40 Gb/s NIC: ~105 ms alone, ~210 ms
    # when sharing egress
    assert alone == pytest.approx(4000 * 131072 / 5e9 * 1000, rel=0.05)
    for elapsed in together:
        assert elapsed == pytest.approx(2 * alone, rel=0.15)


async def _ttft_s(session: aiohttp.ClientSession, url: str, prompt: str) -> float:
    started = time.monotonic()
    async with session.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True},
    ) as response:
        async for line in response.content:
            if line.startswith(b"data: {"):
                return time.monotonic() - started
    raise AssertionError("no chunk")


async def _engine_ttft_s(session: aiohttp.ClientSession, url: str, prompt: str) -> float:
    """The worker's own TTFT for one whole request: arrival at its engine to first token."""
    name = "vllm:time_to_first_token_seconds_sum"
    before = await metric(session, url, name)
    async with session.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True},
    ) as response:
        assert response.status == 200
        await response.read()
    return await metric(session, url, name) - before


async def test_ttft_on_idle_worker_matches_the_model(cluster: list[str]) -> None:
    model = CostModel(deployment_from_names("h200-sxm", MODEL, 1), noise_sigma=0.0)
    async with aiohttp.ClientSession() as session:
        await _ttft_s(session, cluster[1], "warm up")
        # Fresh prompts (no cached prefix). The engine's own TTFT excludes the HTTP parsing and
        # tokenising before it, which a slow or busy machine stretches by tens of ms.
        engine_4k = min(
            [await _engine_ttft_s(session, cluster[1], words(4096, f"t4k{i}_")) for i in range(3)]
        )
        client_4k = await _ttft_s(session, cluster[1], words(4096, "t4k_client"))
        client_8k = await _ttft_s(session, cluster[1], words(8192, "t8k"))
    assert engine_4k == pytest.approx(model.predict_prefill_s(4096), rel=0.10)
    assert client_4k >= engine_4k
    assert client_8k > client_4k


@pytest.mark.parametrize(
    ("path", "raw", "status", "param"),
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b'{"model": "nope", "prompt": "hi"}', 404, "model"),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": -1}', 400, "max_tokens"),
        ("/v1/completions", b'{"prompt": "hi", "n": 2}', 400, "n"),
        ("/v1/completions", b'{"prompt": "hi", "stream_options": {}}', 400, "stream_options"),
        ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 200000}', 400, "prompt"),
        ("/v1/completions", b'{"prompt": "hi", "priority": "high"}', 400, "priority"),
    ],
)
async def test_bad_inputs_get_vllm_errors_and_the_worker_keeps_serving(
    cluster: list[str], path: str, raw: bytes, status: int, param: str | None
) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(
            cluster[0] + path, data=raw, headers={"Content-Type": "application/json"}
        ) as response:
            assert response.status == status
            error = (await response.json())["error"]
        assert error["code"] == status
        assert error["param"] == param
        assert isinstance(error["message"], str) and error["message"]
        assert error["type"] in {"BadRequestError", "NotFoundError"}
        ok, body, _ = await post(session, cluster[0], {"prompt": "still alive", "max_tokens": 1})
        assert ok == 200 and body["usage"]["completion_tokens"] == 1


async def test_prompt_beyond_context_is_rejected(cluster: list[str]) -> None:
    async with aiohttp.ClientSession() as session:
        status, body, _ = await post(
            session, cluster[0], {"prompt": words(131072, "x"), "max_tokens": 1}
        )
    assert status == 400
    assert "maximum context length" in body["error"]["message"]


ABORTS = "vllm:request_success_total"


async def test_client_disconnect_aborts_the_request(cluster: list[str]) -> None:
    url = cluster[1]
    async with aiohttp.ClientSession() as session:
        before = await metric(session, url, ABORTS, 'finished_reason="abort"')
        async with session.post(
            url + "/v1/completions",
            json={"prompt": "go on forever", "max_tokens": 100000, "stream": True},
        ) as response:
            async for line in response.content:
                if line.startswith(b"data: {"):
                    break
        for _ in range(100):
            running = await metric(session, url, "vllm:num_requests_running")
            if running == 0:
                break
            await asyncio.sleep(0.01)
        assert running == 0
        after = await metric(session, url, ABORTS, 'finished_reason="abort"')
    assert after == before + 1


VLLM_METRICS = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
    "vllm:request_prefill_time_seconds_bucket", "vllm:request_decode_time_seconds_bucket",
]  # fmt: skip


async def test_metrics_use_vllm_names_and_labels(cluster: list[str]) -> None:
    async with aiohttp.ClientSession() as session:
        await post(session, cluster[0], {"prompt": "count me", "max_tokens": 3})
        async with session.get(cluster[0] + "/metrics") as response:
            text = await response.text()
    for name in VLLM_METRICS:
        lines = [line for line in text.splitlines() if line.startswith(name + "{")]
        assert lines, name
        assert all(f'model_name="{MODEL}"' in line and 'engine="0"' in line for line in lines)
