"""A decision's hold (`hold_s`) through the router: the turn waits there, then goes out; a
client gone meanwhile sends nothing upstream."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from tests.e2e.conftest import StartRouter
from tests.e2e.helpers import admin_get, chat, metric_sum
from tests.e2e.recording_worker import RecordingWorker

MESSAGES = [{"role": "user", "content": "hello"}]
POLICY = "tests.e2e.scripted_policies:HoldThenColocate"


async def test_a_held_turn_goes_out_after_its_hold(
    recorder: RecordingWorker, start_router: StartRouter
) -> None:
    router = await asyncio.to_thread(
        start_router, "--mixed", recorder.url, "--policy", POLICY, "--policy-param", "hold_s=0.4"
    )
    async with aiohttp.ClientSession() as http:
        sent = time.time()
        _, usage, response = await chat(http, router.url, MESSAGES)
        assert response.status == 200 and usage["completion_tokens"] == 3
        _, decisions = await admin_get(http, router.url, router.admin_token,
                                       "/admin/decisions?limit=1")  # fmt: skip
        held = await metric_sum(http, router.url, "session_router_hold_seconds_sum")
        holds = await metric_sum(http, router.url, "session_router_hold_seconds_count")
    [received] = recorder.received
    assert holds == 1 and held == pytest.approx(0.4, abs=0.1)
    assert received.at - sent >= 0.4
    event = decisions["decisions"][0]
    assert event["released"] - event["decided"] == pytest.approx(0.4, abs=0.1)
    assert event["prefill_start"] >= event["released"]


async def test_a_client_gone_during_the_hold_sends_nothing_upstream(
    recorder: RecordingWorker, start_router: StartRouter
) -> None:
    router = await asyncio.to_thread(
        start_router, "--mixed", recorder.url, "--policy", POLICY, "--policy-param", "hold_s=1.0"
    )
    async with aiohttp.ClientSession() as http:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(chat(http, router.url, MESSAGES), 0.3)
        await asyncio.sleep(1.2)  # past the hold
        disconnects = await metric_sum(http, router.url, "session_router_client_disconnects_total")
        _, decisions = await admin_get(http, router.url, router.admin_token,
                                       "/admin/decisions?limit=1")  # fmt: skip
    assert recorder.received == []
    assert disconnects == 1
    assert decisions["decisions"][0]["outcome"] == "cancelled"
