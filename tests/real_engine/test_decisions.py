"""Every decision the router carries out, against real engines: migrate, recompute, reject,
the deadline order on priority-scheduled engines, and the failures a real engine gives (a
decode leg's 500 after a good prefill, an engine killed mid-stream)."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import openai
import pytest
from aiohttp import web

from bench.stack.up import free_port_block
from bench.vllm.engine import EngineSpec, VllmEngine
from tests.real_engine.conftest import (
    HOST,
    MAX_NUM_SEQS,
    MODEL,
    VENV,
    Router,
    engine_counters,
    words,
)

StartRouter = Callable[..., Router]
SCRIPTED = "tests.e2e.scripted_policies:Scripted"


def _turns(client: openai.OpenAI, seed: int, turns: int) -> list[Any]:
    history: list[dict[str, str]] = []
    answers = []
    for turn in range(turns):
        history.append({"role": "user", "content": words(seed * 100 + turn, 120)})
        answer = client.chat.completions.create(
            model=str(MODEL), messages=history, max_tokens=8, temperature=0.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        history.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
        answers.append(answer)
    return answers


def _decisions(router: Router, session: str, count: int) -> list[dict[str, Any]]:
    """The session's decisions in order, once `count` have settled."""
    return sorted((d for d in router.decisions(session, count) if d["session_id"] == session),
                  key=lambda d: d["admitted"])  # fmt: skip


def test_migrate_moves_the_session_by_transfer(fleet: list[str], start_router: StartRouter) -> None:
    a, b = fleet[0], fleet[1]
    router = start_router([("mixed", a), ("mixed", b)], SCRIPTED,
                          params=["plan=colocate:0;migrate:0>1;colocate:1"])  # fmt: skip
    before = engine_counters(b)
    answers = _turns(router.client("migrate"), 11, 3)
    after = engine_counters(b)
    actions = [d["action"] for d in _decisions(router, "migrate", 3)]
    assert actions == ["colocate", "migrate", "colocate"]
    second = answers[1].usage.prompt_tokens
    # the migration pulled the second turn's prompt into b; the third turn found it cached
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == second
    third = answers[2].usage.prompt_tokens_details
    assert third is not None and third.cached_tokens >= 128 * (second // 128) - 128


def test_recompute_prefills_the_whole_context_elsewhere(
    fleet: list[str], start_router: StartRouter
) -> None:
    a, b = fleet[0], fleet[2]
    router = start_router([("mixed", a), ("mixed", b)], SCRIPTED,
                          params=["plan=colocate:0;recompute:1"])  # fmt: skip
    before = engine_counters(b)
    answers = _turns(router.client("recompute"), 12, 2)
    after = engine_counters(b)
    decisions = _decisions(router, "recompute", 2)
    assert [d["action"] for d in decisions] == ["colocate", "recompute"]
    assert decisions[1]["recomputed_tokens"] > 0
    computed = after["local_compute"] - before["local_compute"]
    assert computed == answers[1].usage.prompt_tokens
    assert after["external_kv_transfer"] == before["external_kv_transfer"]


def test_reject_answers_429_or_503_with_retry_after(
    fleet: list[str], start_router: StartRouter
) -> None:
    router = start_router([("mixed", fleet[0])], SCRIPTED, params=["plan=reject"])
    body = msgspec.json.encode({"model": str(MODEL), "max_tokens": 4,
                                "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    request = urllib.request.Request(
        f"{router.url}/v1/chat/completions", data=body, method="POST",
        headers={"X-Session-ID": "reject", "Content-Type": "application/json"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    with refused.value as answer:  # the refusal's connection is closed with it
        assert answer.code in (429, 503)
        assert float(answer.headers["retry-after"]) >= 1
        error = msgspec.json.decode(answer.read())["error"]
    assert {"message", "type", "param", "code"} <= set(error)
    assert [d["action"] for d in _decisions(router, "reject", 1)] == ["reject"]


def test_turns_due_sooner_are_admitted_first_on_priority_engines(
    fleet: list[str], start_router: StartRouter
) -> None:
    url = fleet[2]
    router = start_router([("mixed", url)], SCRIPTED, params=["plan=colocate:0"])

    async def scenario() -> dict[str, float]:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(router.url, timeout=timeout) as client:

            async def turn(session: str, prompt_words: int, max_tokens: int) -> float:
                """When the turn's first token came; the answer is read to its end (a
                client that went away would cancel it and free its slot)."""
                body = {"model": str(MODEL), "prompt": words(len(session) * prompt_words,
                        prompt_words), "max_tokens": max_tokens, "ignore_eos": True,
                        "stream": True}  # fmt: skip
                first: float | None = None
                async with client.post(
                    "/v1/completions", json=body, headers={"X-Session-ID": session}
                ) as answer:
                    assert answer.status == 200
                    async for line in answer.content:
                        if first is None and line.startswith(b"data: {"):
                            first = time.monotonic()
                assert first is not None, "no token"
                return first

            # every running slot busy with long answers, then two turns queue behind them:
            # the later one is due sooner (a short prompt's TTFT objective is the shorter)
            # (of different lengths, so that their slots come free one at a time)
            busy = [asyncio.create_task(turn(f"busy-{i}", 20, 500 + 150 * i))
                     for i in range(MAX_NUM_SEQS)]  # fmt: skip
            await asyncio.sleep(1.0)
            late = asyncio.create_task(turn("due-later", 600, 4))
            await asyncio.sleep(0.05)
            soon = asyncio.create_task(turn("due-sooner", 10, 4))
            firsts = {"due-later": await late, "due-sooner": await soon}
            await asyncio.gather(*busy)
            return firsts

    firsts = asyncio.run(scenario())
    assert firsts["due-sooner"] < firsts["due-later"]


class _BreakingProxy:
    """An HTTP proxy in front of a real decode engine that spoils the `remote_engine_id` of
    the KV a decode leg asks to pull, so that the real engine fails the leg with its own 500
    (a KV load failure); everything else passes unchanged."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.port = free_port_block(HOST, 1)
        self.url = f"http://{HOST}:{self.port}"
        self.spoiled = 0
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(self.target, timeout=timeout) as upstream:

            async def forward(request: web.Request) -> web.StreamResponse:
                body = await request.read()
                if body:
                    decoded = msgspec.json.decode(body)
                    params = decoded.get("kv_transfer_params") or {}
                    if params.get("do_remote_prefill"):
                        params["remote_engine_id"] = "not-the-prefill-engine"
                        self.spoiled += 1
                        body = msgspec.json.encode(decoded)
                async with upstream.request(
                    request.method, request.path_qs, data=body or None,
                    headers={"content-type": request.headers.get("content-type", "")},
                ) as answer:  # fmt: skip
                    return web.Response(status=answer.status, body=await answer.read(),
                                        content_type=answer.content_type)  # fmt: skip

            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", forward)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, HOST, self.port).start()
            self._ready.set()
            await self._stop.wait()
            await runner.cleanup()

    def __enter__(self) -> _BreakingProxy:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def test_decode_leg_500_after_a_good_prefill_is_retried_as_a_local_prefill(
    fleet: list[str], start_router: StartRouter
) -> None:
    prefill, decode, spare = fleet
    with _BreakingProxy(decode) as broken:
        router = start_router(
            [("prefill", prefill), ("decode", broken.url), ("decode", spare)], SCRIPTED,
            params=["plan=handoff:0>1"],
        )  # fmt: skip
        before = engine_counters(spare)
        answer = router.client("decode-500").completions.create(
            model=str(MODEL), prompt=words(21, 400), max_tokens=8, temperature=0.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        after = engine_counters(spare)
    assert broken.spoiled == 1
    assert answer.usage is not None and answer.usage.completion_tokens == 8
    # the retry prefilled the prompt locally on the other decode worker
    assert after["local_compute"] - before["local_compute"] == answer.usage.prompt_tokens
    decision = _decisions(router, "decode-500", 1)[0]
    assert decision["retried"] and decision["recomputed_tokens"] > 0


@pytest.fixture
def doomed_engine(tmp_path: Path) -> Iterator[VllmEngine]:
    """An engine of this test's own, to be killed."""
    _ = MODEL
    spec = EngineSpec(model=str(MODEL), port=free_port_block(HOST, 1), cpus="1")
    with VllmEngine(spec, VENV, tmp_path, name="doomed") as engine:
        yield engine


def test_engine_killed_mid_stream_ends_the_stream_with_an_error_and_done(
    doomed_engine: VllmEngine, start_router: StartRouter
) -> None:
    router = start_router([("mixed", doomed_engine.spec.url)], "colocate")
    body = {"model": str(MODEL), "prompt": words(31, 50), "max_tokens": 3000,
            "ignore_eos": True, "stream": True}  # fmt: skip
    lines: list[str] = []
    request = urllib.request.Request(
        f"{router.url}/v1/completions", data=msgspec.json.encode(body), method="POST",
        headers={"X-Session-ID": "killed", "Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=120) as answer:
        assert answer.status == 200
        for raw in answer:
            line = raw.decode().strip()
            if line:
                lines.append(line)
            if len(lines) == 5:
                doomed_engine.kill()
    assert lines[-1] == "data: [DONE]"
    error = msgspec.json.decode(lines[-2].removeprefix("data: "))
    assert "error" in error and error["error"]["message"]
