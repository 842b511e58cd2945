"""The router while Redis is down: still ready (a readiness probe must not take the whole fleet
out of rotation), degraded shown in /ready, /health and the metrics, /admin/sessions answered
from the local view; its Redis timeouts configured; a worker failure logged with its cause."""

from __future__ import annotations

import logging
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router.app import Router
from router.config import RouterConfig, WorkerSpec
from router.http import HttpServer, Request, Response, StreamWriter
from router.http.client import UpstreamConnectError
from router.turn.legs import WorkerUnreachable
from tests.router.state.test_degraded import launch_redis, socket_path, stop_redis
from tests.router.state.test_shared import eventually

__all__ = ["socket_path"]  # the fixture, used by name

METRICS = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n"
ADMIN = {"Authorization": "Bearer admin"}


async def fake_worker(request: Request, writer: StreamWriter) -> Response:
    if request.path == "/metrics":
        return Response(200, METRICS, content_type="text/plain")
    if request.path == "/v1/models":
        return Response(200, b'{"object":"list","data":[{"id":"m"}]}')
    return Response(404, b"{}")


@dataclass
class Running:
    router: Router
    url: str
    http: aiohttp.ClientSession
    socket_path: Path
    redis: subprocess.Popen[bytes]

    async def get(self, path: str, **options: Any) -> tuple[int, Any]:
        async with self.http.get(self.url + path, **options) as response:
            body = await response.read()
            if response.content_type == "application/json":
                return response.status, await response.json()
            return response.status, body.decode()


@pytest.fixture
async def running(socket_path: Path) -> AsyncIterator[Running]:
    worker = HttpServer(fake_worker)
    await worker.start("127.0.0.1", 0)
    config = RouterConfig(
        workers=(WorkerSpec(url=f"http://127.0.0.1:{worker.port}", id="w"),),
        redis=f"unix://{socket_path}",
        redis_prefix="app",
        admin_token="admin",
        redis_timeout_s=3.5,
        redis_connect_timeout_s=4.5,
    )
    router = Router(config)
    server = HttpServer(router.handle)
    process = launch_redis(socket_path)
    running = Running(router, "", aiohttp.ClientSession(), socket_path, process)
    try:
        await router.start()
        await server.start("127.0.0.1", 0)
        running.url = f"http://127.0.0.1:{server.port}"
        yield running
    finally:
        await running.http.close()
        await server.close(grace_s=1.0)
        await router.stop()
        await worker.close(grace_s=1.0)
        stop_redis(running.redis)


async def test_ready_stays_200_while_degraded_and_says_so(running: Running) -> None:
    router = running.router
    state = router.state
    assert state is not None
    assert (state.config.command_timeout_s, state.config.connect_timeout_s) == (3.5, 4.5)
    assert await running.get("/ready") == (
        200, {"redis": True, "healthy_workers": 1, "degraded": False}
    )  # fmt: skip
    assert await running.get("/health") == (200, {"status": "ok", "degraded": False})
    committed = await state.commit_session("s", "w", 10, 100, 0)
    assert committed.ok and committed.record is not None

    stop_redis(running.redis)
    await eventually(lambda: state.degraded, within=10)
    assert await running.get("/ready") == (
        200, {"redis": False, "healthy_workers": 1, "degraded": True}
    )  # fmt: skip
    assert await running.get("/health") == (200, {"status": "ok", "degraded": True})
    _, metrics = await running.get("/metrics")
    assert "\nrouter_degraded 1.0\n" in metrics
    status, record = await running.get("/admin/sessions/s", headers=ADMIN)
    assert status == 200
    assert record == {**_fields(committed.record), "degraded": True}
    status, body = await running.get("/admin/sessions/never-seen", headers=ADMIN)
    assert status == 503 and body["error"]["code"] == 503

    running.redis = launch_redis(running.socket_path)  # back empty: the view is written back
    await eventually(lambda: not state.degraded, within=10)
    status, record = await running.get("/admin/sessions/s", headers=ADMIN)
    assert (status, record) == (200, {**_fields(committed.record), "degraded": False})
    assert (await running.get("/admin/sessions/never-seen", headers=ADMIN))[0] == 404
    _, metrics = await running.get("/metrics")
    assert "\nrouter_degraded 0.0\n" in metrics


def _fields(record: Any) -> dict[str, Any]:
    return {name: getattr(record, name) for name in record.__struct_fields__}


async def test_a_worker_marked_failed_is_logged_with_the_real_cause(
    running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    try:
        try:
            raise UpstreamConnectError("connect to 127.0.0.1:1 timed out") from TimeoutError()
        except UpstreamConnectError as exc:
            raise WorkerUnreachable("w", str(exc)) from exc
    except WorkerUnreachable:
        running.router._mark_failed("w")  # as the pipeline calls it: in its except block
    assert "UpstreamConnectError: connect to 127.0.0.1:1 timed out (from TimeoutError)" in (
        caplog.text
    )
    assert "connection refused" not in caplog.text
