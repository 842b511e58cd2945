"""Whether Redis answers: the degraded flag, its one-line log and callback per transition."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from redis.exceptions import (
    ClusterDownError,
    ReadOnlyError,
    RedisClusterUnreachableError,
    SlotNotCoveredError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger("router.state.shared")

# Errors meaning "Redis cannot serve us now" (a failover's read-only replica included, and on
# Redis Cluster a cluster that is down, a slot no primary serves, or no node answering); any
# other Redis error is a bug or a misconfiguration and is reported, not treated as an outage.
UNREACHABLE: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    ReadOnlyError,
    ClusterDownError,
    SlotNotCoveredError,
    RedisClusterUnreachableError,
    OSError,
    TimeoutError,
)

BACKOFF_INITIAL_S = 0.05
BACKOFF_MAX_S = 2.0


class Health:
    """Tracks reachability; `failures` counts every reported failure, even while degraded."""

    def __init__(self, on_degraded: Callable[[bool], None] | None) -> None:
        self._on_degraded = on_degraded
        self._up = asyncio.Event()
        self._up.set()
        self.degraded = False
        self.failures = 0

    def fail(self, error: BaseException) -> bool:
        """Record a failure; True when it starts an outage (the caller starts recovery)."""
        self.failures += 1
        if self.degraded:
            return False
        self.degraded = True
        self._up.clear()
        log.warning("Redis unreachable, serving from the local view: %s", describe_error(error))
        self._notify(True)
        return True

    def recovered(self) -> None:
        if not self.degraded:
            return
        self.degraded = False
        self._up.set()
        log.info("Redis reachable again: view written back, pending writes flushed")
        self._notify(False)

    async def wait_up(self) -> None:
        await self._up.wait()

    def _notify(self, degraded: bool) -> None:
        if self._on_degraded is None:
            return
        try:
            self._on_degraded(degraded)
        except Exception:
            log.exception("on_degraded callback failed")


def describe_error(error: BaseException) -> str:
    """`Class: message`, with the root cause's class where another error caused it (a
    timeout's message alone is often empty, a refused connection's says nothing of a timeout)."""
    root = error
    for _ in range(8):  # a chain, not a cycle
        if root.__cause__ is None:
            break
        root = root.__cause__
    text = _one(error)
    return text if root is error else f"{text} (from {_one(root)})"


def _one(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def backoff_delays() -> Callable[[], float]:
    """Successive reconnect delays: 50 ms doubling up to 2 s."""
    delay = BACKOFF_INITIAL_S / 2

    def next_delay() -> float:
        nonlocal delay
        delay = min(delay * 2, BACKOFF_MAX_S)
        return delay

    return next_delay
