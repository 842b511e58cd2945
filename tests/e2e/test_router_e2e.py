"""The router in front of a real sim cluster, with a real Redis, driven by real clients."""

from __future__ import annotations

import asyncio
import json
import uuid

import aiohttp
import openai
import pytest

from tests.e2e.conftest import SimCluster, StartRouter, start_sim_cluster, workers_args
from tests.e2e.helpers import admin_get, chat, metric_sum

SYSTEM = {"role": "system", "content": " ".join(f"rule{i}" for i in range(200))}


def worker_id(url: str) -> str:
    return url.split("://", 1)[1]


def test_openai_client_streams_chat_through_the_router(
    sim4: SimCluster, start_router: StartRouter
) -> None:
    router = start_router(*workers_args(sim4.urls[:2]), "--policy", "colocate")
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused")
    stream = client.chat.completions.create(
        model="llama-3.1-8b",
        messages=[{"role": "user", "content": "hello there router"}],
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
    assert len(text.split()) == 10
    assert usage is not None and usage.completion_tokens == 10
    assert [m.id for m in client.models.list().data] == ["llama-3.1-8b"]
    client.close()


async def test_colocate_keeps_a_session_on_its_worker_with_cache_hits(
    sim4: SimCluster, start_router: StartRouter
) -> None:
    router = start_router(*workers_args(sim4.urls[:2]), "--policy", "colocate")
    session_id = f"s-{uuid.uuid4().hex}"
    messages = [SYSTEM, {"role": "user", "content": "first question " * 20}]
    async with aiohttp.ClientSession() as http:
        answer, usage1, _ = await chat(http, router.url, messages, session_id=session_id)
        status, record = await admin_get(http, router.url, router.admin_token,
                                         f"/admin/sessions/{session_id}")  # fmt: skip
        assert status == 200
        owner = record["worker_id"]
        assert record["tokens"] == usage1["prompt_tokens"] + usage1["completion_tokens"]
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": "second question " * 10}]  # fmt: skip
        _, usage2, _ = await chat(http, router.url, messages, session_id=session_id)
        assert usage2["prompt_tokens_details"]["cached_tokens"] >= usage1["prompt_tokens"] - 16
        _, record2 = await admin_get(http, router.url, router.admin_token,
                                     f"/admin/sessions/{session_id}")  # fmt: skip
        assert record2["worker_id"] == owner
        assert record2["turns"] == 2


async def test_disaggregate_prefills_remotely_and_decode_worker_pulls(
    sim4: SimCluster, start_router: StartRouter
) -> None:
    prefill, decode = sim4.urls[2], sim4.urls[3]
    router = start_router("--prefill", prefill, "--decode", decode, "--policy", "disaggregate")
    prompt_words = 800
    messages = [{"role": "user", "content": " ".join(f"pd{i}" for i in range(prompt_words))}]
    by_source = "vllm:prompt_tokens_by_source_total"
    async with aiohttp.ClientSession() as http:
        before_p = await metric_sum(http, prefill, "vllm:generation_tokens_total")
        before_d = await metric_sum(http, decode, "vllm:generation_tokens_total")
        pulled = await metric_sum(http, decode, by_source, "external_kv_transfer")
        computed = await metric_sum(http, decode, by_source, "local_compute")
        answer, usage, _ = await chat(http, router.url, messages, max_tokens=6)
        after_p = await metric_sum(http, prefill, "vllm:generation_tokens_total")
        after_d = await metric_sum(http, decode, "vllm:generation_tokens_total")
        pulled = await metric_sum(http, decode, by_source, "external_kv_transfer") - pulled
        computed = await metric_sum(http, decode, by_source, "local_compute") - computed
        _status, decisions = await admin_get(http, router.url, router.admin_token,
                                            "/admin/decisions?limit=1")  # fmt: skip
    assert len(answer.split()) == 6 and usage["completion_tokens"] == 6
    assert after_p - before_p == 1  # the prefill leg: one token, then the KV is held
    assert after_d - before_d == 6
    # the decode worker pulled the whole prompt's KV: as vLLM 0.32, the answer counts no
    # transferred token as cached, the worker's metrics count them by source
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert (pulled, computed) == (usage["prompt_tokens"], 0)
    event = decisions["decisions"][0]
    assert event["action"] == "handoff"
    assert event["prefill_worker"] == worker_id(prefill)
    assert event["decode_worker"] == worker_id(decode)
    # the router's own count: the prompt's tokens at 128 KiB a token (NIXL moves whole
    # blocks, which only the decode worker's metrics count)
    assert event["transferred_bytes"] == usage["prompt_tokens"] * 131072
    assert event["transfer_end"] > event["transfer_start"]


async def test_a_handoff_records_what_its_prefill_leg_found_cached(
    sim4: SimCluster, start_router: StartRouter
) -> None:
    """The prefill worker's reply says how much of the prompt it had cached: nothing the first
    time, all but the last partial block when another session sends the same prompt."""
    prefill, decode = sim4.urls[2], sim4.urls[3]
    router = start_router("--prefill", prefill, "--decode", decode, "--policy", "disaggregate")
    messages = [{"role": "user", "content": " ".join(f"pc{i}" for i in range(600))}]
    async with aiohttp.ClientSession() as http:
        _, first, _ = await chat(http, router.url, messages, max_tokens=3, session_id="pc-a")
        _, second, _ = await chat(http, router.url, messages, max_tokens=3, session_id="pc-b")
        _status, decisions = await admin_get(http, router.url, router.admin_token,
                                            "/admin/decisions?limit=2")  # fmt: skip
    prompt = first["prompt_tokens"]
    assert second["prompt_tokens"] == prompt
    found = {e["session_id"]: e["prefill_cached_tokens"] for e in decisions["decisions"]}
    assert found == {"pc-a": 0, "pc-b": prompt // 16 * 16}


async def test_scripted_migration_moves_the_session_and_the_next_turn_hits_the_cache(
    sim4: SimCluster, start_router: StartRouter
) -> None:
    router = start_router(
        *workers_args(sim4.urls[:2]),
        "--policy", "tests.e2e.scripted_policies:MigrateOnSecondTurn",
    )  # fmt: skip
    session_id = f"m-{uuid.uuid4().hex}"
    messages = [SYSTEM, {"role": "user", "content": "turn one " * 30}]
    async with aiohttp.ClientSession() as http:
        answer, _, _ = await chat(http, router.url, messages, session_id=session_id)
        _, first = await admin_get(http, router.url, router.admin_token,
                                   f"/admin/sessions/{session_id}")  # fmt: skip
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": "turn two " * 30}]  # fmt: skip
        answer, _, _ = await chat(http, router.url, messages, session_id=session_id)
        _, second = await admin_get(http, router.url, router.admin_token,
                                    f"/admin/sessions/{session_id}")  # fmt: skip
        assert second["worker_id"] != first["worker_id"]
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": "turn three"}]  # fmt: skip
        _, usage3, _ = await chat(http, router.url, messages, session_id=session_id)
        _, third = await admin_get(http, router.url, router.admin_token,
                                   f"/admin/sessions/{session_id}")  # fmt: skip
        _, decisions = await admin_get(http, router.url, router.admin_token,
                                       "/admin/decisions?limit=3")  # fmt: skip
    assert third["worker_id"] == second["worker_id"]
    # everything up to the second answer is cached on the new worker
    assert usage3["prompt_tokens_details"]["cached_tokens"] >= second["tokens"] - 16
    actions = [event["action"] for event in reversed(decisions["decisions"])]
    assert actions == ["colocate", "migrate", "colocate"]


async def test_two_router_replicas_share_session_owners(
    sim4: SimCluster, start_router: StartRouter
) -> None:
    args = [*workers_args(sim4.urls[:2]), "--policy", "colocate"]
    first = start_router(*args)
    second = start_router(*args, prefix=first.prefix)
    session_id = f"r-{uuid.uuid4().hex}"
    messages = [SYSTEM, {"role": "user", "content": "replicas " * 20}]
    async with aiohttp.ClientSession() as http:
        answer, _, _ = await chat(http, first.url, messages, session_id=session_id)
        _, on_first = await admin_get(http, first.url, first.admin_token,
                                      f"/admin/sessions/{session_id}")  # fmt: skip
        for _ in range(50):
            status, on_second = await admin_get(http, second.url, second.admin_token,
                                                f"/admin/sessions/{session_id}")  # fmt: skip
            if status == 200:
                break
            await asyncio.sleep(0.02)
        assert on_second["worker_id"] == on_first["worker_id"]
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": "again"}]  # fmt: skip
        _, usage, _ = await chat(http, second.url, messages, session_id=session_id)
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0
        # the second replica's commit reaches the first one's local view by invalidation
        for _ in range(100):
            _, after = await admin_get(http, first.url, first.admin_token,
                                       f"/admin/sessions/{session_id}")  # fmt: skip
            if after["epoch"] == 2:
                break
            await asyncio.sleep(0.01)
        assert after["worker_id"] == on_first["worker_id"] and after["epoch"] == 2
        assert after["turns"] == 2


async def test_replicas_see_each_others_in_flight_counts_and_link_reservations(
    start_router: StartRouter,
) -> None:
    slow = start_sim_cluster(2, "--nic-gbps", "1")  # 1 Gb/s: an 800-token pull takes ~0.8 s
    prefill, decode = slow.urls
    args = ["--prefill", prefill, "--decode", decode, "--policy", "disaggregate"]
    first = start_router(*args)
    second = start_router(*args, prefix=first.prefix)
    messages = [{"role": "user", "content": " ".join(f"w{i}" for i in range(800))}]
    link = f'src="{worker_id(prefill)}"'
    try:
        async with aiohttp.ClientSession() as http:
            turn = asyncio.ensure_future(chat(http, first.url, messages, max_tokens=4))
            reserved = inflight = 0.0
            for _ in range(100):
                await asyncio.sleep(0.02)
                reserved = await metric_sum(
                    http, second.url, "session_router_link_reserved_bytes", link
                )
                _, rows = await admin_get(http, second.url, second.admin_token, "/admin/workers")
                inflight = max(row["fleet_inflight"] for row in rows["workers"])
                if reserved > 0 and inflight > 0:
                    break
            _, usage, response = await turn
    finally:
        slow.process.stop()
    assert response.status == 200 and usage["completion_tokens"] == 4
    assert reserved >= 800 * 131072  # the first replica's handoff, seen by the second
    assert inflight >= 1


async def test_a_handoff_gives_its_link_reservation_back_at_the_first_token(
    start_router: StartRouter,
) -> None:
    # The KV has arrived when the decode leg's first token does: from then on the handoff's
    # bytes load the link no more, however long its answer streams.
    cluster = start_sim_cluster(2)
    prefill, decode = cluster.urls
    router = start_router("--prefill", prefill, "--decode", decode, "--policy", "disaggregate")
    messages = [{"role": "user", "content": " ".join(f"w{i}" for i in range(800))}]
    body = {"messages": messages, "max_tokens": 300, "stream": True}
    link = f'src="{worker_id(prefill)}"'
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(router.url + "/v1/chat/completions", json=body) as response:
                async for line in response.content:
                    if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0][
                        "delta"
                    ].get("content"):
                        break  # the first token
                reserved = await metric_sum(
                    http, router.url, "session_router_link_reserved_bytes", link
                )
                streaming = await metric_sum(http, router.url, "session_router_inflight_requests")
                rest = [line async for line in response.content if line.startswith(b"data: ")]
            transferred = await metric_sum(http, router.url, "session_router_transfer_bytes_total")
    finally:
        cluster.process.stop()
    assert streaming == 1.0  # the answer was still streaming
    assert reserved == 0.0
    assert rest[-1].strip() == b"data: [DONE]"
    assert transferred >= 800 * 131072  # the pull is still accounted for


async def test_completions_endpoint_streams_and_answers_through_the_router(
    sim4: SimCluster, start_router: StartRouter
) -> None:
    router = start_router(*workers_args(sim4.urls[:1]))
    body = {"prompt": "once upon a time", "max_tokens": 5}
    async with aiohttp.ClientSession() as http:
        async with http.post(router.url + "/v1/completions", json=body) as response:
            whole = await response.json()
        async with http.post(router.url + "/v1/completions",
                             json={**body, "stream": True}) as response:  # fmt: skip
            frames = [line async for line in response.content if line.startswith(b"data: ")]
    assert whole["object"] == "text_completion" and len(whole["choices"][0]["text"].split()) == 5
    assert whole["usage"]["prompt_tokens"] == 4
    assert frames[-1].strip() == b"data: [DONE]"
    assert sum(b'"text":' in frame for frame in frames) == 5


@pytest.mark.parametrize(
    ("roles", "policy"),
    [((0, 0), "colocate"), ((1, 1), "disaggregate")],  # one mixed worker; a handoff to decode
)
async def test_a_streaming_turn_counts_as_answering_until_the_next_scrape(
    sim4: SimCluster, start_router: StartRouter, roles: tuple[int, int], policy: str
) -> None:
    # The scrape before the turn saw idle workers; once its first token is out (a handoff's
    # decode leg: once sent, it brings its KV) the turn queues no prefill where it answers,
    # which the policy's view says until a scrape shows it running there.
    urls = sim4.urls[: max(1, sum(roles))]
    router = start_router(*workers_args(urls, *roles), "--policy", policy,
                          "--scrape-interval-ms", "600000")  # fmt: skip
    body = {"prompt": "once upon a time", "max_tokens": 400, "stream": True}

    async def rows(http: aiohttp.ClientSession) -> list[tuple[object, object]]:
        _, listed = await admin_get(http, router.url, router.admin_token, "/admin/workers")
        return [(row["inflight"], row["started_since_scrape"]) for row in listed["workers"]]

    async with aiohttp.ClientSession() as http:
        before = await rows(http)
        async with http.post(router.url + "/v1/completions", json=body) as response:
            await response.content.readline()  # the first token is out
            during = await rows(http)
            frames = [line async for line in response.content if line.startswith(b"data: ")]
        after = await rows(http)
    assert frames[-1].strip() == b"data: [DONE]"
    idle = [(0, 0)] * len(urls)
    assert before == idle and after == idle
    assert during == [*idle[:-1], (1, 1)]  # the prefill leg is done; the answer is on the last


async def test_router_inflight_counts_a_turn_while_it_streams(
    sim4: SimCluster, start_router: StartRouter
) -> None:
    router = start_router(*workers_args(sim4.urls[:1]))
    body = {"prompt": "once upon a time", "max_tokens": 400, "stream": True}
    inflight = "session_router_inflight_requests"
    async with aiohttp.ClientSession() as http:
        assert await metric_sum(http, router.url, inflight) == 0.0
        async with http.post(router.url + "/v1/completions", json=body) as response:
            await response.content.readline()  # the stream has started
            during = await metric_sum(http, router.url, inflight)
            frames = [line async for line in response.content if line.startswith(b"data: ")]
        after = await metric_sum(http, router.url, inflight)
    assert frames[-1].strip() == b"data: [DONE]"
    assert during == 1.0
    assert after == 0.0


async def test_turns_reach_priority_scheduling_workers_with_their_due_times(
    sim4: SimCluster, start_router: StartRouter
) -> None:
    """Workers started with `--scheduling-policy priority` take the due times: adaptive's whole
    turns and a handoff's two legs; a worker without it ignores them (vLLM 0.32), one following
    an older vLLM refuses them with its 400, which the client gets as the worker said it: the
    flag must match how the engines were started."""
    cluster = start_sim_cluster(2, "--scheduling-policy", "priority")
    prefill, decode = cluster.urls
    handoff = ["--policy", "tests.e2e.scripted_policies:AlwaysHandoff", "--policy-param",
               f"prefill={prefill.split('://')[1]}", "--policy-param",
               f"decode={decode.split('://')[1]}", "--policy-param", "due_ms=500"]  # fmt: skip
    try:
        for policy in (["--policy", "adaptive"], handoff):
            router = start_router("--prefill", prefill, "--decode", decode, *policy,
                                  "--priority-scheduling")  # fmt: skip
            async with aiohttp.ClientSession() as http:
                for i, words in enumerate((20, 3000)):
                    content = " ".join(f"d{i}w{j}" for j in range(words))
                    text, usage, response = await chat(http, router.url,
                                                       [{"role": "user", "content": content}],
                                                       max_tokens=4)  # fmt: skip
                    assert response.status == 200, usage
                    assert usage["completion_tokens"] == 4 and text
                _, decisions = await admin_get(http, router.url, router.admin_token,
                                               "/admin/decisions?limit=2")  # fmt: skip
            assert {e["outcome"] for e in decisions["decisions"]} == {"completed"}
        assert {e["action"] for e in decisions["decisions"]} == {"handoff"}
    finally:
        cluster.process.stop()
    mismatched = start_router("--mixed", sim4.urls[0], "--policy", "adaptive",
                              "--priority-scheduling")  # fmt: skip
    async with aiohttp.ClientSession() as http:
        _, usage, response = await chat(http, mismatched.url, [{"role": "user", "content": "hi"}])
    assert response.status == 200 and usage["completion_tokens"] > 0
    older = start_sim_cluster(1, "--vllm-version", "legacy")
    try:
        mismatched = start_router("--mixed", older.urls[0], "--policy", "adaptive",
                                  "--priority-scheduling")  # fmt: skip
        async with aiohttp.ClientSession() as http:
            _, refused, response = await chat(http, mismatched.url,
                                              [{"role": "user", "content": "hi"}])  # fmt: skip
    finally:
        older.process.stop()
    assert response.status == 400
    assert "Priority scheduling is not enabled" in refused["error"]["error"]["message"]
