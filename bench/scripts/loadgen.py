"""Shared pieces of the load benchmarks: free ports, readiness, process CPU and wrk runs."""

from __future__ import annotations

import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path

from bench.stack.up import free_port_block


def free_port() -> int:
    """A port for a child process to listen on, outside the ephemeral range."""
    return free_port_block("127.0.0.1", 1)


def wait_healthy(url: str, timeout_s: float = 30.0) -> None:
    """Wait until GET {url}/health answers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_wrk(url: str, connections: int, duration: float, script: str) -> dict[str, float]:
    """One wrk run (1 thread, `--latency`): p50/p99 in us, requests/s, requests.

    Raises when wrk saw non-2xx answers or socket errors: an error is not a fast response.
    """
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{round(duration)}s", "--latency", "-s", script,
         url],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip

    def latency_us(label: str) -> float:
        match = re.search(rf"^\s+{label}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        if match is None:
            raise RuntimeError(f"no {label}% latency in wrk output:\n{out}")
        return float(match.group(1)) * {"us": 1.0, "ms": 1e3, "s": 1e6}[match.group(2)]

    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    requests = re.search(r"(\d+) requests in", out)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)|Socket errors: (.*)", out)
    if rps is None or requests is None or errors is not None:
        raise RuntimeError(f"wrk reported errors or nothing:\n{out}")
    return {"p50_us": latency_us("50"), "p99_us": latency_us("99"),
            "rps": float(rps.group(1)), "requests": float(requests.group(1))}  # fmt: skip
