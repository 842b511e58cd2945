"""Open a Redis client from a URL, including Redis Sentinel URLs.

`redis://`, `rediss://` and `unix://` go to redis-py as they are. A Sentinel URL names the
sentinels and the monitored primary, and the client follows the primary across failovers:

    redis+sentinel://[:password@]host1:26379,host2:26379/<service name>[/<db>]
    rediss+sentinel://...   (TLS to the primary)

The password, when given, is the primary's; sentinels are reached without one.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

from redis.asyncio import Redis
from redis.asyncio.sentinel import Sentinel

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")


def open_redis(url: str, **options: Any) -> Redis:
    scheme = url.split("://", 1)[0].lower()
    if scheme not in SENTINEL_SCHEMES:
        return Redis.from_url(url, **options)
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    password = unquote(parts.password) if parts.password else None
    sentinels = []
    for host_port in netloc.split(","):
        host, _, port = host_port.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"sentinel address must be host:port, got {host_port!r} in {url!r}")
        sentinels.append((host.strip("[]"), int(port)))
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


async def close_redis(client: Redis) -> None:
    """Close the client and, for a Sentinel client, its connections to the sentinels."""
    await client.aclose()
    manager = getattr(client.connection_pool, "sentinel_manager", None)
    for sentinel_client in getattr(manager, "sentinels", ()):
        await sentinel_client.aclose()
