"""Degraded mode: Redis goes away and comes back; the request path never sees an error."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from router.state.embedded_redis import EmbeddedRedis, redis_server_binary
from router.state.shared import UNKNOWN, CommitResult
from tests.router.state.test_shared import eventually, running, worker

LOGGER = "router.state.shared"


def launch_redis(socket_path: Path) -> subprocess.Popen[bytes]:
    """A private redis-server on `socket_path`, answering PING before this returns."""
    process = subprocess.Popen(
        [
            redis_server_binary(), "--port", "0", "--unixsocket", str(socket_path),
            "--unixsocketperm", "700", "--save", "", "--appendonly", "no",
            "--dir", str(socket_path.parent), "--loglevel", "warning",
            "--logfile", str(socket_path.parent / "redis.log"),
        ],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while True:
        try:
            with redis.Redis(unix_socket_path=str(socket_path)) as client:
                if client.ping():
                    return process
        except redis.ConnectionError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("redis-server did not start")
        time.sleep(0.01)


def stop_redis(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture
def socket_path(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "r.sock"
    assert len(str(path)) < 100, "unix socket paths are limited to 107 bytes"
    yield path


def state_log(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]


async def test_reads_answer_from_the_view_while_redis_is_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[bool] = []
    server = EmbeddedRedis()
    url = server.start()
    caplog.set_level(logging.INFO, logger=LOGGER)
    try:
        async with running(url, "deg", "a", on_degraded=calls.append) as a:
            committed = await a.commit_session("s", "w1", 10, 100, 0)
            record = worker("w1", time.time())
            a.publish_worker(record)
            a.add_inflight("w1", 2)
            with redis.Redis.from_url(url) as client:
                await eventually(lambda: client.exists("deg:worker:w1") == 1)
            server.stop()
            await eventually(lambda: a.degraded)
            assert calls == [True]
            assert a.cached_session("s") == committed.record
            assert await a.load_session("s") == committed.record
            assert await a.load_session("unseen") is None
            assert a.cached_session("unseen") is UNKNOWN
            assert await a.ping() is False
            assert a.fleet_workers() == {"w1": record}
            assert a.fleet_inflight() == {"w1": 2}
            handoff = await a.reserve("w1", "w2", 500, "handoff")
            assert handoff is not None and handoff.local_only
            assert a.link_views()[("w1", "w2")].handoff_bytes == 500
            assert await a.reserve("w1", "w2", 1, "migration") is None
            a.release(handoff, 500, 0.0)
            assert a.link_views() == {}
            assert committed.record is not None
            pending = a.commit_session("s", "w2", 20, 200, committed.record.epoch)
            assert a.cached_session("s") is not None
            await asyncio.sleep(0.5)  # reconnect attempts keep failing quietly
            assert calls == [True] and a.degraded and not pending.done()
        # closing while degraded resolves what could not be written
        assert pending.result() == CommitResult(ok=False, record=committed.record)
    finally:
        server.stop()
    assert [level for level, _ in state_log(caplog)] == [logging.WARNING]


async def test_recovers_by_itself_and_flushes_pending_writes(
    socket_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    calls: list[bool] = []
    url = f"unix://{socket_path}"
    process = launch_redis(socket_path)
    try:
        async with running(url, "rec", "a", on_degraded=calls.append) as a:
            old = (await a.commit_session("old", "w1", 1, 1, 0)).record
            assert old is not None
            # several pooled connections, all of which go stale with the server
            await asyncio.gather(*(a.load_session(f"x{i}") for i in range(8)))
            stop_redis(process)
            await eventually(lambda: a.degraded)
            first = a.commit_session("new", "w1", 10, 100, 0)
            second = a.commit_session("new", "w2", 20, 200, 1)  # coalesces with the first
            await asyncio.sleep(0.3)
            assert not first.done() and not second.done()
            assert calls == [True]

            process = launch_redis(socket_path)  # same path: the client reconnects by itself
            await eventually(lambda: not a.degraded, within=10)
            assert calls == [True, False]
            results = await asyncio.gather(first, second)
            final = results[1].record
            assert final is not None
            assert (final.worker_id, final.tokens, final.turns, final.epoch) == ("w2", 20, 2, 2)
            assert list(results) == [CommitResult(ok=True, record=final)] * 2
            with redis.Redis(unix_socket_path=str(socket_path)) as client:
                stored = client.hgetall("rec:session:new")
            assert (stored[b"owner"], stored[b"epoch"], stored[b"turns"]) == (b"w2", b"2", b"2")
            # the server came back empty: what the view held is written back, epoch included
            assert a.cached_session("old") == old
            assert await a.load_session("old") == old
            with redis.Redis(unix_socket_path=str(socket_path)) as client:
                stored = client.hgetall("rec:session:old")
            assert (stored[b"owner"], stored[b"epoch"], stored[b"turns"]) == (b"w1", b"1", b"1")
            loads = await asyncio.gather(*(a.load_session(f"x{i}") for i in range(8)))
            assert loads == [None] * 8 and calls == [True, False]
            # and subscribed again: another replica's commit reaches this view
            async with running(url, "rec", "b") as b:
                await b.load_session("new")
                moved = await b.commit_session("new", "w3", 30, 300, 2)
                await eventually(lambda: a.cached_session("new") == moved.record, within=0.5)
    finally:
        stop_redis(process)
    assert calls == [True, False]
    assert [level for level, _ in state_log(caplog)] == [logging.WARNING] + [logging.INFO] * 2


async def test_starts_degraded_when_redis_is_absent(socket_path: Path) -> None:
    calls: list[bool] = []
    async with running(f"unix://{socket_path}", "abs", "a", on_degraded=calls.append) as a:
        assert a.degraded and calls == [True]
        assert await a.load_session("s") is None
        held = await a.reserve("w1", "w2", 10, "handoff", lease_s=0.05)
        assert held is not None and held.local_only
        await asyncio.sleep(0.06)
        assert a.link_views() == {}  # a local lease expires like a shared one


async def test_pending_writes_are_bounded(socket_path: Path) -> None:
    url = f"unix://{socket_path}"
    async with running(url, "bnd", "a", max_pending_writes=2) as a:
        assert a.degraded
        oldest = a.commit_session("s1", "w1", 1, 1, 0)
        a.commit_session("s2", "w1", 1, 1, 0)
        assert a.cached_session("s1") is not UNKNOWN
        a.commit_session("s3", "w1", 1, 1, 0)
        assert oldest.result() == CommitResult(ok=False, record=None)
        assert a.cached_session("s1") is UNKNOWN  # the dropped write's guess is forgotten
        assert a.cached_session("s3") is not UNKNOWN
