"""An engine's busy-polling threads are found and put at the lowest priority."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.vllm import engine

# A process with one thread spinning and one asleep; it prints their native thread ids.
SPINNING_CHILD = """
import sys, threading, time
spinning, sleeping = [], []
def spin():
    spinning.append(threading.get_native_id())
    while True:
        pass
def sleep():
    sleeping.append(threading.get_native_id())
    time.sleep(3600)
for target in (spin, sleep):
    threading.Thread(target=target, daemon=True).start()
while len(spinning) + len(sleeping) < 2:
    time.sleep(0.01)
print(spinning[0], sleeping[0], flush=True)
time.sleep(3600)
"""


def test_only_the_spinning_thread_goes_to_nice_19(monkeypatch: pytest.MonkeyPatch) -> None:
    # A loaded machine gives a spinning thread less than a quarter of a core; an idle one
    # uses none at all.
    monkeypatch.setattr(engine, "SPINNING_SHARE", 0.02)
    child = subprocess.Popen([sys.executable, "-c", SPINNING_CHILD], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        spinning, sleeping = (int(tid) for tid in child.stdout.readline().split())
        calmed = engine.calm_spinners(child.pid, window_s=0.5)
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        assert calmed == [spinning]
        assert os.getpriority(os.PRIO_PROCESS, spinning) == 19
        assert os.getpriority(os.PRIO_PROCESS, sleeping) == ours
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == ours
    finally:
        child.kill()
        child.wait(timeout=30)
        if child.stdout is not None:
            child.stdout.close()
