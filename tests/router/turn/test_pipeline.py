"""The turn pipeline, executor and legs in process: the router's app object on an ephemeral
port in front of fake vLLM workers, driven by scripted policies; every turn's wire traffic,
answer, stage events, metrics and committed residency are checked."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis

from tests.conftest import free_port
from tests.router.turn.fake_upstream import (
    WAIT_S,
    FakeWorker,
    RouterUnderTest,
    Stack,
    eventually,
    spec,
)

HANDOFF = "tests.e2e.scripted_policies:AlwaysHandoff"
MIGRATE = "tests.e2e.scripted_policies:MigrateOnSecondTurn"
REJECT = "tests.router.turn.fake_upstream:RejectAll"
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


@pytest.fixture
async def stack(redis_url: str) -> AsyncIterator[Stack]:
    async with Stack(redis_url) as stack:
        yield stack


def chat_body(text: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 5,
            **extra}  # fmt: skip


async def post(
    stack: Stack, router: RouterUnderTest, body: dict[str, Any], session: str | None = None,
    path: str = "/v1/chat/completions",
) -> tuple[int, dict[str, str], Any]:  # fmt: skip
    """A whole turn: (status, headers, decoded JSON body)."""
    sent = {"X-Session-ID": session} if session else {}
    async with stack.http.post(router.url + path, json=body, headers=sent) as response:
        headers = {key.lower(): value for key, value in response.headers.items()}
        return response.status, headers, await response.json()


async def stream(
    stack: Stack, router: RouterUnderTest, body: dict[str, Any], session: str | None = None,
    path: str = "/v1/chat/completions",
) -> tuple[int, list[bytes]]:  # fmt: skip
    """A streamed turn: (status, its non-empty lines)."""
    headers = {"X-Session-ID": session} if session else {}
    async with stack.http.post(
        router.url + path, json={**body, "stream": True}, headers=headers
    ) as response:
        lines = [line.strip() async for line in response.content if line.strip()]
        return response.status, lines


def text_of(lines: list[bytes]) -> str:
    """The answer text a stream's chunks carry."""
    parts = []
    for line in lines:
        if line.startswith(b"data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                parts.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
    return "".join(parts)


def new_session() -> str:
    return f"s-{uuid.uuid4().hex}"


async def test_colocated_turn_relays_the_body_returns_usage_and_commits_residency(
    stack: Stack, redis_url: str
) -> None:
    a = await stack.worker("a", cached=2)
    b = await stack.worker("b")
    router = await stack.router([spec(a), spec(b)], scrape_interval_ms=50)
    session = new_session()
    body = chat_body(temperature=0.3, seed=7, top_p=0.9)
    status, headers, reply = await post(stack, router, body, session)
    assert status == 200, reply
    assert headers["x-session-id"] == session and headers["x-request-id"]
    assert reply["choices"][0]["message"]["content"] == " a0 a1 a2"
    assert reply["usage"] == {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15,
                              "prompt_tokens_details": {"cached_tokens": 2}}  # fmt: skip
    # a whole turn goes to the worker exactly as the client wrote it
    assert a.bodies() == [body] and b.received == []
    assert a.received[0].headers["x-request-id"] == headers["x-request-id"]
    (event,) = await router.decisions(stack.http)
    assert event["action"] == "colocate" and event["decode_worker"] == "a"
    assert event["outcome"] == "completed" and event["prompt_tokens"] == 12
    assert event["cached_tokens"] == 2 and event["completion_tokens"] == 3

    # the residency the worker's usage gives reaches Redis
    client = aioredis.Redis.from_url(redis_url)
    key = f"{router.router.config.redis_prefix}:session:{session}"
    try:

        async def committed() -> bool:
            fields = await client.hgetall(key)
            return fields.get(b"owner") == b"a" and fields.get(b"tokens") == b"15"

        await eventually(committed)
    finally:
        await client.aclose()

    # `a` now looks busier than `b`: the session's next turn still goes back to it ...
    a.running = 10
    load = router.router.pool.workers["a"]

    async def scraped() -> bool:
        return load.load is not None and load.load.running == 10

    await eventually(scraped)
    follow = chat_body("again", stream_options={"include_usage": True})
    status, lines = await stream(stack, router, follow, session)
    assert status == 200 and text_of(lines) == " a0 a1 a2"
    assert lines[-1] == b"data: [DONE]"
    assert b'"usage"' in lines[-2]  # asked for, so forwarded
    assert len(a.received) == 2 and b.received == []
    assert a.received[1].body == {**follow, "stream": True}

    async def two_turns() -> bool:
        found, record = await router.session(stack.http, session)
        return found == 200 and record["turns"] == 2

    await eventually(two_turns)
    # ... while a new session, with no residency, goes to the less loaded `b`
    status, _, reply = await post(stack, router, chat_body("other"), new_session())
    assert status == 200 and reply["choices"][0]["message"]["content"] == " b0 b1 b2"


async def test_completions_stream_through_the_openai_client(stack: Stack) -> None:
    a = await stack.worker("a")
    router = await stack.router([spec(a)])
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused",
                                  max_retries=0, timeout=2 * WAIT_S) as client:  # fmt: skip
        chunks = await client.completions.create(
            model="m", prompt="Once upon a time", max_tokens=3, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        got = [chunk async for chunk in chunks]
        quiet = await client.completions.create(model="m", prompt="x", max_tokens=2, stream=True)
        unasked = [chunk async for chunk in quiet]
        whole = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert "".join(c.choices[0].text for c in got if c.choices) == " a0 a1 a2"
    assert got[-1].usage is not None and got[-1].usage.completion_tokens == 3
    # the router always asks the worker for usage, and drops it again when the client did not
    assert a.received[1].path == "/v1/completions"
    assert a.received[1].body["stream_options"] == {"include_usage": True}
    assert all(chunk.usage is None for chunk in unasked)
    assert "".join(c.choices[0].text for c in unasked) == " a0 a1"
    assert whole.choices[0].message.content == " a0 a1"
    assert whole.usage is not None and whole.usage.prompt_tokens == 12


@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "whole"])
async def test_handoff_sends_a_prefill_leg_then_a_decode_leg_with_its_transfer_params(
    stack: Stack, streamed: bool
) -> None:
    p = await stack.worker("p", cached=4)
    d = await stack.worker("d")
    router = await stack.router([spec(p, "prefill"), spec(d, "decode")], HANDOFF,
                                params={"prefill": "p", "decode": "d"})  # fmt: skip
    session = new_session()
    body = chat_body(temperature=0.0, min_tokens=2)
    if streamed:
        status, lines = await stream(stack, router, body, session)
        assert status == 200
        answer = text_of(lines)
        # one answer: the decode leg's, once, without the usage the client did not ask for
        assert lines.count(b"data: [DONE]") == 1 and lines[-1] == b"data: [DONE]"
        assert not any(b'"usage"' in line or b'"error"' in line for line in lines)
        assert sum(b'"role"' in line for line in lines) == 1
        body = {**body, "stream": True}
    else:
        status, _, reply = await post(stack, router, body, session)
        assert status == 200
        answer = reply["choices"][0]["message"]["content"]
        assert reply["usage"]["completion_tokens"] == 3
    assert answer == " d0 d1 d2"
    (prefill_leg,) = p.bodies()
    # NixlConnector's prefill leg: not streamed, one token, asking the worker to keep the KV
    expected = {k: v for k, v in body.items() if k not in ("min_tokens", "stream_options")}
    assert prefill_leg == {**expected, "stream": False, "max_tokens": 1,
                           "kv_transfer_params": PREFILL_PARAMS}  # fmt: skip
    (decode_leg,) = d.bodies()
    (params,) = p.sent_params
    wanted = {**body, "kv_transfer_params": params}
    if streamed:
        wanted["stream_options"] = {"include_usage": True}
    assert decode_leg == wanted
    (event,) = await router.decisions(stack.http)
    assert event["action"] == "handoff" and event["outcome"] == "completed"
    assert event["prefill_worker"] == "p" and event["decode_worker"] == "d"
    assert event["prefill_cached_tokens"] == 4 and event["recomputed_tokens"] == 0
    assert event["transferred_bytes"] > 0 and event["transfer_start"] is not None

    async def resident_on_decode() -> bool:
        found, record = await router.session(stack.http, session)
        return found == 200 and record["worker_id"] == "d"

    await eventually(resident_on_decode)


@pytest.mark.parametrize(
    "spaced",
    [False, True],
    ids=["compact-json", "spaced-json"],
)  # fmt: skip
async def test_first_token_from_the_prefill_leg_is_sent_once(stack: Stack, spaced: bool) -> None:
    p = await stack.worker("p")
    d = await stack.worker("d", spaced_json=spaced)
    router = await stack.router([spec(p, "prefill"), spec(d, "decode")], HANDOFF,
                                params={"prefill": "p", "decode": "d"},
                                first_token="prefill")  # fmt: skip
    status, lines = await stream(stack, router, chat_body())
    assert status == 200
    # the prefill leg's token first, then the decode leg's answer less its own first token
    assert text_of(lines) == " p0 d1 d2"
    assert sum(b'"role"' in line for line in lines) == 1
    assert lines[-1] == b"data: [DONE]"
    (event,) = await router.decisions(stack.http)
    assert event["first_token_convention"] == "prefill" and event["outcome"] == "completed"


async def test_failed_prefill_leg_leaves_the_decode_worker_to_prefill_itself(
    stack: Stack,
) -> None:
    p = await stack.worker("p")
    d = await stack.worker("d")
    p.fail_next("status", status=500)
    router = await stack.router([spec(p, "prefill"), spec(d, "decode")], HANDOFF,
                                params={"prefill": "p", "decode": "d"})  # fmt: skip
    body = chat_body()
    status, _, reply = await post(stack, router, body)
    assert status == 200 and reply["choices"][0]["message"]["content"] == " d0 d1 d2"
    assert len(p.received) == 1
    assert d.bodies() == [body]  # a plain request: no KV to pull
    (event,) = await router.decisions(stack.http)
    assert event["recomputed_tokens"] == event["estimated_prompt_tokens"] > 0
    assert event["transferred_bytes"] == 0
    assert (
        await router.metric(stack.http, "session_router_upstream_errors_total", 'kind="http_500"')
        == 1
    )


@pytest.mark.parametrize(("nic_gbps", "refused"), [(1e-6, True), (400.0, False)],
                         ids=["link-refuses", "link-admits"])  # fmt: skip
async def test_migration_the_link_ledger_refuses_runs_whole_on_its_source(
    stack: Stack, redis_url: str, nic_gbps: float, refused: bool
) -> None:
    a = await stack.worker("a")
    b = await stack.worker("b")
    # the link a->b carries nic_gbps: too little for any session's KV within a lease, or plenty
    router = await stack.router([spec(a, nic_gbps=nic_gbps), spec(b, nic_gbps=nic_gbps)],
                                MIGRATE)  # fmt: skip
    client = aioredis.Redis.from_url(redis_url)
    link = f"{router.router.config.redis_prefix}:link:1.a>b"
    try:

        async def capacity_known() -> bool:
            return await client.hget(link, "capacity_bps") is not None

        await eventually(capacity_known)
    finally:
        await client.aclose()
    session = new_session()
    status, _, _ = await post(stack, router, chat_body(), session)  # first turn: on `a`
    assert status == 200 and len(a.received) == 1
    body = chat_body("next")
    status, _, reply = await post(stack, router, body, session)  # second: migrate a -> b
    assert status == 200
    (event,) = await router.decisions(stack.http)
    assert event["reason"] == "scripted migration" and event["outcome"] == "completed"
    if refused:
        assert reply["choices"][0]["message"]["content"] == " a0 a1 a2"
        assert event["action"] == "colocate" and event["decode_worker"] == "a"
        assert a.received[1].body == body and b.received == []
        owner = "a"
    else:
        assert reply["choices"][0]["message"]["content"] == " b0 b1 b2"
        assert event["action"] == "migrate" and event["decode_worker"] == "b"
        assert a.received[1].is_prefill_leg
        assert b.bodies() == [{**body, "kv_transfer_params": a.sent_params[0]}]
        owner = "b"

    async def resident() -> bool:
        found, record = await router.session(stack.http, session)
        return found == 200 and record["worker_id"] == owner and record["turns"] == 2

    await eventually(resident)


@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "whole"])
async def test_rejected_turn_is_a_429_with_an_openai_error(stack: Stack, streamed: bool) -> None:
    a = await stack.worker("a")
    router = await stack.router([spec(a)], REJECT)
    async with stack.http.post(
        router.url + "/v1/chat/completions", json=chat_body(stream=streamed)
    ) as response:
        status, headers, error = response.status, response.headers, await response.json()
    assert status == 429 and headers["Retry-After"] == "3"
    assert headers["Content-Type"].startswith("application/json")
    assert error == {"error": {"message": "turn rejected: scripted overload",
                               "type": "rate_limit_error", "param": None, "code": 429}}  # fmt: skip
    assert a.received == []
    assert (
        await router.metric(stack.http, "session_router_rejected_requests_total", 'reason="policy"')
        == 1
    )
    (event,) = await router.decisions(stack.http)
    assert event["action"] == "reject" and event["outcome"] == "rejected"
    assert event["http_status"] == 429
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused",
                                  max_retries=0, timeout=2 * WAIT_S) as client:  # fmt: skip
        with pytest.raises(openai.RateLimitError) as caught:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], stream=streamed
            )
    assert caught.value.status_code == 429 and caught.value.type == "rate_limit_error"
    assert caught.value.body == error["error"]  # the SDK read the OpenAI error object


async def test_decode_worker_refusing_connections_after_a_good_prefill_is_recomputed_elsewhere(
    stack: Stack,
) -> None:
    p = await stack.worker("p")
    e = await stack.worker("e")
    dead = FakeWorker("dead", port=free_port())  # never started: connections are refused
    router = await stack.router(
        [spec(p, "prefill"), spec(dead, "decode"), spec(e, "decode")], HANDOFF,
        params={"prefill": "p", "decode": "dead"},
    )  # fmt: skip
    session = new_session()
    status, lines = await stream(stack, router, chat_body(), session)
    assert status == 200 and text_of(lines) == " e0 e1 e2"
    assert lines[-1] == b"data: [DONE]" and not any(b'"error"' in line for line in lines)
    assert p.received[0].is_prefill_leg
    # the whole turn again, as the client sent it (usage requested), no KV to pull
    assert e.bodies() == [{**chat_body(), "stream": True,
                           "stream_options": {"include_usage": True}}]  # fmt: skip
    (event,) = await router.decisions(stack.http)
    assert event["retried"] is True and event["decode_worker"] == "e"
    assert event["recomputed_tokens"] == event["estimated_prompt_tokens"] > 0
    assert event["outcome"] == "completed"
    recomputed = await router.metric(stack.http, "session_router_recomputed_tokens_total")
    assert recomputed == event["recomputed_tokens"]
    errors = 'kind="connect",worker="dead"'
    assert await router.metric(stack.http, "session_router_upstream_errors_total", errors) == 1

    async def resident_on_e() -> bool:
        found, record = await router.session(stack.http, session)
        return found == 200 and record["worker_id"] == "e"

    await eventually(resident_on_e)


async def test_worker_dropping_the_connection_before_answering_is_retried_on_another(
    stack: Stack,
) -> None:
    a = await stack.worker("a")
    b = await stack.worker("b")
    a.fail_always("drop")
    # no scrape heals `a` during the test: the retry sees it marked unhealthy
    router = await stack.router([spec(a), spec(b)], scrape_interval_ms=60_000)

    async def scraped_twice() -> bool:  # at start, and the schedule's first tick: no more
        return a.scrapes >= 2 and b.scrapes >= 2

    await eventually(scraped_twice)
    session = new_session()
    status, _, reply = await post(stack, router, chat_body(), session)  # a new session: `a` first
    assert status == 200 and reply["choices"][0]["message"]["content"] == " b0 b1 b2"
    assert len(a.received) >= 1 and len(b.received) == 1
    (event,) = await router.decisions(stack.http)
    assert event["retried"] is True and event["decode_worker"] == "b"
    assert await router.metric(stack.http, "session_router_retries_total", 'reason="connect"') == 1
    assert await router.metric(stack.http, "session_router_worker_healthy", 'worker="a"') == 0


@pytest.mark.parametrize("code", [400, 503])
async def test_worker_error_status_is_forwarded_and_commits_nothing(
    stack: Stack, code: int
) -> None:
    a = await stack.worker("a")
    a.fail_next("status", status=code)
    router = await stack.router([spec(a)])
    session = new_session()
    status, _, reply = await post(stack, router, chat_body(), session)
    assert status == code
    assert reply["error"]["code"] == code and reply["error"]["message"] == "scripted failure"
    (event,) = await router.decisions(stack.http)
    assert event["outcome"] == "error" and event["http_status"] == code
    found, _ = await router.session(stack.http, session)
    assert found == 404
    server_errors = await router.metric(
        stack.http, "session_router_upstream_errors_total", "http_5"
    )
    assert server_errors == (1 if code >= 500 else 0)


async def test_stream_cut_mid_way_ends_with_an_error_event_and_done(stack: Stack) -> None:
    a = await stack.worker("a")
    router = await stack.router([spec(a)])
    session = new_session()
    status, _, _ = await post(stack, router, chat_body(), session)  # a residency to clear
    assert status == 200
    a.fail_next("cut", after_frames=2)
    status, lines = await stream(stack, router, chat_body("more"), session)
    assert status == 200
    assert text_of(lines) == " a0 a1"  # what the worker sent before it went away
    assert lines[-1] == b"data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["code"] == 502 and error["type"] == "upstream_error" and error["message"]
    assert lines.count(b"data: [DONE]") == 1
    (event,) = await router.decisions(stack.http)
    assert event["outcome"] == "error" and event["error"]
    errors = await router.metric(
        stack.http, "session_router_upstream_errors_total", 'kind="midstream"'
    )
    assert errors == 1

    async def cleared() -> bool:  # the worker's KV for the session is no longer trusted
        found, _ = await router.session(stack.http, session)
        return found == 404

    await eventually(cleared)


async def test_client_disconnecting_mid_stream_cancels_the_upstream_request(
    stack: Stack,
) -> None:
    a = await stack.worker("a")
    a.fail_next("slow")  # streams until its caller goes away
    router = await stack.router([spec(a)])
    body = {**chat_body(), "stream": True}
    async with stack.http.post(router.url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200
        async for line in response.content:
            if b'"content":" s' in line.replace(b": ", b":"):
                break
        response.close()
    await a.wait_closed_early()  # raises TimeoutError if the router kept the request open
    assert a.closed_early == 1

    async def counted() -> bool:
        return await router.metric(stack.http, "session_router_client_disconnects_total") == 1

    await eventually(counted)
    (event,) = await router.decisions(stack.http)
    assert event["outcome"] == "cancelled"
    assert await router.metric(stack.http, "session_router_inflight_requests", 'worker="a"') == 0
    # and the router goes on serving
    status, _, reply = await post(stack, router, chat_body())
    assert status == 200 and reply["choices"][0]["message"]["content"] == " a0 a1 a2"


async def test_client_leaving_once_its_stream_ended_leaves_the_turn_completed(
    stack: Stack,
) -> None:
    # The worker's stream closes a while after its [DONE]; the client has its whole answer at
    # the [DONE] and goes: the router reads the worker's stream to its close all the same.
    a = await stack.worker("a")
    a.fail_next("linger", linger_s=0.5)
    router = await stack.router([spec(a)])
    body = {**chat_body(), "stream": True}
    async with aiohttp.ClientSession() as client:  # its own connection, closed at once
        async with client.post(router.url + "/v1/chat/completions", json=body) as response:
            lines = [line.strip() async for line in response.content if line.strip()]
    assert lines[-1] == b"data: [DONE]" and text_of(lines) == " a0 a1 a2"

    async def settled() -> bool:
        return len(await router.decisions(stack.http)) == 1

    await eventually(settled)
    (event,) = await router.decisions(stack.http)
    assert event["outcome"] == "completed" and event["error"] is None
    assert await router.metric(stack.http, "session_router_client_disconnects_total") == 0
    assert a.closed_early == 0  # the worker's stream was read to its close


async def test_client_giving_up_on_a_whole_turn_cancels_the_upstream_request(
    stack: Stack,
) -> None:
    a = await stack.worker("a")
    a.fail_next("stall")  # never answers
    router = await stack.router([spec(a)])
    turn = asyncio.ensure_future(post(stack, router, chat_body()))
    try:
        await a.wait_request()
    finally:
        turn.cancel()  # the client goes away
    with pytest.raises(asyncio.CancelledError):
        await turn
    await a.wait_closed_early()  # raises TimeoutError if the router kept the request open

    async def counted() -> bool:
        return await router.metric(stack.http, "session_router_client_disconnects_total") == 1

    await eventually(counted)
    (event,) = await router.decisions(stack.http)
    assert event["outcome"] == "cancelled" and event["decode_worker"] == "a"


async def test_stalled_worker_times_out_after_request_timeout(stack: Stack) -> None:
    a = await stack.worker("a")
    a.fail_next("stall")
    router = await stack.router([spec(a)], request_timeout_s=0.5)
    status: int | None = None
    try:
        async with asyncio.timeout(3 * WAIT_S / 5):
            status, _, _ = await post(stack, router, chat_body())
    except TimeoutError:
        pass
    assert status == 504
