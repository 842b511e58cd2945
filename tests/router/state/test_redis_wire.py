from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from router.state.redis_wire import LeanTarget, RespConnection, lean_target


@pytest.mark.parametrize(
    ("url", "target"),
    [
        ("redis://10.0.0.7:6380/2", LeanTarget(host="10.0.0.7", port=6380, db=2)),
        ("redis://u:p%40ss@h", LeanTarget(host="h", username="u", password="p@ss")),
        ("redis://:pw@h:1/3", LeanTarget(host="h", port=1, password="pw", db=3)),
        ("unix:///run/redis.sock?db=4", LeanTarget(path="/run/redis.sock", db=4)),
        ("unix://:pw@/run/redis.sock", LeanTarget(path="/run/redis.sock", password="pw")),
        ("rediss://h:6380/0", None),
        ("redis+sentinel://h:26379/primary", None),
        ("redis://h:6379/0?socket_keepalive=true", None),
    ],
    ids=["tcp", "username", "password", "unix", "unix password", "tls", "sentinel", "options"],
)
def test_lean_target_of_a_url(url: str, target: LeanTarget | None) -> None:
    """Plain TCP and unix URLs go lean; TLS, Sentinel and options only redis-py implements
    stay on redis-py."""
    assert lean_target(url) == target


@pytest.fixture
async def lean(redis_url: str) -> AsyncIterator[RespConnection]:
    target = lean_target(redis_url)
    assert target is not None
    conn = await RespConnection.open(target, 2.0)
    yield conn
    conn.close()


async def test_a_pipeline_answers_in_order_with_errors_in_place(lean: RespConnection) -> None:
    key = f"resp-{uuid.uuid4().hex}"
    replies = await lean.execute(
        [
            ("SET", key, "v"),
            ("INCR", key),  # not an integer: an error reply
            ("EVALSHA", "0" * 40, 0),  # no such script
            ("APPEND", key, b"\x00w"),
            ("GET", key),
            ("DEL", key),
        ],
        2.0,
    )
    assert replies[0] == b"OK"
    assert type(replies[1]) is ResponseError and "not an integer" in str(replies[1])
    assert isinstance(replies[2], NoScriptError)
    assert replies[3:] == [3, b"v\x00w", 1]


async def test_arguments_arrive_as_redis_py_sends_them(lean: RespConnection) -> None:
    """Bytes verbatim (CRLF included), ints in decimal, floats as their repr."""
    key = f"resp-{uuid.uuid4().hex}"
    replies = await lean.execute(
        [("RPUSH", key, b"v\r\n", 42, 0.1), ("LRANGE", key, 0, -1), ("DEL", key)], 2.0
    )
    assert replies == [3, [b"v\r\n", b"42", b"0.1"], 1]


async def test_pipelines_sent_back_to_back_get_their_own_replies(lean: RespConnection) -> None:
    key = f"resp-{uuid.uuid4().hex}"
    first, second = await asyncio.gather(
        lean.execute([("INCRBY", key, 1), ("INCRBY", key, 1)], 2.0),
        lean.execute([("INCRBY", key, 10)], 2.0),
    )
    assert (first, second) == ([1, 2], [12])
    await lean.execute([("DEL", key)], 2.0)


async def test_a_subscription_delivers_payloads_and_reports_a_lost_connection(
    redis_url: str,
) -> None:
    target = lean_target(redis_url)
    assert target is not None
    channel = f"resp-{uuid.uuid4().hex}"
    messages: list[bytes] = []
    lost: list[BaseException] = []
    subscriber = await RespConnection.open(target, 2.0)
    await subscriber.subscribe(channel, messages.append, lost.append, 2.0)
    client = aioredis.Redis.from_url(redis_url)
    try:
        assert await client.publish(channel, b"one") == 1
        await client.publish(channel, b"two")
        for _ in range(100):
            if len(messages) == 2:
                break
            await asyncio.sleep(0.01)
        assert messages == [b"one", b"two"]
        assert not lost
        killed = await client.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
        assert killed >= 1
        for _ in range(100):
            if lost:
                break
            await asyncio.sleep(0.01)
        assert len(lost) == 1 and isinstance(lost[0], RedisConnectionError)
        assert subscriber.closed
    finally:
        subscriber.close()
        await client.aclose()


async def test_closing_on_purpose_reports_nothing_lost(redis_url: str) -> None:
    target = lean_target(redis_url)
    assert target is not None
    lost: list[BaseException] = []
    subscriber = await RespConnection.open(target, 2.0)
    await subscriber.subscribe(f"resp-{uuid.uuid4().hex}", lambda _: None, lost.append, 2.0)
    subscriber.close()
    await asyncio.sleep(0.05)
    assert lost == [] and subscriber.closed
    with pytest.raises(RedisConnectionError):
        await subscriber.execute([("PING",)], 1.0)


async def test_a_refused_login_is_a_connection_error(redis_url: str) -> None:
    target = lean_target(redis_url)
    assert target is not None
    wrong = LeanTarget(host=target.host, port=target.port, path=target.path, password="nope")
    with pytest.raises(RedisConnectionError, match="refused the login"):
        await RespConnection.open(wrong, 2.0)


async def test_nothing_listening_is_a_connection_error(unused_port: int) -> None:
    with pytest.raises(RedisConnectionError, match="cannot connect"):
        await RespConnection.open(LeanTarget(host="127.0.0.1", port=unused_port), 2.0)


async def test_a_silent_server_times_out_and_the_connection_closes(unused_port: int) -> None:
    """Replies after a timeout could not be matched to their commands: the connection goes."""
    accepted: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        await reader.read()  # never answers

    server = await asyncio.start_server(swallow, "127.0.0.1", unused_port)
    try:
        conn = await RespConnection.open(LeanTarget(host="127.0.0.1", port=unused_port), 1.0)
        with pytest.raises(RedisTimeoutError, match="did not answer"):
            await conn.execute([("PING",)], 0.1)
        assert conn.closed
        with pytest.raises(RedisConnectionError):
            await conn.execute([("PING",)], 0.1)
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()
