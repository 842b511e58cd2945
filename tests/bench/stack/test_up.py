"""`session-router up`: the official OpenAI client against it, Ctrl-C shutdown, start failures."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import aiohttp
import openai
import pytest

from bench.stack.layout import ClusterSpec
from bench.stack.up import LocalStack, StackSpec, curl_example, free_port_block, policy_params
from policies import PolicyConfigError, available_policies
from tests.conftest import free_port
from tests.procs import Process

TWO_GPUS = ClusterSpec(2, "h200-sxm", "llama-3.1-8b")


def _closed(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


async def test_official_openai_client(tmp_path: Path) -> None:
    spec = StackSpec(cluster=TWO_GPUS, roles=("mixed", "mixed"), policy="colocate",
                     log_dir=str(tmp_path))  # fmt: skip
    async with LocalStack(spec) as stack:
        client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
        try:
            models = await client.models.list()
            assert [m.id for m in models.data] == [stack.model] == ["llama-3.1-8b"]
            messages: list[openai.types.chat.ChatCompletionMessageParam] = [
                {"role": "system", "content": "You are terse. " * 40},
                {"role": "user", "content": "Name three rivers."},
            ]
            turns = []
            for _ in range(2):
                stream = await client.chat.completions.create(
                    model=stack.model, messages=messages, max_tokens=12, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                    extra_headers={"X-Session-ID": "rivers"},
                )  # fmt: skip
                parts: list[str] = []
                usage = None
                async for chunk in stream:
                    if chunk.usage is not None:
                        usage = chunk.usage
                    parts.extend(c.delta.content or "" for c in chunk.choices)
                answer = "".join(parts)
                assert usage is not None and len(answer.split()) == usage.completion_tokens == 12
                turns.append(usage)
                messages += [{"role": "assistant", "content": answer},
                             {"role": "user", "content": "And three more."}]  # fmt: skip
            # 120 + 3 words, one tag per message, one for the generation prompt
            assert turns[0].prompt_tokens == 120 + 3 + 2 + 1
            assert turns[1].prompt_tokens == turns[0].prompt_tokens + 1 + 12 + 1 + 3
            # the session stayed on its worker: the second turn hits the first one's KV
            details = turns[1].prompt_tokens_details
            assert details is not None and details.cached_tokens is not None
            # every full 16-token block of the first turn's prompt and answer (126 + 12)
            assert details.cached_tokens == 128
            reply = await client.chat.completions.create(
                model=stack.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert len((reply.choices[0].message.content or "").split()) == 5
        finally:
            await client.close()


def test_up_runs_until_ctrl_c() -> None:
    port, base = free_port(), free_port_block("127.0.0.1", 2)
    process = Process(["up", "--workers", "2", "--port", str(port),
                       "--worker-base-port", str(base)])  # fmt: skip
    urls = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
    try:
        process.wait_healthy(urls, timeout_s=60)
    finally:
        code = process.stop(signal.SIGINT, timeout_s=30)
    output = process.log.read_text()
    default = "adaptive" if "adaptive" in available_policies() else "colocate"
    assert f"session-router up: policy {default} on 2xh200-sxm/llama-3.1-8b" in output
    assert curl_example(urls[0], "llama-3.1-8b") in output
    assert "session-router up: stopping" in output
    assert code == 0
    assert all(_closed(p) for p in (port, base, base + 1))


async def test_a_child_that_cannot_start_is_reported_and_all_stopped(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        base = free_port_block("127.0.0.1", 2)
        spec = StackSpec(cluster=TWO_GPUS, roles=("mixed", "mixed"), policy="colocate",
                         port=port, worker_base_port=base, log_dir=str(tmp_path),
                         startup_timeout_s=20)  # fmt: skip
        with pytest.raises(RuntimeError, match="the router process exited at start"):
            await LocalStack(spec).start()
    assert _closed(base) and _closed(base + 1)
    assert "address already in use" in (tmp_path / "router.log").read_text().lower()


async def test_ports_taken_after_they_were_chosen_are_chosen_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another program may bind a port between the stack finding it free and its child
    listening on it: the stack then starts on other ports."""
    import bench.stack.up as up

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        offered = [port]  # the router's first port is the taken one; then free ones

        def choose(host: str, count: int) -> int:
            return offered.pop() if count == 1 and offered else free_port_block(host, count)

        monkeypatch.setattr(up, "free_port_block", choose)
        spec = StackSpec(cluster=TWO_GPUS, roles=("mixed", "mixed"), policy="colocate",
                         log_dir=str(tmp_path), startup_timeout_s=20)  # fmt: skip
        async with LocalStack(spec) as stack:
            assert stack.port != port
            async with aiohttp.ClientSession() as session:
                async with session.get(stack.url + "/ready") as ready:
                    assert ready.status == 200


def test_stack_spec_and_policy_params() -> None:
    with pytest.raises(ValueError, match="1 roles for 2 workers"):
        StackSpec(cluster=TWO_GPUS, roles=("mixed",), policy="colocate")
    with pytest.raises(PolicyConfigError, match="unknown policy 'nope'"):
        policy_params("nope", {}, TWO_GPUS)
    with pytest.raises(PolicyConfigError, match="unknown parameter 'x'"):
        policy_params("colocate", {"x": "1"}, TWO_GPUS)
    assert policy_params("threshold", {"threshold": "64"}, TWO_GPUS) == {"threshold": "64"}
