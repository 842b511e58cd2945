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


# The suites (`make unit` runs the unit suite; `make test` all three). A test is e2e when it
# starts our command line as processes, slow when it runs many generated cases or long
# real-time sequences, and unit otherwise.
E2E_PATHS = (
    "tests/e2e/",
    "tests/bench/stack/test_up.py",
    "tests/bench/test_compare.py",
    "tests/bench/replay/test_run.py",
    "tests/sim/test_sim_worker_processes.py",
    "tests/sim/worker/test_vllm_conformance.py",
    "tests/experiments/test_live_acceptance.py",
    "tests/test_install_extras.py",
    "tests/router/state/test_cluster.py",
)
# real vLLM engines (`make test-real`, after `make real-engines`): not in `make test`
REAL_ENGINE_PATHS = ("tests/real_engine/",)
SLOW_PATHS = (
    "tests/policies/test_properties.py",
    "tests/policies/adaptive/test_properties.py",
    "tests/bench/des/test_ledger_vs_lua.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = config.rootpath
    for item in items:
        path = item.path.relative_to(root).as_posix()
        if path.startswith(E2E_PATHS):
            item.add_marker(pytest.mark.e2e)
        if path.startswith(SLOW_PATHS):
            item.add_marker(pytest.mark.slow)
        if path.startswith(REAL_ENGINE_PATHS):
            item.add_marker(pytest.mark.real_engine)
        elif item.get_closest_marker("e2e") is None and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.unit)
