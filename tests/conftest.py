"""Shared fixtures: a real Redis (REDIS_URL, else an embedded server) and free ports."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from router.embedded_redis import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """REDIS_URL from the environment when set, else a private embedded redis-server."""
    external = os.environ.get("REDIS_URL")
    if external:
        yield external
        return
    with EmbeddedRedis() as url:
        yield url


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def unused_port() -> int:
    return free_port()
