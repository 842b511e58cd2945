"""Faults and bad input through the router: each one answered, counted, and nothing hangs."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import free_port
from tests.e2e.conftest import SimCluster, StartRouter, start_sim_cluster, workers_args
from tests.e2e.helpers import admin_get, chat, metric_sum
from tests.e2e.recording_worker import RecordingWorker

MESSAGES = [{"role": "user", "content": "hello"}]


async def post_raw(
    http: aiohttp.ClientSession, url: str, raw: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], dict[str, object]]:
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    async with http.post(url + "/v1/chat/completions", data=raw, headers=all_headers) as r:
        return r.status, dict(r.headers), await r.json()


@pytest.mark.parametrize(
    ("raw", "status", "param"),
    [
        (b"{not json", 400, None),
        (b'{"messages": []}', 400, "messages"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}', 400, "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "x"}], "n": 3}', 400, "n"),
        (b'{"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}', 404,
         "model"),
    ],
)  # fmt: skip
async def test_bad_requests_get_openai_errors(
    sim4: SimCluster, start_router: StartRouter, raw: bytes, status: int, param: str | None
) -> None:
    router = start_router(*workers_args(sim4.urls[:1]))
    async with aiohttp.ClientSession() as http:
        got, _, body = await post_raw(http, router.url, raw)
        assert got == status
        error = body["error"]
        assert isinstance(error, dict)
        assert error["code"] == status and error["param"] == param and error["message"]
        # and the router keeps serving
        _, usage, response = await chat(http, router.url, MESSAGES)
        assert response.status == 200 and usage["completion_tokens"] == 8


async def test_body_over_the_limit_is_413(sim4: SimCluster, start_router: StartRouter) -> None:
    router = start_router(*workers_args(sim4.urls[:1]), "--max-body-bytes", "2000")
    big = json.dumps({"messages": [{"role": "user", "content": "x " * 5000}]}).encode()
    async with aiohttp.ClientSession() as http:
        status, _, body = await post_raw(http, router.url, big)
    assert status == 413
    assert body["error"]["code"] == 413  # type: ignore[index]


async def test_no_healthy_worker_is_503_with_retry_after(start_router: StartRouter) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    router = start_router("--mixed", dead)
    async with aiohttp.ClientSession() as http:
        status, headers, body = await post_raw(http, router.url, json.dumps(
            {"messages": MESSAGES}).encode())  # fmt: skip
        async with http.get(router.url + "/ready") as ready:
            assert ready.status == 503
    assert status == 503
    assert int(headers["Retry-After"]) >= 1
    assert body["error"]["code"] == 503  # type: ignore[index]


async def test_refused_connection_is_retried_once_on_another_worker(
    sim4: SimCluster, start_router: StartRouter, tmp_path: Path
) -> None:
    # a worker that listed the model at the router's start, then died (no scrape since): its
    # ids chosen so that it sorts first, and a new session's least-loaded tie picks it
    doomed = RecordingWorker(model="llama-3.1-8b")
    await doomed.start()
    config = tmp_path / "router.toml"
    config.write_text(
        'policy = { name = "colocate" }\n'
        f'[[workers]]\nurl = "{doomed.url}"\nrole = "mixed"\nid = "a-dead"\n'
        f'[[workers]]\nurl = "{sim4.urls[0]}"\nrole = "mixed"\nid = "b-alive"\n'
    )
    # started from a thread: this loop serves the doomed worker's first scrape meanwhile
    router = await asyncio.to_thread(start_router, "--config", str(config),
                                     "--scrape-interval-ms", "60000")  # fmt: skip
    await doomed.stop()
    async with aiohttp.ClientSession() as http:
        _answer, usage, response = await chat(http, router.url, MESSAGES, session_id="retry-1")
        assert response.status == 200 and usage["completion_tokens"] == 8
        retries = await metric_sum(
            http, router.url, "session_router_retries_total", 'reason="connect"'
        )
        _, record = await admin_get(http, router.url, router.admin_token,
                                    "/admin/sessions/retry-1")  # fmt: skip
    assert retries == 1
    assert record["worker_id"] == "b-alive"


async def test_worker_dying_mid_stream_ends_the_stream_with_an_error_and_clears_residency(
    start_router: StartRouter,
) -> None:
    victim = start_sim_cluster(1)
    router = start_router(*workers_args(victim.urls), "--policy", "colocate")
    body = {"messages": MESSAGES, "max_tokens": 5000, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        # a first turn gives the session a residency
        await chat(http, router.url, MESSAGES, session_id="dies")
        async with http.post(router.url + "/v1/chat/completions", json=body,
                             headers={"X-Session-ID": "dies"}) as response:  # fmt: skip
            lines: list[bytes] = []
            killed_at = 0.0
            async for line in response.content:
                if line.strip():
                    lines.append(line.strip())
                if len(lines) == 20:
                    victim.process.popen.send_signal(signal.SIGKILL)
                    killed_at = time.monotonic()
            ended_at = time.monotonic()
        assert ended_at - killed_at < 1.0
        assert lines[-1] == b"data: [DONE]"
        assert lines[-2].startswith(b'data: {"error"')
        for _ in range(100):
            status, _ = await admin_get(http, router.url, router.admin_token,
                                        "/admin/sessions/dies")  # fmt: skip
            if status == 404:
                break
            await asyncio.sleep(0.01)
        assert status == 404
        errors = await metric_sum(
            http, router.url, "session_router_upstream_errors_total", "midstream"
        )
        assert errors >= 1
    victim.process.stop()


async def test_client_disconnect_cancels_the_upstream_request(
    sim4: SimCluster, start_router: StartRouter
) -> None:
    worker = sim4.urls[1]
    router = start_router("--mixed", worker)
    body = {"messages": MESSAGES, "max_tokens": 100000, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        aborts = await metric_sum(http, worker, "vllm:request_success_total", "abort")
        async with http.post(router.url + "/v1/chat/completions", json=body) as response:
            async for line in response.content:
                if b'"content":"' in line and b'"content":""' not in line:
                    break
            response.close()
        closed_at = time.monotonic()
        while time.monotonic() - closed_at < 2:
            if await metric_sum(http, worker, "vllm:request_success_total", "abort") > aborts:
                break
            await asyncio.sleep(0.005)
        cancel_s = time.monotonic() - closed_at
        assert await metric_sum(http, worker, "vllm:num_requests_running") == 0
        disconnects = await metric_sum(http, router.url, "session_router_client_disconnects_total")
    assert cancel_s < 0.1
    assert disconnects >= 1


async def test_decode_leg_failure_after_prefill_is_retried_as_local_prefill(
    sim4: SimCluster, start_router: StartRouter
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    prefill, alive = sim4.urls[2], sim4.urls[3]
    params = [f"prefill={prefill.split('://')[1]}", f"decode={dead.split('://')[1]}"]
    router = start_router(
        "--prefill", prefill, "--decode", dead, "--decode", alive,
        "--policy", "tests.e2e.scripted_policies:AlwaysHandoff",
        "--policy-param", params[0], "--policy-param", params[1],
    )  # fmt: skip
    async with aiohttp.ClientSession() as http:
        _answer, usage, response = await chat(http, router.url, MESSAGES, max_tokens=4)
        _, decisions = await admin_get(http, router.url, router.admin_token,
                                       "/admin/decisions?limit=1")  # fmt: skip
        recomputed = await metric_sum(http, router.url, "session_router_recomputed_tokens_total")
    assert response.status == 200 and usage["completion_tokens"] == 4
    event = decisions["decisions"][0]
    assert event["retried"] is True
    assert event["decode_worker"] == alive.split("://")[1]
    assert event["recomputed_tokens"] > 0 and recomputed > 0


async def test_api_key_is_required_when_configured(
    sim4: SimCluster, start_router: StartRouter
) -> None:
    router = start_router(*workers_args(sim4.urls[:1]), "--api-key", "sekret")
    async with aiohttp.ClientSession() as http:
        status, _, body = await post_raw(http, router.url, json.dumps(
            {"messages": MESSAGES}).encode())  # fmt: skip
        assert status == 401 and body["error"]["code"] == 401  # type: ignore[index]
        _, _usage, response = await chat(http, router.url, MESSAGES,
                                         headers={"Authorization": "Bearer sekret"})  # fmt: skip
        assert response.status == 200


async def test_admin_is_404_without_token_and_401_with_a_wrong_one(
    sim4: SimCluster, start_router: StartRouter
) -> None:
    plain = start_router(*workers_args(sim4.urls[:1]), admin=False)
    guarded = start_router(*workers_args(sim4.urls[:1]))
    async with aiohttp.ClientSession() as http:
        async with http.get(plain.url + "/admin/workers") as response:
            assert response.status == 404
        async with http.get(guarded.url + "/admin/workers",
                            headers={"Authorization": "Bearer wrong"}) as response:  # fmt: skip
            assert response.status == 401
        status, workers = await admin_get(http, guarded.url, guarded.admin_token, "/admin/workers")
    assert status == 200 and workers["workers"][0]["healthy"] is True


async def test_policy_swap_at_run_time_drops_no_request(
    sim4: SimCluster, start_router: StartRouter
) -> None:
    router = start_router(*workers_args(sim4.urls[:2]), "--policy", "colocate")
    headers = {"Authorization": f"Bearer {router.admin_token}"}
    async with aiohttp.ClientSession() as http:
        turns = [chat(http, router.url, MESSAGES, max_tokens=40, session_id=f"swap-{i}")
                 for i in range(8)]  # fmt: skip
        running = [asyncio.ensure_future(turn) for turn in turns]
        await asyncio.sleep(0.05)
        async with http.put(router.url + "/admin/policy", headers=headers,
                            json={"name": "round-robin"}) as response:  # fmt: skip
            assert response.status == 200
        async with http.put(
            router.url + "/admin/policy",
            headers=headers,
            json={"name": "threshold", "params": {"thresold": 3}},
        ) as bad:
            assert bad.status == 400
            assert "thresold" in (await bad.json())["error"]["message"]
        results = await asyncio.gather(*running)
        _, policy = await admin_get(http, router.url, router.admin_token, "/admin/policy")
    assert all(r[2].status == 200 and r[1]["completion_tokens"] == 40 for r in results)
    assert policy["name"] == "round-robin"


async def test_drained_worker_gets_no_new_sessions(
    sim4: SimCluster, start_router: StartRouter
) -> None:
    router = start_router(*workers_args(sim4.urls[:2]), "--policy", "colocate")
    drained = sim4.urls[0].split("://")[1]
    headers = {"Authorization": f"Bearer {router.admin_token}"}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{router.url}/admin/workers/{drained}/drain",
                             headers=headers) as response:  # fmt: skip
            assert response.status == 200
        for i in range(4):
            await chat(http, router.url, MESSAGES, session_id=f"drain-{uuid.uuid4().hex}-{i}")
        _, decisions = await admin_get(http, router.url, router.admin_token,
                                       "/admin/decisions?limit=4")  # fmt: skip
    assert all(e["decode_worker"] != drained for e in decisions["decisions"])
