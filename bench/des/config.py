"""What one simulated run is: the cluster, its layout, the fabric and the router's settings."""

from __future__ import annotations

from typing import Literal

import msgspec

from bench.results.summary import DEFAULT_OBJECTIVES, Objectives
from bench.stack.layout import ClusterSpec
from policies.types import Role

FirstToken = Literal["decode", "prefill"]

# The simulated router's own time per leg it sends: reading the request or the prefill reply,
# deciding, and writing the leg to the worker. The live proxy spends about this much in
# aiohttp for one leg on a local connection.
DEFAULT_ROUTER_OVERHEAD_S = 0.001


class SimConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One simulated cluster and router; defaults mirror `sim-cluster` and `serve`.

    `roles` gives each worker's role (see `bench.stack.layout.worker_roles`). Engine settings are
    the `sim-cluster` options (worker i gets seed `seed + i`, as there); the router settings are
    `serve`'s (`scrape_interval_s`, first-token convention, link reservation lease and EWMA,
    session TTL); `objectives` are the default service objectives of turns without their own.
    """

    cluster: ClusterSpec
    roles: tuple[Role, ...]
    nic_gbps: float = 400.0
    nic_latency_s: float = 5e-6
    spine_gbps: float | None = None
    scrape_interval_s: float = 0.25
    router_overhead_s: float = DEFAULT_ROUTER_OVERHEAD_S
    first_token: FirstToken = "decode"
    seed: int = 0
    noise_sigma: float = 0.02
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    chunked_prefill: int | None = None
    eos_probability: float = 0.0
    # The engines' --scheduling-policy; under "priority" a decision's `due_ms` orders their
    # queues (`policies.types.engine_priority`), and decisions without one keep arrival order.
    scheduling_policy: Literal["fcfs", "priority"] = "priority"
    kv_hold_timeout_s: float = 480.0
    reservation_lease_s: float = 30.0
    ewma_alpha: float = 0.3
    session_ttl_s: float = 3600.0
    default_max_tokens: int = 256
    objectives: Objectives = DEFAULT_OBJECTIVES

    def __post_init__(self) -> None:
        if len(self.roles) != self.cluster.workers:
            raise ValueError(
                f"{len(self.roles)} roles for a cluster of {self.cluster.workers} workers"
            )
        positive = {
            "nic_gbps": self.nic_gbps,
            "scrape_interval_s": self.scrape_interval_s,
            "reservation_lease_s": self.reservation_lease_s,
            "session_ttl_s": self.session_ttl_s,
            "kv_hold_timeout_s": self.kv_hold_timeout_s,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.spine_gbps is not None and not self.spine_gbps > 0:
            raise ValueError(f"spine_gbps must be > 0, got {self.spine_gbps}")
        if self.router_overhead_s < 0 or self.nic_latency_s < 0:
            raise ValueError("router_overhead_s and nic_latency_s must be >= 0")
        if not 0 < self.ewma_alpha <= 1:
            raise ValueError(f"ewma_alpha must be in (0, 1], got {self.ewma_alpha}")
        if self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be >= 1")

    @property
    def worker_ids(self) -> tuple[str, ...]:
        """`w0`..`w7` (zero-padded, so string order is index order, as policies tie-break)."""
        width = len(str(self.cluster.workers - 1))
        return tuple(f"w{i:0{width}d}" for i in range(self.cluster.workers))
