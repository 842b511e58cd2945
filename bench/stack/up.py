"""`session-router up`: simulated workers and a router on this machine, one command.

`LocalStack` runs them as child processes, exactly as an operator would: `session-router
sim-cluster` (the workers, on consecutive ports, sharing one modelled fabric) and
`session-router serve` (the router, with its embedded Redis) in front of them, each in its own
process group so that a terminal's Ctrl-C reaches only the parent, which then stops the router
first (turns in flight finish, its events file is flushed) and the workers after it. `bench
compare` starts one fresh stack per policy.

With `engine="vllm"` the workers are real vLLM engines (`bench.vllm.fleet`) serving a model
folder, with NIXL between them. Those busy-poll: they and the router then stay in the parent's
session, where an engine cannot starve the router for seconds at a time as it does from a
session of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import sys
import uuid
from collections.abc import Coroutine, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal, TypeVar

import aiohttp
import msgspec

from bench.results.summary import FirstTokenConvention
from bench.stack.layout import ClusterSpec, hardware_params
from bench.vllm.fleet import FleetSpec, VllmFleet, kv_bytes_per_token
from policies import create_policy
from policies.types import Role
from sim.engine.presets import deployment_from_names

_T = TypeVar("_T")

_CLI = (sys.executable, "-m", "session_router_cli")


class RealEngines(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Real vLLM workers: the model folder they serve, the virtualenv `make real-engines`
    made, a folder for their caches and logs, and engine options."""

    model_dir: str
    venv: str = ".venv-vllm"
    work_dir: str = "bench-out/engines"
    num_gpu_blocks: int | None = None
    max_num_seqs: int | None = None
    startup_timeout_s: float = 300.0


class StackSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One simulated cluster and its router. `roles` has one entry per worker, in port order;
    ports left None are chosen free; `log_dir` None lets the children write to our terminal."""

    cluster: ClusterSpec
    roles: tuple[Role, ...]
    policy: str
    policy_params: tuple[tuple[str, str], ...] = ()
    host: str = "127.0.0.1"
    port: int | None = None
    worker_base_port: int | None = None
    first_token: FirstTokenConvention = "decode"
    admin_token: str | None = None
    events: str | None = None
    seed: int = 0
    scrape_interval_ms: int = 250
    log_dir: str | None = None
    startup_timeout_s: float = 60.0
    # the workers' --scheduling-policy; under "priority" the router is told so, and the turns
    # a policy gives due times to are admitted in the order they are due (as the simulator's)
    scheduling_policy: Literal["fcfs", "priority"] = "priority"
    router_args: tuple[str, ...] = ()  # more `serve` options, as given
    engine: Literal["sim", "vllm"] = "sim"
    real: RealEngines | None = None  # with engine="vllm"

    def __post_init__(self) -> None:
        if len(self.roles) != self.cluster.workers:
            raise ValueError(f"{len(self.roles)} roles for {self.cluster.workers} workers")
        if (self.engine == "vllm") != (self.real is not None):
            raise ValueError("engine 'vllm' takes real-engine options (and only it does)")


def policy_params(policy: str, given: dict[str, str], cluster: ClusterSpec) -> dict[str, str]:
    """`given` plus the cluster's hardware for the policy's hardware parameters (as strings,
    the way `--policy-param` passes them). Unknown policies fail with the registry's message."""
    params_type = getattr(type(create_policy(policy)), "Params", None)
    merged = hardware_params(params_type, given, cluster)
    create_policy(policy, merged)  # a bad parameter fails here, not in a child process
    return {key: str(value) for key, value in merged.items()}


def free_port_block(host: str, count: int) -> int:
    """The first of `count` consecutive ports that are free on `host` right now.

    Chosen below the kernel's ephemeral range: a port in that range that is free now can be
    taken by any outgoing connection before our child binds it.
    """
    ephemeral_low = _ephemeral_range()[0]
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(10_000, max(10_001, ephemeral_low - count))
        if _all_bindable(host, range(base, base + count)):
            return base
    raise RuntimeError(f"no block of {count} free ports on {host}")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32_768, 60_999


def _all_bindable(host: str, ports: range) -> bool:
    try:
        for port in ports:
            with socket.socket() as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((host, port))
    except OSError:
        return False
    return True


class _Child:
    def __init__(
        self, name: str, args: Sequence[str], log_dir: str | None, new_session: bool = True
    ) -> None:
        self.name = name
        self.new_session = new_session
        self.args = [*_CLI, *args]
        self.log: Path | None = Path(log_dir) / f"{name}.log" if log_dir else None
        self._log_file: IO[bytes] | None = None
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        if self.log is not None:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = self.log.open("ab")
        self.process = await asyncio.create_subprocess_exec(
            *self.args, stdin=asyncio.subprocess.DEVNULL, stdout=self._log_file,
            stderr=asyncio.subprocess.STDOUT if self._log_file else None,
            start_new_session=self.new_session, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip

    def exited(self) -> bool:
        return self.process is not None and self.process.returncode is not None

    def tail(self, lines: int = 30) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    async def stop(self, timeout_s: float = 15.0) -> None:
        process = self.process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), timeout_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


PORT_ATTEMPTS = 3


class _PortTaken(RuntimeError):
    """A child could not listen: its port was taken after it was found free."""


class LocalStack:
    """The workers (a `sim-cluster` child, or real vLLM engines) and a `serve` child process;
    use `async with LocalStack(spec) as s:`."""

    def __init__(self, spec: StackSpec) -> None:
        self.spec = spec
        self.admin_token = spec.admin_token or uuid.uuid4().hex
        cluster = spec.cluster
        if spec.real is not None:
            self.model = spec.real.model_dir  # vLLM's model id is the path it was given
            self._kv_bytes_per_token = kv_bytes_per_token(spec.real.model_dir)
        else:
            deployment = deployment_from_names(cluster.gpu, cluster.model, cluster.tp)
            self.model = deployment.model.name
            self._kv_bytes_per_token = deployment.kv_bytes_per_token
        self._fleet: VllmFleet | None = None
        self._plan()

    def _plan(self) -> None:
        """The children on the spec's ports, or on ports free right now."""
        spec, host, cluster = self.spec, self.spec.host, self.spec.cluster
        base = spec.worker_base_port or free_port_block(host, cluster.workers)
        self.port = spec.port or free_port_block(host, 1)
        self.worker_urls = [f"http://{host}:{base + i}" for i in range(cluster.workers)]
        self.url = f"http://{host}:{self.port}"
        self._sim = _Child("workers", [
            "sim-cluster", "--host", host, "--base-port", str(base),
            "--workers", str(cluster.workers), "--gpu", cluster.gpu, "--model", cluster.model,
            "--tp", str(cluster.tp), "--seed", str(spec.seed),
            "--scheduling-policy", spec.scheduling_policy,
        ], spec.log_dir)  # fmt: skip
        if spec.real is not None:
            self._fleet = VllmFleet(
                FleetSpec(
                    model=spec.real.model_dir, roles=spec.roles, base_port=base,
                    side_channel_base=free_port_block(host, cluster.workers), host=host,
                    scheduling_policy=spec.scheduling_policy,
                    num_gpu_blocks=spec.real.num_gpu_blocks, max_num_seqs=spec.real.max_num_seqs,
                ),
                Path(spec.real.venv), Path(spec.log_dir or spec.real.work_dir),
            )  # fmt: skip
        router = ["serve", "--host", host, "--port", str(self.port), "--redis", "embedded",
                  "--policy", spec.policy, "--first-token", spec.first_token,
                  "--admin-token", self.admin_token,
                  "--scrape-interval-ms", str(spec.scrape_interval_ms),
                  "--kv-bytes-per-token", str(self._kv_bytes_per_token)]  # fmt: skip
        for key, value in spec.policy_params:
            router += ["--policy-param", f"{key}={value}"]
        if spec.events is not None:
            router += ["--events", spec.events]
        if spec.scheduling_policy == "priority":
            router.append("--priority-scheduling")
        for role, url in zip(spec.roles, self.worker_urls, strict=True):
            router += [f"--{role}", url]
        router += spec.router_args
        self._router = _Child("router", router, spec.log_dir, new_session=self._fleet is None)

    @property
    def fleet(self) -> VllmFleet | None:
        """The real engines, where the stack runs them."""
        return self._fleet

    @property
    def router_pid(self) -> int | None:
        """The router process's id while it runs (for sampling its resources)."""
        process = self._router.process
        return process.pid if process is not None and process.returncode is None else None

    async def __aenter__(self) -> LocalStack:
        await self.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        # Ports free when chosen can be taken by another program before a child binds them:
        # then the stack starts again on other ones (ports the spec names are not changed).
        chosen = self.spec.port is None or self.spec.worker_base_port is None
        for attempt in range(PORT_ATTEMPTS):
            try:
                await self._start_once()
                return
            except _PortTaken:
                if not chosen or attempt + 1 == PORT_ATTEMPTS:
                    raise
                self._plan()

    async def _start_once(self) -> None:
        try:
            async with aiohttp.ClientSession() as session:
                if self._fleet is not None:
                    assert self.spec.real is not None
                    await asyncio.to_thread(self._fleet.start, self.spec.real.startup_timeout_s)
                else:
                    await self._sim.start()
                    await self._wait_ready(
                        session, self._sim, [f"{u}/health" for u in self.worker_urls]
                    )
                await self._router.start()
                await self._wait_ready(session, self._router, [f"{self.url}/ready"])
        except BaseException:
            await self.stop()
            raise

    async def _wait_ready(
        self, session: aiohttp.ClientSession, child: _Child, urls: list[str]
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.spec.startup_timeout_s
        pending = list(urls)
        while pending:
            if child.exited():
                tail = child.tail()
                error = _PortTaken if "address already in use" in tail else RuntimeError
                raise error(f"the {child.name} process exited at start:\n{tail}")
            try:
                async with session.get(pending[0], timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status == 200:
                        pending.pop(0)
                        continue
            except (aiohttp.ClientError, TimeoutError):
                pass
            if loop.time() > deadline:
                raise RuntimeError(
                    f"{pending[0]} not ready in {self.spec.startup_timeout_s:g} s:\n{child.tail()}"
                )
            await asyncio.sleep(0.05)

    async def wait_exit(self) -> str:
        """Wait until a child process exits; returns its name."""
        waits: dict[asyncio.Future[Any], str] = {
            asyncio.ensure_future(process.wait()): child.name
            for child in (self._router, self._sim)
            if (process := child.process) is not None
        }
        if self._fleet is not None:
            waits[asyncio.ensure_future(self._engine_exit(self._fleet))] = "engine"
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for future in waits:
                future.cancel()
        return waits[next(iter(done))]

    @staticmethod
    async def _engine_exit(fleet: VllmFleet) -> None:
        """Until an engine's API server exits: its pidfd turns readable then."""
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[None] = loop.create_future()
        fds = [os.pidfd_open(e.process.pid) for e in fleet.engines if e.process is not None]

        def on_exit() -> None:
            if not exited.done():
                exited.set_result(None)

        try:
            for fd in fds:
                loop.add_reader(fd, on_exit)
            if fleet.exited():
                return
            await exited
        finally:
            for fd in fds:
                loop.remove_reader(fd)
                os.close(fd)

    async def stop(self) -> None:
        """Router first (turns in flight finish, events are flushed), then the workers."""
        try:
            await self._router.stop()
        finally:
            if self._fleet is not None:
                await asyncio.to_thread(self._fleet.stop)
            await self._sim.stop()


def run_stopping_on_sigterm(main: Coroutine[Any, Any, _T]) -> _T:
    """Run `main`; SIGTERM cancels it as Ctrl-C does, so the stacks it started are stopped
    (their workers, routers and Redis servers are not left behind)."""

    async def wrapper() -> _T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
        try:
            return await main
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    return asyncio.run(wrapper())


def curl_example(url: str, model: str) -> str:
    body = msgspec.json.encode({
        "model": model, "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 32, "stream": True,
    }).decode()  # fmt: skip
    return (f"curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f"-H 'X-Session-ID: my-session' -d '{body}'")  # fmt: skip


async def run_up(spec: StackSpec) -> int:
    """Start the stack, say where it is, run until SIGINT/SIGTERM; 1 if a child died."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        async with LocalStack(spec) as stack:
            layout = ", ".join(f"{url} ({role})" for url, role in
                               zip(stack.worker_urls, spec.roles, strict=True))  # fmt: skip
            print(f"session-router up: policy {spec.policy} on {spec.cluster}\n"
                  f"  router   {stack.url}  (admin token {stack.admin_token})\n"
                  f"  workers  {layout}\n\ntry:\n  {curl_example(stack.url, stack.model)}\n\n"
                  "Ctrl-C stops everything.", flush=True)  # fmt: skip
            stopped = asyncio.ensure_future(stop.wait())
            died = asyncio.ensure_future(stack.wait_exit())
            await asyncio.wait({stopped, died}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            died.cancel()
            if died.done() and not died.cancelled():
                print(f"session-router up: the {died.result()} process exited; stopping",
                      file=sys.stderr, flush=True)  # fmt: skip
                return 1
            print("\nsession-router up: stopping", flush=True)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    return 0
