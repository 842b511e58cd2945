"""Every built-in policy serves a multi-turn load on real engines to its end: every turn
answered with its full length, none lost."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
import msgspec
import pytest

from tests.real_engine.conftest import MODEL, Router, words

StartRouter = Callable[..., Router]
SESSIONS = 6
TURNS = 3
ANSWER_TOKENS = 16

SPLIT = ("prefill", "decode", "decode")
MIXED = ("mixed", "mixed", "mixed")


@pytest.mark.parametrize(
    ("policy", "roles", "params"),
    [
        ("round-robin", MIXED, ()),
        ("colocate", MIXED, ()),
        ("disaggregate", SPLIT, ()),
        ("threshold", SPLIT, ("threshold=256",)),
        ("adaptive", MIXED, ("gpu=cpu", "model=tiny-llama")),
    ],
)
def test_policy_serves_a_multi_turn_load_to_the_end(
    fleet: list[str], start_router: StartRouter, policy: str, roles: tuple[str, ...],
    params: tuple[str, ...],
) -> None:  # fmt: skip
    router = start_router(list(zip(roles, fleet, strict=True)), policy, params=params)

    async def session(client: aiohttp.ClientSession, index: int) -> list[int]:
        history: list[dict[str, str]] = []
        lengths = []
        for turn in range(TURNS):
            history.append(
                {"role": "user", "content": words(1000 * index + turn, 30 + 100 * (index % 3))}
            )
            body = {"model": str(MODEL), "messages": history, "max_tokens": ANSWER_TOKENS,
                    "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            text, completion = [], 0
            async with client.post(
                "/v1/chat/completions", json=body, headers={"X-Session-ID": f"{policy}-{index}"}
            ) as answer:
                assert answer.status == 200, await answer.read()
                async for raw in answer.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: {"):
                        continue
                    chunk = msgspec.json.decode(line[6:])
                    assert "error" not in chunk, chunk
                    for choice in chunk.get("choices") or []:
                        text.append(choice["delta"].get("content") or "")
                    if chunk.get("usage"):
                        completion = chunk["usage"]["completion_tokens"]
            history.append({"role": "assistant", "content": "".join(text)})
            lengths.append(completion)
        return lengths

    async def load() -> list[list[int]]:
        timeout = aiohttp.ClientTimeout(total=180)
        async with aiohttp.ClientSession(router.url, timeout=timeout) as client:
            return await asyncio.gather(*(session(client, i) for i in range(SESSIONS)))

    lengths = asyncio.run(load())
    assert lengths == [[ANSWER_TOKENS] * TURNS] * SESSIONS
    decisions = router.decisions(policy, count=SESSIONS * TURNS)
    assert len(decisions) == SESSIONS * TURNS
    assert all(d["outcome"] == "completed" for d in decisions), [d["outcome"] for d in decisions]
