"""Start our command line as real subprocesses and wait until they answer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class Process:
    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.args = [sys.executable, "-m", "session_router_cli", *args]
        self.log = ROOT / ".pytest_cache" / f"proc-{os.getpid()}-{time.monotonic_ns()}.log"
        self.log.parent.mkdir(exist_ok=True)
        self._log_file = self.log.open("wb")
        self.popen = subprocess.Popen(
            self.args,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
        )

    def output(self) -> str:
        if not self._log_file.closed:
            self._log_file.flush()
        return self.log.read_text(errors="replace")

    def wait_healthy(
        self, urls: Sequence[str], timeout_s: float = 30.0, path: str = "/health"
    ) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(urls)
        while pending:
            if self.popen.poll() is not None:
                output = self.output()
                self.stop()
                raise RuntimeError(f"{self.args} exited early:\n{output}")
            try:
                with urllib.request.urlopen(pending[0] + path, timeout=1) as response:
                    if response.status == 200:
                        pending.pop(0)
                        continue
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                output = self.output()
                self.stop()
                raise RuntimeError(f"{pending[0]} not healthy in {timeout_s}s:\n{output}")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        if not self._log_file.closed:
            self._log_file.close()
        return self.popen.returncode
