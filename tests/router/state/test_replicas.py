"""Several replicas over one Redis: the link ledger, in-flight counts and worker records."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import time
from functools import partial
from pathlib import Path

import pytest

from router.state.shared import LinkState, SharedState
from tests.router.state.test_shared import eventually, prefix, running, worker

__all__ = ["prefix"]  # the fixture, imported for pytest

LINK = ("w1", "w2")
REPO = Path(__file__).resolve().parents[3]


def link(state: SharedState) -> LinkState:
    return state.link_views().get(LINK) or LinkState(src=LINK[0], dst=LINK[1])


def has_observed(state: SharedState, bps: float | None) -> bool:
    return link(state).observed_bps == bps


async def test_handoff_reservation_is_shared_then_released(redis_url: str, prefix: str) -> None:
    async with running(redis_url, prefix, "a") as a, running(redis_url, prefix, "b") as b:
        held = await a.reserve(*LINK, 4096, "handoff")
        assert held is not None and not held.local_only
        assert (held.src, held.dst, held.nbytes, held.kind) == ("w1", "w2", 4096, "handoff")
        assert held.expires_at == pytest.approx(time.time() + 30, abs=2)
        assert (link(a).handoff_bytes, link(a).reservations) == (4096, 1)  # no refresh needed
        await eventually(lambda: (link(b).handoff_bytes, link(b).reservations) == (4096, 1))
        a.release(held, 4096, 0.0)
        assert (link(a).handoff_bytes, link(a).reservations) == (0, 0)
        await eventually(lambda: (link(b).handoff_bytes, link(b).reservations) == (0, 0))
        assert link(b).observed_bps == 0.0  # no duration, no rate sample


async def test_a_handoff_reservation_waits_for_no_round_trip(redis_url: str, prefix: str) -> None:
    """A handoff is always admitted: its turn's path waits for nothing. The replica's view
    counts it at once, the ledger from the next batch; its release, queued before that
    batch, follows it there (and brings its rate sample)."""
    roundtrips: list[str] = []
    async with (
        running(redis_url, prefix, "a", on_roundtrip=lambda kind, _: roundtrips.append(kind),
                batch_interval_s=0.3) as a,
        running(redis_url, prefix, "b") as b,
    ):  # fmt: skip
        roundtrips.clear()
        held = await a.reserve(*LINK, 4096, "handoff")
        assert held is not None and not held.local_only
        assert roundtrips == []
        assert (link(a).handoff_bytes, link(a).reservations) == (4096, 1)
        await eventually(lambda: (link(b).handoff_bytes, link(b).reservations) == (4096, 1))
        second = await a.reserve(*LINK, 1000, "handoff")
        assert second is not None
        a.release(second, 1000, 0.5)
        assert (link(a).handoff_bytes, link(a).reservations) == (4096, 1)
        await eventually(lambda: link(b).observed_bps == 2000.0)
        assert (link(b).handoff_bytes, link(b).reservations) == (4096, 1)
        a.release(held, 4096, 0.0)
        await eventually(lambda: (link(b).handoff_bytes, link(b).reservations) == (0, 0))
        assert (link(a).handoff_bytes, link(a).reservations) == (0, 0)


async def test_a_lease_expires_without_release(redis_url: str, prefix: str) -> None:
    async with running(redis_url, prefix, "a") as a, running(redis_url, prefix, "b") as b:
        held = await a.reserve(*LINK, 1000, "handoff", lease_s=1.0)
        assert held is not None
        await eventually(lambda: link(b).reservations == 1)
        await eventually(lambda: link(b).reservations == 0, within=5)
        assert time.time() >= held.expires_at - 0.01  # gone by lease, not earlier
        assert link(b).handoff_bytes == 0
        await eventually(lambda: (link(a).reservations, link(a).handoff_bytes) == (0, 0))


# capacity 1000 B/s, lease 1 s: a migration may use what is left of 1000 bytes
@pytest.mark.parametrize(
    ("handoffs", "migrations", "nbytes", "admitted"),
    [
        ([], [], 1000, True),
        ([], [], 1001, False),
        ([600], [], 400, True),
        ([600], [], 401, False),
        ([600], [300], 100, True),
        ([600], [300], 101, False),
        ([700, 1300], [], 1, False),  # handoffs are admitted even past capacity
    ],
)
async def test_migration_admission(
    redis_url: str,
    prefix: str,
    handoffs: list[int],
    migrations: list[int],
    nbytes: int,
    admitted: bool,
) -> None:
    async with running(redis_url, prefix, "a") as a, running(redis_url, prefix, "b") as b:
        a.set_link_capacity(*LINK, 1000.0)
        await eventually(lambda: link(b).capacity_bps == 1000.0)
        for size in handoffs:  # another replica's handoffs count too
            assert await b.reserve(*LINK, size, "handoff", lease_s=1.0) is not None
        # once in the ledger: a handoff reaches it with its replica's next batch
        await eventually(lambda: link(a).handoff_bytes == sum(handoffs))
        for size in migrations:
            assert await a.reserve(*LINK, size, "migration", lease_s=1.0) is not None
        result = await a.reserve(*LINK, nbytes, "migration", lease_s=1.0)
        assert (result is not None) is admitted
        view = link(a)
        assert view.handoff_bytes == sum(handoffs)
        assert view.migration_bytes == sum(migrations) + (nbytes if admitted else 0)


async def test_migration_without_known_capacity(redis_url: str, prefix: str) -> None:
    async with running(redis_url, prefix, "a") as a:
        # nothing known: admitted only onto an idle link
        first = await a.reserve(*LINK, 10**9, "migration")
        assert first is not None
        assert await a.reserve(*LINK, 1, "migration") is None
        # with an observed rate (1000 B/s from this transfer), that rate is the capacity
        a.release(first, 1000, 1.0)
        await eventually(lambda: link(a).observed_bps == 1000.0 and link(a).reservations == 0)
        assert await a.reserve(*LINK, 2000, "migration", lease_s=2.0) is not None
        assert await a.reserve(*LINK, 1, "migration", lease_s=2.0) is None


@pytest.mark.parametrize("alpha", [0.3, 0.05, 0.5, 1.0])
async def test_observed_bandwidth_is_an_exact_ewma(
    redis_url: str, prefix: str, alpha: float
) -> None:
    samples = [(10**9, 0.1), (5 * 10**8, 0.2), (3 * 10**9, 0.25), (7, 0.003)]
    async with (
        running(redis_url, prefix, "a", ewma_alpha=alpha) as a,
        running(redis_url, prefix, "b") as b,
    ):
        expected: float | None = None
        for transferred, seconds in samples:
            held = await a.reserve(*LINK, transferred, "handoff")
            assert held is not None
            a.release(held, transferred, seconds)
            rate = transferred / seconds
            expected = rate if expected is None else alpha * rate + (1 - alpha) * expected
            await eventually(partial(has_observed, a, expected))
        await eventually(lambda: link(b).observed_bps == expected)


async def test_inflight_counts_sum_over_replicas(redis_url: str, prefix: str) -> None:
    async with running(redis_url, prefix, "a") as a:
        async with running(redis_url, prefix, "b") as b:
            a.add_inflight("w1", 3)
            a.add_inflight("w2", 1)
            b.add_inflight("w1", 2)
            assert a.fleet_inflight() == {"w1": 3, "w2": 1}  # own counts at once
            await eventually(lambda: a.fleet_inflight() == b.fleet_inflight() == {"w1": 5, "w2": 1})
            a.add_inflight("w1", -3)
            await eventually(lambda: b.fleet_inflight() == {"w1": 2, "w2": 1})
        # b closed: its counts leave the sum at a's next refresh
        await eventually(lambda: a.fleet_inflight() == {"w2": 1})


async def test_a_crashed_replica_leaves_the_sum_by_ttl(redis_url: str, prefix: str) -> None:
    script = textwrap.dedent(
        f"""
        import asyncio
        from router.state.shared import SharedState, StateConfig

        async def main():
            config = StateConfig(url={redis_url!r}, prefix={prefix!r}, replica_id="doomed",
                                 refresh_interval_s=0.05)
            state = SharedState(config)
            await state.start()
            state.add_inflight("w1", 7)
            await asyncio.sleep(0.2)
            print("ready", flush=True)
            await asyncio.sleep(60)

        asyncio.run(main())
        """
    )
    async with running(redis_url, prefix, "a") as a:
        a.add_inflight("w1", 1)
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE,
            cwd=REPO,
        )  # fmt: skip
        try:
            assert process.stdout is not None
            assert await asyncio.wait_for(process.stdout.readline(), 30) == b"ready\n"
            await eventually(lambda: a.fleet_inflight() == {"w1": 8})
        finally:
            process.kill()  # no close(), no cleanup: only the TTL can remove its counts
            await process.wait()
        took = await eventually(lambda: a.fleet_inflight() == {"w1": 1}, within=5)
        assert 0.7 <= took  # in-flight TTL is 1 s after its last heartbeat


async def test_worker_records_are_shared_and_the_newest_scrape_wins(
    redis_url: str, prefix: str
) -> None:
    now = time.time()
    async with running(redis_url, prefix, "a") as a, running(redis_url, prefix, "b") as b:
        fresh = worker("w1", now, running_=5)
        a.publish_worker(fresh)
        assert a.fleet_workers() == {"w1": fresh}
        await eventually(lambda: b.fleet_workers() == {"w1": fresh})
        b.publish_worker(worker("w1", now - 10, running_=1))  # a slower replica's older scrape
        assert b.fleet_workers() == {"w1": fresh}
        newer = worker("w1", now + 1, running_=9)
        b.publish_worker(newer)
        await eventually(lambda: a.fleet_workers() == b.fleet_workers() == {"w1": newer})


async def test_worker_records_expire(redis_url: str, prefix: str) -> None:
    async with (
        running(redis_url, prefix, "a", worker_ttl_s=0.3) as a,
        running(redis_url, prefix, "b") as b,
    ):
        a.publish_worker(worker("w1", time.time()))
        await eventually(lambda: set(b.fleet_workers()) == {"w1"})
        await eventually(lambda: b.fleet_workers() == {} == a.fleet_workers(), within=3)
