"""One real vLLM engine (`vllm serve`) as a child process of the caller.

The engine starts in the caller's session, never a new one: its engine threads busy-poll, and
started in a session of its own it starved the processes of other sessions (the client, the
router) for seconds at a time, while in the same session the worst stall seen was a few ms.
Its OpenMP threads are pinned to the cores given, so that two engines do not share one. It
writes into a private folder (caches, temporary files) and a log file, and stops on SIGTERM
(its EngineCore and worker children follow it within seconds).

Once healthy, any of its threads that spins while the engine is idle runs at the lowest
priority (`calm_spinners`): with a NIXL connector, the transfer library's progress thread
polls a whole core without pause, the very core its engine computes on, and on a machine
with fewer cores than engines those threads take the cores from every engine's steps.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Literal

import msgspec

KvRole = Literal["kv_both", "kv_producer", "kv_consumer"]


class EngineSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one `vllm serve` is started with. `kv_role` None: no KV connector (the engine
    serves whole turns only); else a NixlConnector on `side_channel_port`. `cpus` is the
    OpenMP binding (`"0"`, `"0-1"`), None for vLLM's own choice."""

    model: str
    port: int
    host: str = "127.0.0.1"
    kv_role: KvRole | None = None
    side_channel_port: int | None = None
    cpus: str | None = None
    kv_cache_gib: int = 1
    max_model_len: int = 4096
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    num_gpu_blocks: int | None = None
    max_num_seqs: int | None = None
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kv_role is not None and self.side_channel_port is None:
            raise ValueError("an engine with a KV connector needs a side_channel_port")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def serve_args(spec: EngineSpec) -> list[str]:
    """`vllm serve`'s arguments for `spec` (after the executable)."""
    args = [
        "serve", spec.model, "--host", spec.host, "--port", str(spec.port),
        "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--max-model-len", str(spec.max_model_len),
        "--scheduling-policy", spec.scheduling_policy,
        # one log line per scrape otherwise: the router reads /metrics several times a second
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if spec.kv_role is not None:
        config = {"kv_connector": "NixlConnector", "kv_role": spec.kv_role,
                  "kv_buffer_device": "cpu"}  # fmt: skip
        args += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
    if spec.num_gpu_blocks is not None:
        args += ["--num-gpu-blocks-override", str(spec.num_gpu_blocks)]
    if spec.max_num_seqs is not None:
        args += ["--max-num-seqs", str(spec.max_num_seqs)]
    return [*args, *spec.extra_args]


def serve_env(spec: EngineSpec, workdir: Path, base: dict[str, str]) -> dict[str, str]:
    """The engine's environment: offline, no usage reports, caches and temporary files in
    `workdir`, its KV space and thread binding, NIXL over TCP on loopback."""
    env = {
        **base,
        "VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_gib),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "VLLM_CACHE_ROOT": str(workdir / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(workdir / "inductor-cache"),
        "TMPDIR": str(workdir / "tmp"),
        "PYTHONUNBUFFERED": "1",
    }
    if spec.cpus is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = spec.cpus
    if spec.kv_role is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = spec.host
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.side_channel_port)
        env["UCX_TLS"] = "tcp,self,sm"
        # The progress thread polls the UCX worker under its lock and runs at nice 19
        # (`calm_spinners`); with UCX's default spinlock, a pull posted by the engine's own
        # thread spun on that lock while its preempted holder waited for a core.
        env["UCX_USE_MT_MUTEX"] = "y"
    return env


# A thread using more than this share of a core while its engine is idle is a busy poller.
SPINNING_SHARE = 0.25
SPIN_WINDOW_S = 1.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def thread_ticks(pids: list[int]) -> dict[int, int]:
    """CPU ticks (user + system) each thread of `pids` has used, by thread id."""
    ticks: dict[int, int] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    stat = (task / "stat").read_text()
                    fields = stat[stat.rindex(")") + 2 :].split()
                    ticks[int(task.name)] = int(fields[11]) + int(fields[12])
    return ticks


def calm_spinners(pid: int, window_s: float = SPIN_WINDOW_S) -> list[int]:
    """Put the threads of `pid`'s process family that used more than `SPINNING_SHARE` of a
    core over `window_s` (the engine idle) at nice 19, so they run only when the cores are
    not wanted; their ids."""
    family = [pid, *descendants(pid)]
    before = thread_ticks(family)
    time.sleep(window_s)
    after = thread_ticks(family)
    most = SPINNING_SHARE * window_s * CLOCK_TICKS
    spinning = [tid for tid, used in after.items() if used - before.get(tid, used) > most]
    for tid in spinning:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, 19)
    return spinning


def descendants(pid: int) -> list[int]:
    """The process ids below `pid`, children first (from /proc)."""
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop()
        path = Path(f"/proc/{parent}/task/{parent}/children")
        try:
            children = [int(child) for child in path.read_text().split()]
        except OSError:
            continue
        found += children
        pending += children
    return found


class EngineFailed(RuntimeError):
    """The engine exited, or did not answer /health in time; the message ends with its log."""


class VllmEngine:
    """`with VllmEngine(spec, venv, workdir) as engine:` starts it and waits for /health."""

    def __init__(self, spec: EngineSpec, venv: Path, workdir: Path, name: str = "") -> None:
        self.spec = spec
        self.executable = venv.resolve() / "bin" / "vllm"
        self.workdir = workdir.resolve()
        self.name = name or f"vllm-{spec.port}"
        self.log_path = workdir / f"{self.name}.log"
        self._log: IO[bytes] | None = None
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if not self.executable.exists():
            raise FileNotFoundError(f"{self.executable} is missing: run `make real-engines`")
        (self.workdir / "tmp").mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [str(self.executable), *serve_args(self.spec)],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            env=serve_env(self.spec, self.workdir, dict(os.environ)), cwd=self.workdir,
        )  # fmt: skip

    def wait_healthy(self, timeout_s: float = 240.0) -> float:
        """Seconds until /health answered 200; EngineFailed if it exited or timed out."""
        started = time.monotonic()
        deadline = started + timeout_s
        while True:
            if self.process is None or self.process.poll() is not None:
                raise EngineFailed(f"{self.name} exited at start:\n{self.tail()}")
            with contextlib.suppress(urllib.error.URLError, OSError):
                with urllib.request.urlopen(f"{self.spec.url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        calm_spinners(self.process.pid)
                        return time.monotonic() - started
            if time.monotonic() > deadline:
                raise EngineFailed(f"{self.name} not healthy in {timeout_s:g} s:\n{self.tail()}")
            time.sleep(0.25)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the engine at once, API server and engine processes (an engine dying
        mid-stream)."""
        if self.alive():
            assert self.process is not None
            family = descendants(self.process.pid)
            self.process.kill()
            for pid in family:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.process.wait()

    def stop(self, timeout_s: float = 20.0) -> None:
        process = self.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> VllmEngine:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
