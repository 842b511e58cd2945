"""Real processes for end-to-end tests: a sim cluster, routers, and a real Redis."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import pytest

from bench.stack.up import free_port_block
from tests.conftest import free_port
from tests.e2e.recording_worker import RecordingWorker
from tests.procs import Process


@dataclass
class SimCluster:
    urls: list[str]
    process: Process


def start_sim_cluster(workers: int, *extra: str) -> SimCluster:
    base = free_port_block("127.0.0.1", workers)
    process = Process(["sim-cluster", "--base-port", str(base), "--workers", str(workers),
                       "--noise", "0", *extra])  # fmt: skip
    urls = [f"http://127.0.0.1:{base + i}" for i in range(workers)]
    process.wait_healthy(urls)
    return SimCluster(urls, process)


@pytest.fixture(scope="module")
def sim4() -> Iterator[SimCluster]:
    cluster = start_sim_cluster(4)
    yield cluster
    cluster.process.stop()


@pytest.fixture
async def recorder() -> AsyncIterator[RecordingWorker]:
    """A fake worker recording what the router sends it."""
    worker = RecordingWorker()
    await worker.start()
    yield worker
    await worker.stop()


@dataclass
class RouterProcess:
    url: str
    process: Process
    admin_token: str
    prefix: str


StartRouter = Callable[..., RouterProcess]


@pytest.fixture
def start_router(redis_url: str) -> Iterator[StartRouter]:
    started: list[RouterProcess] = []

    def start(*args: str, prefix: str | None = None, admin: bool = True) -> RouterProcess:
        port = free_port()
        token = uuid.uuid4().hex
        prefix = prefix or f"test-{uuid.uuid4().hex[:8]}"
        argv = ["serve", "--port", str(port), "--redis", redis_url, "--redis-prefix", prefix,
                "--scrape-interval-ms", "100", *args]  # fmt: skip
        if admin:
            argv += ["--admin-token", token]
        process = Process(argv)
        url = f"http://127.0.0.1:{port}"
        process.wait_healthy([url])
        router = RouterProcess(url, process, token, prefix)
        started.append(router)
        return router

    yield start
    for router in started:
        router.process.stop()


def workers_args(urls: list[str], prefill: int = 0, decode: int = 0) -> list[str]:
    """--prefill for the first `prefill` URLs, --decode for the next `decode`, rest --mixed."""
    args: list[str] = []
    for i, url in enumerate(urls):
        role = "prefill" if i < prefill else "decode" if i < prefill + decode else "mixed"
        args += [f"--{role}", url]
    return args
