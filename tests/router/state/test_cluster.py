"""The shared state on a Redis Cluster of three primaries, started here: sessions spread over
the primaries by bucket, each script touches one slot, invalidations reach every replica."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from bench.stack.redis_cluster import LocalCluster, free_ports
from router.state.embedded_redis import redis_server_binary
from router.state.keys import SESSION_BUCKETS, Keys
from router.state.redis_url import is_cluster
from router.state.shared import CommitResult
from tests.conftest import free_port
from tests.router.state.test_shared import eventually, running, worker


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Three primaries, slots split in thirds; a redis+cluster:// URL naming two of them."""
    ports = free_ports(3)
    with LocalCluster(redis_server_binary(), ports, tmp_path_factory.mktemp("cluster")):
        yield f"redis+cluster://127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}"


@pytest.fixture
async def prefix(cluster_url: str) -> AsyncIterator[str]:
    name = f"ct-{uuid.uuid4().hex[:10]}"
    yield name
    client = await admin(cluster_url)
    try:
        for node in client.get_primaries():
            found = [key async for key in client.scan_iter(
                match=Keys(name, cluster=True).pattern(), target_nodes=node)]  # fmt: skip
            for key in found:
                await client.delete(key)
    finally:
        await client.aclose()


def test_the_url_names_a_cluster() -> None:
    assert is_cluster("redis+cluster://a:1,b:2") and is_cluster("rediss+cluster://a:1")
    assert not is_cluster("redis://a:1") and not is_cluster("redis+sentinel://a:1/m")


def test_fleet_keys_share_a_slot_and_sessions_spread_over_the_buckets() -> None:
    keys = Keys("sr", cluster=True)
    _, link, lease, resv = keys.link("p0", "d0")
    fleet = [keys.worker("w"), keys.inflight("r"), link, lease, resv, keys.workers_index,
             keys.replicas_index, keys.links_index]  # fmt: skip
    assert {key_slot(key.encode()) for key in fleet} == {key_slot(b"sr")}
    sessions = [f"session-{i}" for i in range(2000)]
    buckets = {keys.bucket(s) for s in sessions}
    assert buckets == set(range(SESSION_BUCKETS))
    for session in sessions[:200]:
        # a session's key is in its bucket's slot: one script call per bucket
        bucket_slot = key_slot(keys.session_prefix_of(keys.bucket(session)).encode())
        assert key_slot(keys.session(session).encode()) == bucket_slot
    # standalone names stay as they were
    plain = Keys("sr")
    assert (plain.session("s"), plain.worker("w")) == ("sr:session:s", "sr:worker:w")
    assert plain.buckets == 1
    with pytest.raises(ValueError, match="braces"):
        Keys("a{b}", cluster=True)


async def test_sessions_commit_and_load_across_replicas_and_primaries(
    cluster_url: str, prefix: str
) -> None:
    async with running(cluster_url, prefix, "a") as a, running(cluster_url, prefix, "b") as b:
        results = await asyncio.gather(*(
            a.commit_session(f"s{i}", f"w{i % 3}", 100 + i, 1000, expected_epoch=0)
            for i in range(60)
        ))  # fmt: skip
        assert all(r.ok for r in results)
        for i in (0, 17, 59):
            loaded = await b.load_session(f"s{i}")
            assert loaded is not None
            assert (loaded.worker_id, loaded.tokens) == (f"w{i % 3}", 100 + i)
        # a compare-and-set still has one winner
        both = await asyncio.gather(
            a.commit_session("s0", "wa", 1, 1, expected_epoch=1),
            b.commit_session("s0", "wb", 2, 2, expected_epoch=1),
        )
        assert sorted(r.ok for r in both) == [False, True]
    holders = await _session_keys_per_primary(cluster_url, prefix)
    assert len(holders) == 3 and sum(holders.values()) == 60, holders


async def test_an_invalidation_from_any_primary_reaches_every_replica(
    cluster_url: str, prefix: str
) -> None:
    async with running(cluster_url, prefix, "a") as a, running(cluster_url, prefix, "b") as b:
        sessions = [f"inv-{i}" for i in range(12)]  # over several buckets and primaries
        for session in sessions:
            first = await a.commit_session(session, "w1", 10, 100, 0)
            assert first.record is not None
            assert await b.load_session(session) == first.record
        moved = [a.commit_session(s, "w2", 30, 300, 1) for s in sessions]
        await eventually(lambda: all(_owner(b.cached_session(s)) == "w2" for s in sessions))
        assert all(r.ok for r in await asyncio.gather(*moved))
        cleared = await a.clear_session(sessions[0], 2)
        assert cleared == CommitResult(ok=True, record=None)
        await eventually(lambda: b.cached_session(sessions[0]) is None)


async def test_workers_inflight_and_link_ledgers_on_the_fleet_slot(
    cluster_url: str, prefix: str
) -> None:
    async with running(cluster_url, prefix, "a") as a, running(cluster_url, prefix, "b") as b:
        a.publish_worker(worker("w1", time.time(), running_=3))
        a.set_link_capacity("p0", "d0", 1e9)
        a.add_inflight("w1", 2)
        held = await a.reserve("p0", "d0", 4000, "handoff")
        assert held is not None
        await eventually(lambda: "w1" in b.fleet_workers())
        await eventually(lambda: b.fleet_inflight().get("w1", 0) == 2)
        await eventually(lambda: b.link_views().get(("p0", "d0")) is not None
                         and b.link_views()[("p0", "d0")].handoff_bytes == 4000)  # fmt: skip
        a.release(held, 4000, 0.001)
        await eventually(lambda: b.link_views()[("p0", "d0")].handoff_bytes == 0)
    client = await admin(cluster_url)
    try:
        fleet_node = client.get_node_from_key(f"{{{prefix}}}")
        keys = [key async for key in client.scan_iter(match=f"{{{prefix}}}:*",
                                                       target_nodes=fleet_node)]  # fmt: skip
        kinds = {key.decode().split(":")[1] for key in keys}
        # (an empty lease set and reservation hash go with their last lease)
        assert {"worker", "link", "index"} <= kinds
        assert all([await client.pttl(key) > 0 for key in keys])
    finally:
        await client.aclose()


async def test_an_unreachable_cluster_degrades_and_the_view_serves(
    cluster_url: str, prefix: str
) -> None:
    # a state whose only node refuses: degraded at once, reads from the view, nothing raises
    refused = f"redis+cluster://127.0.0.1:{free_port()}"
    async with running(refused, prefix, "x") as lone:
        assert lone.degraded
        assert await asyncio.wait_for(lone.load_session("s"), 5) is None
        pending = lone.commit_session("s", "w1", 1, 1, 0)  # queued until Redis answers
        assert _owner(lone.cached_session("s")) == "w1"  # the view answers meanwhile
    assert (await pending).ok is False  # closed before Redis came back: dropped, and said so


async def admin(url: str) -> RedisCluster:
    """A client of the cluster the URL names, its slot map read."""
    client = RedisCluster.from_url(url.replace("redis+cluster", "redis").split(",")[0])
    await client.initialize()
    assert len(client.get_primaries()) == 3
    return client


def _owner(record: object) -> str | None:
    return getattr(record, "worker_id", None)


async def _session_keys_per_primary(url: str, prefix: str) -> dict[str, int]:
    client = await admin(url)
    try:
        found: dict[str, int] = {}
        for node in client.get_primaries():
            count = 0
            async for key in client.scan_iter(match=f"{{{prefix}.s*", target_nodes=node):
                assert b":session:" in key
                count += 1
            if count:
                found[node.name] = count
        return found
    finally:
        await client.aclose()


async def test_two_routers_share_a_session_owner_over_the_cluster(cluster_url: str) -> None:
    from tests.router.turn.fake_upstream import Stack, eventually, spec

    async with Stack(cluster_url) as stack:
        a, b = await stack.worker("a"), await stack.worker("b")
        shared = f"rt-{uuid.uuid4().hex[:8]}"
        first = await stack.router([spec(a), spec(b)], "colocate", redis_prefix=shared)
        second = await stack.router([spec(a), spec(b)], "colocate", redis_prefix=shared)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        answered_by = []
        routers = (first, second, first)
        for turn, router in enumerate(routers):
            async with stack.http.post(router.url + "/v1/chat/completions", json=body,
                                       headers={"X-Session-ID": "shared"}) as response:  # fmt: skip
                assert response.status == 200
                reply = await response.json()
            answered_by.append(reply["choices"][0]["message"]["content"].split()[0][:-1])
            other = routers[(turn + 1) % len(routers)]

            async def committed(other: object = other, turns: int = turn + 1) -> bool:
                status, record = await other.session(stack.http, "shared")  # type: ignore[attr-defined]
                return bool(status == 200 and record["turns"] == turns)

            await eventually(committed)  # the commit is written after the answer
        # colocate keeps a session where its KV is: the same worker whichever router it hits
        assert len(set(answered_by)) == 1
