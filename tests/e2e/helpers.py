"""Small client helpers for end-to-end tests."""

from __future__ import annotations

import json
from typing import Any

import aiohttp


async def chat(
    session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], *,
    max_tokens: int = 8, session_id: str | None = None, stream: bool = True,
    usage: bool = True, headers: dict[str, str] | None = None,
) -> tuple[str, dict[str, Any], aiohttp.ClientResponse]:  # fmt: skip
    """One chat turn; returns (answer text, usage, response)."""
    body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens, "stream": stream}
    if stream and usage:
        body["stream_options"] = {"include_usage": True}
    all_headers = dict(headers or {})
    if session_id:
        all_headers["X-Session-ID"] = session_id
    async with session.post(url + "/v1/chat/completions", json=body, headers=all_headers) as r:
        if r.status != 200:
            return "", {"error": await r.json()}, r
        if not stream:
            data = await r.json()
            return data["choices"][0]["message"]["content"], data["usage"], r
        parts: list[str] = []
        found: dict[str, Any] = {}
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                found = chunk["usage"]
            for choice in chunk.get("choices", []):
                parts.append(choice.get("delta", {}).get("content") or "")
        return "".join(parts), found, r


async def metric_sum(
    session: aiohttp.ClientSession, url: str, name: str, having: str = ""
) -> float:
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and having in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def admin_get(session: aiohttp.ClientSession, url: str, token: str, path: str) -> Any:
    async with session.get(url + path, headers={"Authorization": f"Bearer {token}"}) as r:
        return r.status, await r.json()
