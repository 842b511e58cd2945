"""Fixtures of the fault suite: long-lived simulated workers nobody kills, each test's own
processes, and the suite's table, printed once the module's tests are done."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import SimCluster, start_sim_cluster
from tests.faults.harness import HEADER, Fleet, Row, format_row


@pytest.fixture(scope="module")
def steady() -> Iterator[SimCluster]:
    """Three simulated workers in one process, never killed: the survivors of every fault."""
    cluster = start_sim_cluster(3)
    yield cluster
    cluster.process.stop()


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    """The processes a test starts (workers it kills, routers), all stopped at its end."""
    started = Fleet()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def table() -> Iterator[list[Row]]:
    rows: list[Row] = []
    yield rows
    if rows:
        print("\n\nfault suite\n" + HEADER + "\n" + "\n".join(format_row(row) for row in rows))
