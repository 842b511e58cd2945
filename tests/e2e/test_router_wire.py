"""What the router puts on the wire: headers, usage handling, SGLang legs, first-token modes."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.conftest import SimCluster, StartRouter
from tests.e2e.helpers import admin_get, chat
from tests.e2e.recording_worker import RecordingWorker

MESSAGES = [{"role": "user", "content": "hello"}]


async def test_hop_by_hop_and_auth_headers_are_not_forwarded(
    recorder: RecordingWorker, start_router: StartRouter
) -> None:
    router = await asyncio.to_thread(start_router, "--mixed", recorder.url)
    headers = {"Authorization": "Bearer client-secret", "Connection": "keep-alive, X-Secret",
               "Proxy-Authorization": "Basic abc", "TE": "trailers", "X-Secret": "1",
               "X-Request-Id": "req-123"}  # fmt: skip
    async with aiohttp.ClientSession() as http:
        _, usage, response = await chat(http, router.url, MESSAGES, headers=headers)
        assert response.status == 200, usage
        assert response.headers["X-Request-Id"] == "req-123"
    sent = set(recorder.received[-1].headers)
    # the client's id is echoed to it; the worker gets the router's own (a handoff's pairing id)
    assert recorder.received[-1].headers["x-request-id"] not in ("", "req-123")
    for header in ("authorization", "proxy-authorization", "te", "x-secret"):
        assert header not in sent


async def test_forward_auth_passes_the_client_authorization(
    recorder: RecordingWorker, start_router: StartRouter
) -> None:
    router = await asyncio.to_thread(start_router, "--mixed", recorder.url, "--forward-auth")
    async with aiohttp.ClientSession() as http:
        await chat(http, router.url, MESSAGES, headers={"Authorization": "Bearer tok"})
    assert recorder.received[-1].headers["authorization"] == "Bearer tok"


async def test_usage_is_requested_upstream_and_dropped_when_the_client_did_not_ask(
    recorder: RecordingWorker, start_router: StartRouter
) -> None:
    router = await asyncio.to_thread(start_router, "--mixed", recorder.url)
    body = {"messages": MESSAGES, "stream": True, "max_tokens": 3}
    async with aiohttp.ClientSession() as http:
        async with http.post(router.url + "/v1/chat/completions", json=body) as response:
            frames = [line async for line in response.content if line.startswith(b"data: ")]
    assert recorder.received[-1].body["stream_options"] == {"include_usage": True}
    assert not any(b'"usage"' in frame for frame in frames)
    assert frames[-1].strip() == b"data: [DONE]"


async def test_sglang_handoff_sends_one_body_to_both_with_bootstrap_fields(
    start_router: StartRouter, tmp_path: Path
) -> None:
    prefill, decode = RecordingWorker(cached=4), RecordingWorker()
    await prefill.start()
    await decode.start()
    try:
        config = tmp_path / "router.toml"
        config.write_text(
            'policy = { name = "disaggregate" }\n'
            f'[[workers]]\nurl = "{prefill.url}"\nrole = "prefill"\nengine = "sglang"\n'
            "bootstrap_port = 8998\n"
            f'[[workers]]\nurl = "{decode.url}"\nrole = "decode"\nengine = "sglang"\n'
        )
        router = await asyncio.to_thread(start_router, "--config", str(config))
        async with aiohttp.ClientSession() as http:
            text, usage, response = await chat(http, router.url, MESSAGES)
            # the prefill answer is drained beside the relayed one: its usage may come after
            async with asyncio.timeout(5):
                while True:
                    _, decisions = await admin_get(http, router.url, router.admin_token,
                                                   "/admin/decisions?limit=1")  # fmt: skip
                    if decisions["decisions"][0]["prefill_cached_tokens"] is not None:
                        break
                    await asyncio.sleep(0.02)
    finally:
        await prefill.stop()
        await decode.stop()
    assert response.status == 200 and text == " t0 t1 t2"
    # what the prefill server found cached is recorded; the client sees the decode server's
    assert decisions["decisions"][0]["prefill_cached_tokens"] == 4
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    p, d = prefill.received[-1].body, decode.received[-1].body
    assert p == d
    assert p["bootstrap_host"] == "127.0.0.1" and p["bootstrap_port"] == 8998
    assert 0 <= p["bootstrap_room"] < 2**63
    assert p["stream"] is True and "kv_transfer_params" not in p


async def test_first_token_prefill_streams_the_prefill_token_once(
    sim4: SimCluster, start_router: StartRouter
) -> None:
    prefill, decode = sim4.urls[2], sim4.urls[3]
    router = start_router("--prefill", prefill, "--decode", decode, "--policy", "disaggregate",
                          "--first-token", "prefill")  # fmt: skip
    async with aiohttp.ClientSession() as http:
        text, usage, response = await chat(http, router.url, MESSAGES, max_tokens=6)
        _, decisions = await admin_get(http, router.url, router.admin_token,
                                       "/admin/decisions?limit=1")  # fmt: skip
    assert response.status == 200
    assert len(text.split()) == 6  # the prefill token plus five from the decode leg, no duplicate
    assert usage["completion_tokens"] == 6
    event = decisions["decisions"][0]
    assert event["first_token_convention"] == "prefill"
    assert event["first_token"] <= event["transfer_end"]


@pytest.mark.parametrize("ending", ["router stops", "nothing more comes"])
async def test_events_file_gets_one_line_per_turn(
    sim4: SimCluster, start_router: StartRouter, tmp_path: Path, ending: str
) -> None:
    # Accounting for a turn waits for a later turn's worker wait: the last turn's comes from
    # the router stopping, or from a short timer when nothing more happens.
    events = tmp_path / "events.jsonl"
    router = start_router("--mixed", sim4.urls[0], "--events", str(events))
    async with aiohttp.ClientSession() as http:
        for i in range(3):
            await chat(http, router.url, MESSAGES, session_id=f"ev-{i}")
    if ending == "router stops":
        router.process.stop()
    rows: list[dict[str, Any]] = []
    async with asyncio.timeout(5):
        while len(rows) < 3:
            await asyncio.sleep(0.05)
            rows = [json.loads(line) for line in events.read_text().splitlines()]
    assert [row["session_id"] for row in rows] == ["ev-0", "ev-1", "ev-2"]
    assert all(row["outcome"] == "completed" and row["completion_tokens"] == 8 for row in rows)


async def test_a_local_tokenizer_file_gives_exact_prompt_counts(
    sim4: SimCluster, start_router: StartRouter, tmp_path: Path
) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    # the simulated workers count one token per whitespace word: so does this tokenizer
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    router = start_router("--mixed", sim4.urls[0], "--tokenizer", str(path))
    prompt = " ".join(f"word{i}" for i in range(321))
    async with aiohttp.ClientSession() as http:
        async with http.post(router.url + "/v1/completions",
                             json={"prompt": prompt, "max_tokens": 2}) as response:  # fmt: skip
            usage = (await response.json())["usage"]
        _, decisions = await admin_get(http, router.url, router.admin_token,
                                       "/admin/decisions?limit=1")  # fmt: skip
    event = decisions["decisions"][0]
    assert usage["prompt_tokens"] == 321
    assert event["estimated_prompt_tokens"] == 321


@pytest.mark.parametrize(
    ("policy", "flag", "client_priority", "sent"),
    [
        ("adaptive", True, None, "due"),  # when the first token is due, in unix ms
        ("adaptive", False, None, None),  # the worker does not schedule by priority
        ("colocate", True, None, None),  # a policy that gives no due time
        ("adaptive", True, 7, 7),  # the client's own priority stays as it is
    ],
)
async def test_a_turn_tells_a_priority_scheduling_worker_when_it_is_due(
    recorder: RecordingWorker, start_router: StartRouter, policy: str, flag: bool,
    client_priority: int | None, sent: int | str | None,
) -> None:  # fmt: skip
    args = ["--mixed", recorder.url, "--policy", policy]
    router = await asyncio.to_thread(start_router, *args, *(["--priority-scheduling"] * flag))
    body: dict[str, Any] = {"messages": MESSAGES, "max_tokens": 3}
    if client_priority is not None:
        body["priority"] = client_priority
    async with aiohttp.ClientSession() as http:
        sent_at = time.time()
        async with http.post(router.url + "/v1/chat/completions", json=body,
                             headers={"X-SLO-TTFT-Ms": "2500"}) as response:  # fmt: skip
            assert response.status == 200, await response.text()
    received = recorder.received[-1]
    if sent == "due":
        assert sent_at * 1000 + 2499 <= received.body["priority"] <= received.at * 1000 + 2501
    elif sent is None:
        assert "priority" not in received.body
    else:
        assert received.body["priority"] == sent
    assert received.body["messages"] == MESSAGES  # the rest of the body is untouched
