"""Shared fixtures: a real Redis (REDIS_URL, else an embedded server) and free ports."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from bench.stack.up import free_port_block
from router.state.embedded_redis import EmbeddedRedis


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
    """A port for a child process to listen on, outside the range outgoing connections use."""
    return free_port_block("127.0.0.1", 1)


@pytest.fixture
def unused_port() -> int:
    return free_port()
