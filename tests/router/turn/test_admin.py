"""The operator endpoints (router/admin.py) and the app's own endpoints, in process: the router's
app object on an ephemeral port in front of fake vLLM workers."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.router.turn.fake_upstream import RouterUnderTest, Stack, spec

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


@pytest.fixture
async def stack(redis_url: str) -> AsyncIterator[Stack]:
    async with Stack(redis_url) as stack:
        yield stack


async def call(
    stack: Stack, router: RouterUnderTest, method: str, path: str, token: str | None = "admin",
    **kwargs: Any,
) -> tuple[int, Any]:  # fmt: skip
    """(status, JSON body) of an admin call; token "admin" is the router's own."""
    headers = {}
    if token is not None:
        headers["Authorization"] = f"Bearer {router.admin_token if token == 'admin' else token}"
    async with stack.http.request(method, router.url + path, headers=headers, **kwargs) as r:
        return r.status, await r.json(content_type=None)


async def turn(stack: Stack, router: RouterUnderTest, session: str) -> str:
    """One whole turn of `session`; the worker that answered (its answer names it)."""
    async with stack.http.post(router.url + "/v1/chat/completions", json=CHAT,
                               headers={"X-Session-ID": session}) as response:  # fmt: skip
        assert response.status == 200
        reply = await response.json()
    return str(reply["choices"][0]["message"]["content"]).split()[0][:-1]


def assert_openai_error(body: Any, code: int) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code and body["error"]["message"]


async def test_admin_is_absent_without_a_token_and_refuses_a_wrong_one(stack: Stack) -> None:
    a = await stack.worker("a")
    plain = await stack.router([spec(a)], admin_token=None)
    status, body = await call(stack, plain, "GET", "/admin/workers", token="anything")
    assert status == 404
    assert_openai_error(body, 404)
    guarded = await stack.router([spec(a)])
    for token in (None, "wrong", guarded.admin_token + "x"):
        status, body = await call(stack, guarded, "GET", "/admin/workers", token=token)
        assert status == 401
        assert_openai_error(body, 401)
    status, _ = await call(stack, guarded, "GET", "/admin/workers")
    assert status == 200


async def test_workers_sessions_and_decisions(stack: Stack) -> None:
    a = await stack.worker("a", running=2, waiting=1, kv_usage=0.25)
    b = await stack.worker("b")
    router = await stack.router([spec(a), spec(b, "decode")])
    status, body = await call(stack, router, "GET", "/admin/workers")
    assert status == 200
    rows = {row["id"]: row for row in body["workers"]}
    assert set(rows) == {"a", "b"}
    assert rows["a"]["url"] == a.url and rows["a"]["role"] == "mixed"
    assert rows["b"]["role"] == "decode" and rows["b"]["engine"] == "vllm"
    assert rows["a"]["healthy"] is True and rows["a"]["draining"] is False
    assert rows["a"]["models"] == ["m"] and rows["a"]["inflight"] == 0
    load = rows["a"]["load"]
    assert (load["running"], load["waiting"], load["kv_usage"]) == (2, 1, 0.25)

    session = f"s-{uuid.uuid4().hex}"
    status, body = await call(stack, router, "GET", f"/admin/sessions/{session}")
    assert status == 404
    assert_openai_error(body, 404)
    served = await turn(stack, router, session)
    assert served == "b"  # `a` is busier
    status, record = await call(stack, router, "GET", f"/admin/sessions/{session}")
    assert status == 200
    assert record["session_id"] == session and record["worker_id"] == "b"
    assert record["tokens"] == 12 + 2 and record["turns"] == 1
    assert record["bytes"] == 14 * router.router.config.kv_bytes_per_token

    await turn(stack, router, session)
    status, body = await call(stack, router, "GET", "/admin/decisions?limit=5")
    assert status == 200
    events = body["decisions"]
    assert len(events) == 2  # newest first, all there is
    assert all(e["session_id"] == session and e["decode_worker"] == "b" for e in events)
    assert events[0]["admitted"] >= events[1]["admitted"]
    status, body = await call(stack, router, "GET", "/admin/decisions?limit=1")
    assert status == 200 and body["decisions"] == events[:1]
    for bad in ("0", "x"):
        status, body = await call(stack, router, "GET", f"/admin/decisions?limit={bad}")
        assert status == 400 and body["error"]["param"] == "limit"


async def test_draining_a_worker_steers_new_sessions_away_until_undrained(stack: Stack) -> None:
    a = await stack.worker("a")
    b = await stack.worker("b")
    router = await stack.router([spec(a), spec(b)])
    # an idle fleet: a new session goes to the first worker by id
    assert await turn(stack, router, f"s-{uuid.uuid4().hex}") == "a"
    status, body = await call(stack, router, "POST", "/admin/workers/a/drain")
    assert status == 200 and body == {"id": "a", "draining": True, "inflight": 0}
    _, workers = await call(stack, router, "GET", "/admin/workers")
    assert {row["id"]: row["draining"] for row in workers["workers"]} == {"a": True, "b": False}
    assert await turn(stack, router, f"s-{uuid.uuid4().hex}") == "b"
    status, body = await call(stack, router, "DELETE", "/admin/workers/a/drain")
    assert status == 200 and body["draining"] is False
    assert await turn(stack, router, f"s-{uuid.uuid4().hex}") == "a"
    status, body = await call(stack, router, "POST", "/admin/workers/nobody/drain")
    assert status == 404 and body["error"]["param"] == "worker_id"
    status, body = await call(stack, router, "GET", "/admin/workers/a/drain")
    assert status == 405
    assert_openai_error(body, 405)
    status, body = await call(stack, router, "GET", "/admin/nothing-here")
    assert status == 404


async def test_policy_is_read_and_swapped_at_run_time(stack: Stack) -> None:
    a = await stack.worker("a")
    b = await stack.worker("b")
    router = await stack.router([spec(a), spec(b)])
    session = f"s-{uuid.uuid4().hex}"
    assert [await turn(stack, router, session) for _ in range(2)] == ["a", "a"]  # colocate
    status, body = await call(stack, router, "GET", "/admin/policy")
    assert status == 200 and body == {"name": "colocate"}
    status, body = await call(stack, router, "PUT", "/admin/policy", json={"name": "round-robin"})
    assert status == 200 and body == {"name": "round-robin", "params": {}}
    _, body = await call(stack, router, "GET", "/admin/policy")
    assert body == {"name": "round-robin"}
    # round-robin ignores residency: the same session now alternates between the workers
    served = {await turn(stack, router, session) for _ in range(2)}
    assert served == {"a", "b"}
    status, body = await call(stack, router, "PUT", "/admin/policy",
                              json={"name": "threshold", "params": {"thresold": 3}})  # fmt: skip
    assert status == 400 and "thresold" in body["error"]["message"]
    status, body = await call(stack, router, "PUT", "/admin/policy", data=b"{not json")
    assert status == 400
    assert_openai_error(body, 400)
    status, body = await call(stack, router, "PUT", "/admin/policy", json={"name": "no-such"})
    assert status == 400
    _, body = await call(stack, router, "GET", "/admin/policy")
    assert body == {"name": "round-robin"}  # refused updates change nothing
    status, _ = await call(stack, router, "POST", "/admin/policy", json={"name": "colocate"})
    assert status == 405


async def test_app_endpoints_list_models_health_readiness_and_metrics(stack: Stack) -> None:
    a = await stack.worker("a", model="llama")
    router = await stack.router([spec(a)])
    status, body = await call(stack, router, "GET", "/v1/models", token=None)
    assert status == 200 and [m["id"] for m in body["data"]] == ["llama"]
    assert body["data"][0]["max_model_len"] == 8192  # the worker's own entry, as it gave it
    status, body = await call(stack, router, "GET", "/health", token=None)
    assert status == 200 and body == {"status": "ok", "degraded": False}
    status, body = await call(stack, router, "GET", "/ready", token=None)
    assert status == 200 and body == {"redis": True, "healthy_workers": 1, "degraded": False}
    # a model no worker serves is refused before any worker sees it
    async with stack.http.post(router.url + "/v1/chat/completions",
                               json={**CHAT, "model": "other"}) as response:  # fmt: skip
        assert response.status == 404
        assert (await response.json())["error"]["param"] == "model"
    status, body = await call(stack, router, "GET", "/v1/chat/completions", token=None)
    assert status == 405
    assert a.received == []
    assert await router.metric(stack.http, "session_router_worker_healthy", 'worker="a"') == 1
    assert await router.metric(stack.http, "session_router_requests_total") == 1  # the 404 turn
