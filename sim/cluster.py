"""Several simulated workers in one process on one modelled fabric (one port each)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Sequence
from dataclasses import replace

from sim.fabric.links import Fabric
from sim.worker.realtime import FabricRunner
from sim.worker.server import SimWorker, WorkerOptions


class SimCluster:
    """Workers share one `Fabric`, so their transfers congest each other's NICs (and the spine)."""

    def __init__(self, workers: Sequence[WorkerOptions], spine_gbps: float | None = None) -> None:
        spine = None if spine_gbps is None else spine_gbps * 1e9 / 8
        self.fabric = FabricRunner(Fabric(spine_bps=spine))
        self.workers = [SimWorker(options, self.fabric) for options in workers]

    @classmethod
    def uniform(
        cls, template: WorkerOptions, count: int, base_port: int, spine_gbps: float | None = None
    ) -> SimCluster:
        options = [
            replace(template, port=base_port + i, engine=replace(template.engine,
                                                                 seed=template.engine.seed + i))
            for i in range(count)
        ]  # fmt: skip
        return cls(options, spine_gbps)

    @property
    def urls(self) -> list[str]:
        return [worker.url for worker in self.workers]

    async def start(self) -> None:
        started: list[SimWorker] = []
        try:
            for worker in self.workers:
                await worker.start()
                started.append(worker)
        except BaseException:
            for worker in started:
                await worker.stop()
            raise

    async def stop(self) -> None:
        await asyncio.gather(*(worker.stop() for worker in self.workers))


async def serve_until_signalled(cluster: SimCluster, announce: bool = True) -> None:
    """Run until SIGINT or SIGTERM, then shut every worker down cleanly."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await cluster.start()
    try:
        if announce:
            for worker in cluster.workers:
                print(f"worker {worker.engine_id} listening on {worker.url}", flush=True)
        await stop.wait()
    finally:
        await cluster.stop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
