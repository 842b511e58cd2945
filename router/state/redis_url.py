"""Open a Redis client from a URL, including Redis Sentinel and Redis Cluster URLs.

`redis://`, `rediss://` and `unix://` go to redis-py as they are. A Sentinel URL names the
sentinels and the monitored primary, and the client follows the primary across failovers:

    redis+sentinel://[:password@]host1:26379,host2:26379/<service name>[/<db>]
    rediss+sentinel://...   (TLS to the primary)

The password, when given, is the primary's; sentinels are reached without one. A Cluster URL
names some of the cluster's nodes (the client learns the rest and follows slot moves):

    redis+cluster://[[user]:password@]host1:6379,host2:6379[/]
    rediss+cluster://...   (TLS to every node)
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.sentinel import Sentinel

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")

# what the shared state talks to: one Redis (or Sentinel's primary), or a Redis Cluster
StateClient = Redis | RedisCluster


def is_cluster(url: str) -> bool:
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


def _addresses(url: str, what: str) -> list[tuple[str, int]]:
    netloc = urlsplit(url).netloc.rsplit("@", 1)[-1]
    found = []
    for host_port in netloc.split(","):
        host, _, port = host_port.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{what} address must be host:port, got {host_port!r} in {url!r}")
        found.append((host.strip("[]"), int(port)))
    return found


def open_redis(url: str, **options: Any) -> StateClient:
    scheme = url.split("://", 1)[0].lower()
    if scheme in CLUSTER_SCHEMES:
        return _open_cluster(url, scheme, options)
    if scheme not in SENTINEL_SCHEMES:
        return Redis.from_url(url, **options)
    parts = urlsplit(url)
    password = unquote(parts.password) if parts.password else None
    sentinels = _addresses(url, "sentinel")
    path = [segment for segment in parts.path.split("/") if segment]
    if not path:
        raise ValueError(f"a Sentinel URL needs the service name as its path: {url!r}")
    db = int(path[1]) if len(path) > 1 else 0
    sentinel_options = {
        key: value for key, value in options.items()
        if key in ("socket_timeout", "socket_connect_timeout")
    }  # fmt: skip
    sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
        sentinels, sentinel_kwargs=sentinel_options, **options
    )
    client: Redis = sentinel.master_for(
        path[0], redis_class=Redis, db=db, password=password, ssl=scheme.startswith("rediss")
    )
    return client


def _open_cluster(url: str, scheme: str, options: dict[str, Any]) -> RedisCluster:
    parts = urlsplit(url)
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError(f"Redis Cluster has only database 0: {url!r}")
    nodes = [ClusterNode(host, port) for host, port in _addresses(url, "cluster node")]
    return RedisCluster(
        startup_nodes=nodes,
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
        ssl=scheme.startswith("rediss"),
        **options,
    )


async def close_redis(client: StateClient) -> None:
    """Close the client and, for a Sentinel client, its connections to the sentinels."""
    await client.aclose()
    if isinstance(client, RedisCluster):
        return
    manager = getattr(client.connection_pool, "sentinel_manager", None)
    for sentinel_client in getattr(manager, "sentinels", ()):
        await sentinel_client.aclose()
