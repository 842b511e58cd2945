"""DNS discovery against a DNS server on a local UDP port (a real server in the test): every
A and AAAA record is a worker; records re-resolved periodically and on reload; a name without
records is an empty fleet; a failing server changes nothing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

from router.config import ConfigError, WorkerSpec
from router.fleet.discovery.dns import DnsSource, parse_server
from router.fleet.discovery.source import WorkerDefaults
from tests.fake_dns import FakeDns

NAME = "vllm-headless.ns.svc.cluster.local"


@pytest.fixture
async def server() -> AsyncIterator[FakeDns]:
    fake = FakeDns()
    await fake.start()
    yield fake
    fake.stop()


async def until(probe: Callable[[], bool], within_s: float = 5.0) -> None:
    async with asyncio.timeout(within_s):
        while True:
            if probe():
                return
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def running(source: DnsSource, sets: list[tuple[WorkerSpec, ...]]) -> AsyncIterator[None]:
    task = asyncio.create_task(source.run(sets.append))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def urls(sets: list[tuple[WorkerSpec, ...]]) -> list[str]:
    return [w.url for w in sets[-1]] if sets else []


async def test_every_record_is_a_worker_and_changes_are_seen(server: FakeDns) -> None:
    server.records[NAME] = ["10.0.0.2", "10.0.0.1", "fd00::1"]
    defaults = WorkerDefaults(port=8100, role="decode", engine="sglang")
    source = DnsSource(NAME, defaults, interval_s=0.05, server=f"127.0.0.1:{server.port}")
    sets: list[tuple[WorkerSpec, ...]] = []
    async with running(source, sets):
        await until(lambda: len(sets) == 1)
        assert urls(sets) == ["http://10.0.0.1:8100", "http://10.0.0.2:8100",
                              "http://[fd00::1]:8100"]  # fmt: skip
        assert {(w.role, w.engine) for w in sets[-1]} == {("decode", "sglang")}
        assert sets[-1][0].worker_id == "10.0.0.1:8100"
        server.records[NAME] = ["10.0.0.1", "10.0.0.3"]
        await until(lambda: urls(sets) == ["http://10.0.0.1:8100", "http://10.0.0.3:8100"])
        queries = server.queries
        await asyncio.sleep(0.2)  # re-resolved all along, reported only on change
        assert server.queries > queries and len(sets) == 2
        server.failing = True  # SERVFAIL: the workers stay
        await asyncio.sleep(0.2)
        assert len(sets) == 2
        server.failing = False
        del server.records[NAME]  # NXDOMAIN: no workers
        await until(lambda: sets[-1] == ())


async def test_reload_resolves_at_once(server: FakeDns) -> None:
    server.records[NAME] = ["10.0.0.1"]
    source = DnsSource(NAME, WorkerDefaults(), interval_s=3600, server=f"127.0.0.1:{server.port}")
    sets: list[tuple[WorkerSpec, ...]] = []
    async with running(source, sets):
        await until(lambda: len(sets) == 1)
        server.records[NAME] = ["10.0.0.1", "10.0.0.2"]
        source.reload()
        await until(lambda: len(sets) == 2)


async def test_an_unanswering_server_is_a_failure_not_an_empty_fleet() -> None:
    # nothing listens there: every query times out; nothing is reported
    source = DnsSource(NAME, WorkerDefaults(), interval_s=0.05, server="127.0.0.1:9",
                       timeout_s=0.2)  # fmt: skip
    sets: list[tuple[WorkerSpec, ...]] = []
    async with running(source, sets):
        await asyncio.sleep(0.6)
    assert sets == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [("10.0.0.53", ("10.0.0.53", 53)), ("127.0.0.1:5353", ("127.0.0.1", 5353)),
     ("[fd00::53]:53", ("fd00::53", 53)), ("fd00::53", ("fd00::53", 53)),
     ("dns.local", ConfigError), ("127.0.0.1:0", ConfigError), ("127.0.0.1:x", ConfigError)],
)  # fmt: skip
def test_parse_server(text: str, expected: object) -> None:
    if expected is ConfigError:
        with pytest.raises(ConfigError):
            parse_server(text)
    else:
        assert parse_server(text) == expected
