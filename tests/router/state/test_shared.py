"""SharedState against a real Redis: sessions, CAS, invalidation, batching, TTLs."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from redis.asyncio import Redis

from router.state.keys import Keys
from router.state.shared import (
    UNKNOWN,
    CommitResult,
    SessionRecord,
    SharedState,
    StateConfig,
    WorkerRecord,
)

# helpers shared by the other state test modules


@pytest.fixture
async def prefix(redis_url: str) -> AsyncIterator[str]:
    """A fresh key prefix per test; every key under it is deleted afterwards."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    client = Redis.from_url(redis_url)
    try:
        keys = [key async for key in client.scan_iter(match=Keys(name).pattern())]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


@asynccontextmanager
async def running(
    url: str,
    prefix: str,
    replica_id: str,
    on_roundtrip: Callable[[str, float], None] | None = None,
    on_degraded: Callable[[bool], None] | None = None,
    **overrides: Any,
) -> AsyncIterator[SharedState]:
    settings: dict[str, Any] = {"refresh_interval_s": 0.05, **overrides}
    config = StateConfig(url=url, prefix=prefix, replica_id=replica_id, **settings)
    state = SharedState(config, on_roundtrip=on_roundtrip, on_degraded=on_degraded)
    await state.start()
    try:
        yield state
    finally:
        await state.close()


async def eventually(check: Callable[[], bool], within: float = 2.0) -> float:
    """Poll `check` until true; returns the seconds it took (fails after `within` s)."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > within:
            raise AssertionError(f"condition not met within {within} s")
        await asyncio.sleep(0.002)
    return time.monotonic() - started


def worker(worker_id: str, scraped_at: float, running_: int = 0) -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id,
        role="decode",
        url=f"http://{worker_id}:8000",
        running=running_,
        waiting=1,
        kv_usage=0.25,
        scraped_at=scraped_at,
        scraped_by="test",
    )


# sessions


async def test_commit_then_load_on_another_replica(redis_url: str, prefix: str) -> None:
    async with (
        running(redis_url, prefix, "a") as a,
        running(redis_url, prefix, "b") as b,
    ):
        assert a.cached_session("s1") is UNKNOWN
        assert await a.load_session("s1") is None
        assert a.cached_session("s1") is None
        result = await a.commit_session("s1", "w1", 1000, 131072000, expected_epoch=0)
        assert result.ok
        record = result.record
        assert record is not None
        assert (record.worker_id, record.tokens, record.bytes, record.turns, record.epoch) == (
            "w1", 1000, 131072000, 1, 1
        )  # fmt: skip
        assert abs(record.last_seen - time.time()) < 5
        assert await b.load_session("s1") == record
        assert b.cached_session("s1") == record
        assert a.cached_session("s1") == record


async def test_concurrent_cas_has_exactly_one_winner(redis_url: str, prefix: str) -> None:
    async with (
        running(redis_url, prefix, "a") as a,
        running(redis_url, prefix, "b") as b,
    ):
        await a.load_session("s")
        await b.load_session("s")
        results = await asyncio.gather(
            a.commit_session("s", "wa", 10, 100, expected_epoch=0),
            b.commit_session("s", "wb", 20, 200, expected_epoch=0),
        )
        assert sorted(r.ok for r in results) == [False, True]
        winner = next(r for r in results if r.ok)
        loser = next(r for r in results if not r.ok)
        assert winner.record is not None and winner.record.epoch == 1
        assert loser.record == winner.record
        await eventually(lambda: a.cached_session("s") == b.cached_session("s") == winner.record)


@pytest.mark.parametrize(
    ("stored_turns", "expected_epoch", "ok", "epoch_after"),
    [
        (0, 0, True, 1),  # new session
        (2, 2, True, 3),  # the epoch we read
        (2, 1, False, 2),  # stale: someone committed since
        (2, 3, False, 2),  # from the future: never matches
        (2, 0, False, 2),  # 0 only matches a session with no residency
    ],
)
async def test_commit_is_a_compare_and_set_on_the_epoch(
    redis_url: str, prefix: str, stored_turns: int, expected_epoch: int, ok: bool, epoch_after: int
) -> None:
    async with running(redis_url, prefix, "a") as a, running(redis_url, prefix, "b") as b:
        for epoch in range(stored_turns):
            assert (await b.commit_session("s", "old", 5, 50, epoch)).ok
        result = await a.commit_session("s", "new", 7, 70, expected_epoch)
        assert result.ok is ok
        assert result.record is not None and result.record.epoch == epoch_after
        assert result.record.worker_id == ("new" if ok else "old")
        assert (await b.load_session("s")) == result.record


async def test_clear_session_removes_residency_and_keeps_the_epoch(
    redis_url: str, prefix: str
) -> None:
    async with running(redis_url, prefix, "a") as a, running(redis_url, prefix, "b") as b:
        first = await a.commit_session("s", "w1", 10, 100, 0)
        assert first.record is not None
        cleared = await a.clear_session("s", first.record.epoch)
        assert cleared == CommitResult(ok=True, record=None)
        assert a.cached_session("s") is None
        assert await b.load_session("s") is None
        # a stale clear loses; a commit after "no residency" passes 0 and continues the epoch
        assert (await b.clear_session("s", first.record.epoch)).ok is False
        again = await b.commit_session("s", "w2", 20, 200, 0)
        assert again.ok and again.record is not None
        assert (again.record.epoch, again.record.turns, again.record.worker_id) == (3, 2, "w2")
        assert (await a.clear_session("never-seen", 0)) == CommitResult(ok=True, record=None)


async def test_invalidation_reaches_another_replica_quickly(redis_url: str, prefix: str) -> None:
    async with running(redis_url, prefix, "a") as a, running(redis_url, prefix, "b") as b:
        first = await a.commit_session("s", "w1", 10, 100, 0)
        assert first.record is not None
        assert await b.load_session("s") == first.record
        moved = a.commit_session("s", "w2", 30, 300, first.record.epoch)
        # B awaits nothing but the event loop: the invalidation alone updates its view
        took = await eventually(lambda: _owner(b.cached_session("s")) == "w2", within=0.2)
        assert took < 0.2
        result = await moved
        assert b.cached_session("s") == result.record


async def test_a_returning_session_needs_no_round_trip(redis_url: str, prefix: str) -> None:
    kinds: Counter[str] = Counter()
    async with running(redis_url, prefix, "a", on_roundtrip=lambda k, _: kinds.update([k])) as a:
        assert await a.load_session("s") is None
        assert kinds["load_session"] == 1
        pending = []
        for turn in range(20):
            cached = a.cached_session("s")
            assert cached is not UNKNOWN
            epoch = 0 if cached is None else cached.epoch
            pending.append(a.commit_session("s", "w1", 100 * (turn + 1), 0, epoch))
            await asyncio.sleep(0.001 * (turn % 3))  # some turns land in the same batch
        results = await asyncio.gather(*pending)
        assert all(r.ok for r in results)
        assert kinds["load_session"] == 1
        assert kinds["reserve"] == 0
        final = a.cached_session("s")
        assert isinstance(final, SessionRecord)
        assert (final.turns, final.epoch, final.tokens) == (20, 20, 2000)


async def test_the_session_view_is_a_bounded_lru(redis_url: str, prefix: str) -> None:
    async with running(redis_url, prefix, "a", session_cache_size=3) as a:
        for session_id in ("s1", "s2", "s3"):
            await a.load_session(session_id)
        assert a.cached_session("s1") is None  # a hit makes s1 the most recently used
        await a.load_session("s4")
        answers = {s: a.cached_session(s) for s in ("s1", "s2", "s3", "s4")}
        assert answers == {"s1": None, "s2": UNKNOWN, "s3": None, "s4": None}


async def test_commits_share_pipelined_batches(redis_url: str, prefix: str) -> None:
    kinds: Counter[str] = Counter()
    async with running(redis_url, prefix, "a", on_roundtrip=lambda k, _: kinds.update([k])) as a:
        before = kinds["batch"]

        async def turn(i: int) -> CommitResult:
            return await a.commit_session(f"s{i}", f"w{i % 8}", i, i * 10, 0)

        results = await asyncio.gather(*(turn(i) for i in range(500)))
        assert all(r.ok for r in results)
        assert [r.record.tokens for r in results if r.record] == list(range(500))
        assert kinds["batch"] - before <= 50


async def test_one_batch_over_several_script_calls_keeps_each_verdict(
    redis_url: str, prefix: str
) -> None:
    async with (
        running(redis_url, prefix, "a", batch_interval_s=0.2) as a,
        running(redis_url, prefix, "b") as b,
    ):
        assert (await b.commit_session("taken", "wb", 5, 50, 0)).ok
        commits = [a.commit_session(f"s{i}", f"w{i % 3}", i, i * 7, 0) for i in range(600)]
        stale = a.commit_session("taken", "wa", 1, 10, expected_epoch=7)  # b holds epoch 1
        results = await asyncio.gather(*commits)
        assert all(r.ok for r in results)
        assert [(r.record.worker_id, r.record.bytes) for r in results if r.record] == [
            (f"w{i % 3}", i * 7) for i in range(600)
        ]
        lost = await stale
        assert not lost.ok and lost.record is not None and lost.record.worker_id == "wb"
        for i in (0, 255, 256, 599):
            record = await b.load_session(f"s{i}")
            assert record is not None and (record.tokens, record.epoch) == (i, 1)


async def test_a_later_write_on_the_same_epoch_replaces_a_pending_one(
    redis_url: str, prefix: str
) -> None:
    async with running(redis_url, prefix, "a") as a:
        replaced = a.commit_session("s", "w1", 10, 100, 0)
        latest = a.commit_session("s", "w2", 20, 200, 0)
        lost, won = await asyncio.gather(replaced, latest)
        assert won.ok and won.record is not None
        assert (won.record.worker_id, won.record.turns, won.record.epoch) == ("w2", 1, 1)
        assert lost == CommitResult(ok=False, record=won.record)
        assert a.cached_session("s") == won.record


async def test_chained_turns_merge_and_a_conflicting_write_loses(
    redis_url: str, prefix: str
) -> None:
    async with running(redis_url, prefix, "a") as a:
        first = a.commit_session("s", "w1", 10, 100, 0)
        second = a.commit_session("s", "w2", 20, 200, 1)  # builds on the first
        third = a.commit_session("s", "w3", 30, 300, 2)  # builds on the second
        rival = a.commit_session("s", "w4", 40, 400, 2)  # races the third
        results = await asyncio.gather(first, second, third, rival)
        final = results[2].record
        assert final is not None
        assert (final.worker_id, final.tokens, final.turns, final.epoch) == ("w3", 30, 3, 3)
        assert list(results[:3]) == [CommitResult(ok=True, record=final)] * 3
        assert results[3] == CommitResult(ok=False, record=final)
        assert a.cached_session("s") == final


async def test_commits_nobody_waits_for_land_and_correct_the_view_alike(
    redis_url: str, prefix: str
) -> None:
    async with (
        running(redis_url, prefix, "a") as a,
        running(redis_url, prefix, "b") as b,
    ):
        assert (await b.commit_session("taken", "wb", 5, 50, 0)).ok
        a.commit_session_nowait("s", "w1", 10, 100, 0)
        a.commit_session_nowait("s", "w2", 20, 200, 1)  # chains on the first, same batch
        waited = a.commit_session("other", "w3", 30, 300, 0)  # shares the batch
        a.commit_session_nowait("taken", "wa", 1, 10, 0)  # loses: b holds epoch 1
        a.commit_session_nowait("gone", "w1", 7, 70, 0)
        a.clear_session_nowait("gone", 1)
        assert a.cached_session("s") is not UNKNOWN  # the optimistic guess, at once
        assert (await waited).ok
        await eventually(lambda: a.cached_session("taken") == b.cached_session("taken"))
        stored = await b.load_session("s")
        assert stored is not None
        assert (stored.worker_id, stored.tokens, stored.turns, stored.epoch) == ("w2", 20, 2, 2)
        assert a.cached_session("s") == stored
        taken = await b.load_session("taken")
        assert taken is not None and taken.worker_id == "wb"
        assert await b.load_session("gone") is None


async def test_every_key_written_has_a_ttl(redis_url: str, prefix: str) -> None:
    async with running(redis_url, prefix, "a") as a:
        await a.commit_session("s1", "w1", 1, 1, 0)
        await a.commit_session("s2", "w1", 1, 1, 0)
        await a.clear_session("s2", 1)
        a.publish_worker(worker("w1", time.time()))
        a.set_link_capacity("w1", "w2", 1e9)
        a.add_inflight("w1", 2)
        held = await a.reserve("w1", "w2", 1000, "handoff")
        done = await a.reserve("w2", "w1", 1000, "migration")
        assert held is not None and done is not None
        a.release(done, 1000, 0.001)
        await eventually(lambda: a.link_views()[("w2", "w1")].observed_bps > 0)
        await eventually(lambda: a.fleet_workers().keys() == {"w1"})
        client = Redis.from_url(redis_url)
        try:
            deadline = time.monotonic() + 2
            while not await client.exists(Keys(prefix).inflight("a")):  # the next heartbeat
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            keys = [key async for key in client.scan_iter(match=Keys(prefix).pattern())]
            kinds = {key.decode().split(":")[1] for key in keys}
            assert kinds == {"session", "worker", "inflight", "link", "lease", "resv", "index"}
            ttls = {key: await client.pttl(key) for key in keys}
            assert all(ttl > 0 for ttl in ttls.values()), ttls
        finally:
            await client.aclose()


@pytest.mark.parametrize(
    "change",
    [
        {"ewma_alpha": 0.0},
        {"ewma_alpha": 1.5},
        {"refresh_interval_s": 0.0},
        {"session_cache_size": 0},
        {"batch_interval_s": -1.0},
        {"prefix": ""},
    ],
)
def test_config_rejects_nonsense(change: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        StateConfig(url="redis://localhost", **change)


def test_replicas_get_distinct_default_ids() -> None:
    ids = {StateConfig(url="redis://localhost").replica_id for _ in range(50)}
    assert len(ids) == 50


def _owner(answer: object) -> str | None:
    return answer.worker_id if isinstance(answer, SessionRecord) else None
