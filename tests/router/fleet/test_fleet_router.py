"""A running router (its app object on an ephemeral port, fake vLLM workers, real Redis) whose
fleet changes: several models placed only on their workers, /admin/workers add and remove, a
departing worker draining its turns in flight, and a watched workers file."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.router.turn.fake_upstream import FakeWorker, RouterUnderTest, Stack, eventually, spec

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture
async def stack(redis_url: str) -> AsyncIterator[Stack]:
    async with Stack(redis_url) as stack:
        yield stack


async def turn(stack: Stack, router: RouterUnderTest, model: str | None, session: str) -> \
        tuple[int, Any]:  # fmt: skip
    body: dict[str, Any] = {"messages": MESSAGES, "max_tokens": 2}
    if model is not None:
        body["model"] = model
    async with stack.http.post(router.url + "/v1/chat/completions", json=body,
                               headers={"X-Session-Id": session}) as response:  # fmt: skip
        return response.status, await response.json(content_type=None)


async def admin(stack: Stack, router: RouterUnderTest, method: str, path: str,
                body: Any = None) -> tuple[int, Any]:  # fmt: skip
    data = None if body is None else json.dumps(body).encode()
    async with stack.http.request(method, router.url + path, data=data,
                                  headers=router.admin) as response:  # fmt: skip
        return response.status, await response.json(content_type=None)


def assert_error(body: Any, status: int, param: str | None) -> None:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status and body["error"]["param"] == param, body


async def models_known(router: RouterUnderTest, *ids: str) -> None:
    async def known() -> bool:
        return set(router.router.pool.model_names()) >= set(ids)

    await eventually(known)


@pytest.mark.parametrize("policy", ["colocate", "round-robin", "adaptive", "threshold"])
async def test_a_turn_goes_only_to_workers_serving_its_model(stack: Stack, policy: str) -> None:
    a1 = await stack.worker("a1", model="llama")
    a2 = await stack.worker("a2", model="llama")
    b = await stack.worker("b", model="qwen", adapters=("qwen-sql",))
    router = await stack.router([spec(a1), spec(a2), spec(b)], policy)
    await models_known(router, "llama", "qwen", "qwen-sql")
    for i in range(12):
        for model in ("llama", "qwen", "qwen-sql"):
            status, body = await turn(stack, router, model, f"{model}-{i % 4}")
            assert status == 200, body
    assert {got.body["model"] for got in b.received} == {"qwen", "qwen-sql"}
    assert len(b.received) == 24
    assert {got.body["model"] for w in (a1, a2) for got in w.received} == {"llama"}
    async with stack.http.get(router.url + "/v1/models") as response:
        listed = [m["id"] for m in (await response.json())["data"]]
    assert sorted(listed) == ["llama", "qwen", "qwen-sql"]
    status, body = await turn(stack, router, "mistral", "s")
    assert status == 404
    assert_error(body, 404, "model")
    status, body = await turn(stack, router, None, "s")  # which of the models?
    assert status == 400
    assert_error(body, 400, "model")


async def test_a_models_only_worker_failing_is_a_503_not_another_models_worker(
    stack: Stack,
) -> None:
    a = await stack.worker("a", model="llama")
    b = await stack.worker("b", model="qwen")
    router = await stack.router([spec(a), spec(b)])
    await models_known(router, "llama", "qwen")
    await b.stop()
    router.router.scraper.mark_failed_now("b")  # type: ignore[union-attr]
    status, body = await turn(stack, router, "qwen", "s")
    assert status == 503
    assert_error(body, 503, None)
    assert a.received == []


async def test_admin_adds_and_removes_a_worker_which_drains_its_turns_in_flight(
    stack: Stack,
) -> None:
    a = await stack.worker("a")
    c = await stack.worker("c", delay_s=0.5)
    router = await stack.router([spec(a)], departure_grace_s=0.0)
    await models_known(router, "m")
    status, body = await admin(stack, router, "POST", "/admin/workers",
                               {"url": c.url, "id": "c", "role": "mixed"})  # fmt: skip
    assert status == 201 and body["origin"] == "admin", body
    for bad, expected in [({"url": c.url, "id": "c"}, 409), ({"url": "ftp://x:1"}, 400),
                          ({"url": c.url, "colour": 1}, 400), ([1], 400)]:  # fmt: skip
        status, body = await admin(stack, router, "POST", "/admin/workers", bad)
        assert status == expected, (bad, body)
        assert_error(body, expected, body["error"]["param"])

    async def c_serves() -> bool:
        state = router.router.pool.workers["c"]
        return state.models == ("m",) and state.load is not None

    await eventually(c_serves)
    # new sessions spread over both (round-robin's turn order keeps it exact)
    router.router.policy.policy = __import__("policies").create_policy("round-robin", {})
    in_flight = [asyncio.create_task(turn(stack, router, "m", f"s{i}")) for i in range(4)]

    async def all_sent() -> bool:  # every one reached its worker (c answers them late)
        return len(a.received) + len(c.received) == 4

    await eventually(all_sent)
    assert c.received  # round-robin's spread
    status, body = await admin(stack, router, "DELETE", "/admin/workers/c")
    assert status == 202 and body["leaving"] is True and body["inflight"] >= 1, body
    before = len(c.received)
    for i in range(6):  # placed while c drains: none goes there
        status, _ = await turn(stack, router, "m", f"t{i}")
        assert status == 200
    assert len(c.received) == before
    assert [status for status, _ in await asyncio.gather(*in_flight)] == [200] * 4
    status, listed = await admin(stack, router, "GET", "/admin/workers")
    assert {w["id"]: (w["origin"], w["leaving"]) for w in listed["workers"]}["a"] == (
        "static",
        False,
    )

    async def forgotten() -> bool:
        return "c" not in router.router.pool.workers

    await eventually(forgotten)
    status, body = await admin(stack, router, "DELETE", "/admin/workers/c")
    assert status == 404
    assert_error(body, 404, "worker_id")


async def test_a_session_whose_worker_left_is_placed_afresh(stack: Stack) -> None:
    a = await stack.worker("a")
    b = await stack.worker("b")
    router = await stack.router([spec(a), spec(b)], departure_grace_s=0.0)
    await models_known(router, "m")
    status, _ = await turn(stack, router, "m", "sticky")
    assert status == 200
    first = "a" if a.received else "b"

    async def committed() -> bool:
        status, body = await router.session(stack.http, "sticky")
        return status == 200 and body["worker_id"] == first

    await eventually(committed)
    await admin(stack, router, "DELETE", f"/admin/workers/{first}")
    status, _ = await turn(stack, router, "m", "sticky")
    assert status == 200
    (event,) = await router.decisions(stack.http)
    assert event["action"] == "recompute" and event["decode_worker"] != first


async def test_a_watched_workers_file_changes_the_fleet_without_restart(
    stack: Stack, tmp_path: Path
) -> None:
    a = await stack.worker("a", model="llama")
    b = await stack.worker("b", model="qwen")
    path = tmp_path / "workers.toml"

    def write(*workers: FakeWorker) -> None:
        text = "".join(f'[[workers]]\nurl = "{w.url}"\nid = "{w.name}"\n' for w in workers)
        (tmp_path / "new.toml").write_text(text)
        os.replace(tmp_path / "new.toml", path)

    write(a)
    router = await stack.router([], discovery="file", discovery_file=str(path),
                                discovery_interval_s=0.05, departure_grace_s=0.0)  # fmt: skip
    await models_known(router, "llama")
    status, body = await turn(stack, router, "qwen", "s")
    assert status == 404
    write(a, b)
    await models_known(router, "llama", "qwen")
    status, _ = await turn(stack, router, "qwen", "s")
    assert status == 200 and len(b.received) == 1
    status, listed = await admin(stack, router, "GET", "/admin/workers")
    assert {w["id"]: w["origin"] for w in listed["workers"]} == {"a": "file", "b": "file"}
    status, body = await admin(stack, router, "DELETE", "/admin/workers/b")
    assert status == 409  # the file would add it again
    write(a)

    async def b_gone() -> bool:
        return "b" not in router.router.pool.workers

    await eventually(b_gone)
    status, body = await turn(stack, router, "qwen", "s")
    assert status == 404
    assert_error(body, 404, "model")
