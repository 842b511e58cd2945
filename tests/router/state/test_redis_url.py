"""Redis URLs, including Sentinel, against real redis-server processes."""

from __future__ import annotations

import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from router.state.embedded_redis import redis_server_binary
from router.state.redis_url import open_redis
from router.state.shared import SharedState, StateConfig
from tests.conftest import free_port


def _wait_port(port: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing listens on {port}")


@pytest.fixture
def sentinel_url(tmp_path: Path) -> Iterator[str]:
    primary, sentinel = free_port(), free_port()
    config = tmp_path / "sentinel.conf"
    config.write_text(
        f"port {sentinel}\nbind 127.0.0.1\ndir {tmp_path}\n"
        f"sentinel monitor primary-a 127.0.0.1 {primary} 1\n"
        "sentinel down-after-milliseconds primary-a 5000\n"
    )
    processes = [
        subprocess.Popen([redis_server_binary(), "--port", str(primary), "--bind", "127.0.0.1",
                          "--save", "", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL),
        subprocess.Popen([redis_server_binary(), str(config), "--sentinel"],
                         stdout=subprocess.DEVNULL),
    ]  # fmt: skip
    try:
        _wait_port(primary)
        _wait_port(sentinel)
        # the sentinel knows the primary once it answers for it
        probe = redis.Redis(port=sentinel)
        deadline = time.monotonic() + 10
        while probe.execute_command("SENTINEL", "get-master-addr-by-name", "primary-a") is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        probe.close()
        yield f"redis+sentinel://127.0.0.1:{sentinel}/primary-a/0"
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=10)


async def test_shared_state_works_through_a_sentinel_url(sentinel_url: str) -> None:
    prefix = f"sentinel-{uuid.uuid4().hex[:6]}"
    first = SharedState(StateConfig(url=sentinel_url, prefix=prefix))
    second = SharedState(StateConfig(url=sentinel_url, prefix=prefix))
    await first.start()
    await second.start()
    try:
        assert await first.ping()
        result = await first.commit_session("s1", "worker-a", 100, 12800, 0)
        assert result.ok
        record = await second.load_session("s1")
        assert record is not None and record.worker_id == "worker-a" and record.epoch == 1
        assert not first.degraded and not second.degraded
    finally:
        await first.close()
        await second.close()


@pytest.mark.parametrize(
    "url",
    ["redis+sentinel://127.0.0.1:26379", "redis+sentinel://127.0.0.1/primary",
     "redis+sentinel://127.0.0.1:x/primary"],
)  # fmt: skip
def test_malformed_sentinel_urls_are_refused_with_the_reason(url: str) -> None:
    with pytest.raises(ValueError, match=r"(?i)sentinel"):
        open_redis(url)
