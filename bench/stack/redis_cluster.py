"""A local Redis Cluster of N primaries (no replicas), for tests and measurements.

Each node is a `redis-server --cluster-enabled yes` on 127.0.0.1, persisting nothing; the hash
slots are split in equal ranges and the nodes meet, then every node must report
`cluster_state:ok` within the deadline. A node's cluster bus listens 10,000 ports above its
own, so `free_ports` picks ports with that one free too.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from redis import Redis
from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError

SLOTS = 16384
BUS_OFFSET = 10000  # a node's cluster bus port is its own port + this
MAX_PORT = 65535 - BUS_OFFSET


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free now whose cluster bus port is free too."""
    found: list[int] = []
    while len(found) < count:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port <= MAX_PORT and port not in found and _bindable(port + BUS_OFFSET):
            found.append(port)
    return found


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class LocalCluster:
    """Start with `start()`, stop with `stop()` (or use as a context manager)."""

    def __init__(self, binary: str, ports: list[int], directory: Path, ready_s: float = 20.0):
        if not ports:
            raise ValueError("a cluster needs at least one node")
        if max(ports) > MAX_PORT:
            raise ValueError(f"cluster ports must be at most {MAX_PORT} (the bus is +{BUS_OFFSET})")
        self.binary = binary
        self.ports = ports
        self.directory = directory
        self.ready_s = ready_s
        self.processes: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        """A redis+cluster:// URL naming every node."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        for port in self.ports:
            self.processes.append(subprocess.Popen([
                self.binary, "--port", str(port), "--bind", "127.0.0.1",
                "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-node-timeout", "2000", "--save", "", "--appendonly", "no",
                "--dir", str(self.directory), "--loglevel", "warning",
                "--logfile", str(self.directory / f"{port}.log"),
            ], stdin=subprocess.DEVNULL, start_new_session=True))  # fmt: skip
        clients = [Redis(host="127.0.0.1", port=port, socket_timeout=5) for port in self.ports]
        try:
            for client in clients:
                self._wait(client.ping, "a node answering PING")
            share = SLOTS // len(clients)
            for index, client in enumerate(clients):
                first = index * share
                last = SLOTS - 1 if index == len(clients) - 1 else first + share - 1
                _cluster(client, "ADDSLOTSRANGE", first, last)
            for port in self.ports[1:]:
                _cluster(clients[0], "MEET", "127.0.0.1", port)
            for client in clients:
                self._wait(partial(_cluster_ok, client), "cluster_state:ok on every node")
        finally:
            for client in clients:
                client.close()

    def _wait(self, check: Callable[[], object], what: str) -> None:
        deadline = time.monotonic() + self.ready_s
        while True:
            try:
                if check():
                    return
            except (RedisConnectionError, BusyLoadingError):
                pass  # not listening or still loading
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {self.ready_s} s")
            time.sleep(0.05)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()


def _cluster(client: Redis, *args: str | int) -> Any:
    """A CLUSTER subcommand on one node (the standalone client has no methods for them)."""
    return client.execute_command("CLUSTER", *args)  # type: ignore[no-untyped-call]


def _cluster_ok(client: Redis) -> bool:
    return b"cluster_state:ok" in _cluster(client, "INFO")
