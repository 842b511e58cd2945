"""One simulated replay: a trace, a policy and a cluster, in virtual time."""

from __future__ import annotations

import gc
import time

from bench.des.client import Client
from bench.des.cluster import Cluster
from bench.des.config import SimConfig
from bench.des.loop import EventLoop
from bench.des.results import PolicyError, PolicyFailure, SimResult, SimStats
from bench.des.router import SimRouter
from bench.traces.model import Trace
from policies.base import Policy


def simulate(
    trace: Trace, policy: Policy, config: SimConfig, rate_scale: float = 1.0,
    policy_name: str | None = None,
) -> SimResult:  # fmt: skip
    """Replay `trace` (arrivals divided by `rate_scale`) against `config`'s cluster.

    The policy object is used as is (a fresh one per run: policies may keep state). A policy
    that raises ends the run: the result then carries the turns finished so far and the
    `failure`.
    """
    name = policy_name or policy.name
    collecting = gc.isenabled()
    # A run builds long token lists but few reference cycles: the cyclic collector would
    # rescan those lists again and again (about a tenth of the run) to free a few thousand
    # objects, which it does once it is enabled again.
    gc.disable()
    try:
        return _simulate(trace, policy, config, rate_scale, name)
    finally:
        if collecting:
            gc.enable()


def _simulate(
    trace: Trace, policy: Policy, config: SimConfig, rate_scale: float, name: str
) -> SimResult:
    started = time.process_time()
    loop = EventLoop()
    cluster = Cluster(config, loop)
    client = Client(trace, rate_scale, loop, cluster.deployment.block_size)
    router = SimRouter(config, name, policy, cluster, loop, client.on_done)
    client.attach(router)
    router.start()
    client.start()
    failure: PolicyFailure | None = None
    try:
        loop.run()
    except PolicyError as error:
        failure = error.failure
    if failure is None and not client.finished:
        raise RuntimeError("the simulation ran out of events with turns still unanswered")
    cluster.settle()
    stats = SimStats(
        events=loop.events - cluster.stale_events + cluster.inline_steps,
        steps=cluster.steps,
        inline_steps=cluster.inline_steps,
        cpu_s=time.process_time() - started,
        virtual_s=loop.now(),
    )
    return SimResult(name, rate_scale, client.results, stats, failure)
