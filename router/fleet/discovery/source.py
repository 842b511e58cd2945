"""What every discovery source is: a task reporting the whole set of workers it sees."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import msgspec

from policies.types import Role
from router.config import Engine, RouterConfig, WorkerSpec

# on_workers(every worker the source sees now): called at each change, never with a partial
# set, and never because the source failed (a failing source keeps its last set)
OnWorkers = Callable[[tuple[WorkerSpec, ...]], None]


class Source(Protocol):
    """A discovery source. `run` reports to `on_workers` until cancelled; it retries its own
    failures (with a deadline on every wait) and raises only CancelledError."""

    name: str  # "file", "dns", "kubernetes": the origin of the workers it reports

    async def run(self, on_workers: OnWorkers) -> None: ...

    def reload(self) -> None:
        """Look again now (SIGHUP); sources that watch continuously may ignore it."""


class WorkerDefaults(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a discovered worker is unless its source says otherwise."""

    port: int = 8000
    scheme: str = "http"
    role: Role = "mixed"
    engine: Engine = "vllm"

    @classmethod
    def of(cls, config: RouterConfig) -> WorkerDefaults:
        return cls(config.discovery_port, config.discovery_scheme, config.discovery_role,
                   config.discovery_engine)  # fmt: skip

    def url(self, host: str, port: int | None = None) -> str:
        """`scheme://host:port` (an IPv6 address in brackets)."""
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{self.scheme}://{host}:{self.port if port is None else port}"
