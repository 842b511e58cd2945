"""NICs and KV transfers sharing them max-min fairly. Clock-free: callers pass the time.

A transfer crosses its source NIC's egress, its destination NIC's ingress and, when set, the
shared spine. Whenever a transfer starts, finishes its bytes or is cancelled, rates are
recomputed by progressive filling: raise every unfrozen transfer's rate together until some
resource saturates, freeze the transfers crossing it, repeat. A transfer completes when its
last byte is sent plus the source NIC's latency; during that latency it uses no bandwidth.
Times earlier than the last one seen are treated as that time (callers read slightly
different clocks); results are exact for piecewise-constant rates.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

_SPINE = "\x00spine"
# A transfer with at most this many bytes left counts as done (float residue of rate x time).
_EPS_BYTES = 1e-3


@dataclass(slots=True)
class _Nic:
    egress_bps: float
    ingress_bps: float
    latency_s: float


@dataclass(slots=True)
class _Transfer:
    id: int
    src: str
    dst: str
    remaining: float
    latency_s: float
    rate: float = 0.0


class Fabric:
    """The NICs of a cluster and the transfers in flight between them (bytes and bytes/s)."""

    def __init__(self, spine_bps: float | None = None) -> None:
        if spine_bps is not None and spine_bps <= 0:
            raise ValueError(f"spine_bps must be positive, got {spine_bps}")
        self.spine_bps = spine_bps
        self._nics: dict[str, _Nic] = {}
        self._active: dict[int, _Transfer] = {}  # still sending bytes
        self._draining: list[tuple[float, int]] = []  # (completion time, id): bytes sent
        self._draining_ids: set[int] = set()
        self._done: list[int] = []  # completed while settling, not yet returned by advance
        self._time = -math.inf
        self._next_id = 1

    def add_nic(
        self, name: str, egress_bps: float, ingress_bps: float, latency_s: float = 5e-6
    ) -> None:
        if egress_bps <= 0 or ingress_bps <= 0 or latency_s < 0:
            raise ValueError("NIC rates must be positive and latency non-negative")
        if name in self._nics:
            raise ValueError(f"NIC {name!r} already exists")
        self._nics[name] = _Nic(egress_bps, ingress_bps, latency_s)

    def has_nic(self, name: str) -> bool:
        return name in self._nics

    @property
    def active_count(self) -> int:
        """Transfers started and neither completed nor cancelled (including latency tails)."""
        return len(self._active) + len(self._draining_ids)

    def rate_of(self, transfer_id: int) -> float:
        """Current rate in bytes/s: 0 once its bytes are sent; KeyError if unknown or done."""
        transfer = self._active.get(transfer_id)
        if transfer is not None:
            return transfer.rate
        if transfer_id in self._draining_ids:
            return 0.0
        raise KeyError(transfer_id)

    def bytes_in_flight(self, src: str | None = None, dst: str | None = None) -> int:
        """Bytes still to send, as of the last time passed in, optionally by endpoint."""
        total = 0.0
        for t in self._active.values():
            if (src is None or t.src == src) and (dst is None or t.dst == dst):
                total += t.remaining
        return math.ceil(total - _EPS_BYTES) if total > _EPS_BYTES else 0

    def start(self, src: str, dst: str, nbytes: int, now: float) -> int:
        if src not in self._nics or dst not in self._nics:
            missing = src if src not in self._nics else dst
            raise KeyError(f"unknown NIC {missing!r}")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        now = self._settle(now)
        tid = self._next_id
        self._next_id += 1
        latency = self._nics[src].latency_s
        if nbytes == 0:
            self._drain(tid, now + latency)
        else:
            self._active[tid] = _Transfer(tid, src, dst, float(nbytes), latency)
            self._reallocate()
        return tid

    def cancel(self, transfer_id: int, now: float) -> bool:
        """Stop a transfer and free its capacity; False if it already completed or is unknown."""
        self._settle(now)
        if self._active.pop(transfer_id, None) is not None:
            self._reallocate()
            return True
        if transfer_id in self._draining_ids:
            self._draining_ids.discard(transfer_id)  # its heap entry is skipped when popped
            return True
        return False

    def advance(self, now: float) -> list[int]:
        """Ids of transfers completed by `now` and not returned before, in completion order."""
        self._settle(now)
        done, self._done = self._done, []
        return done

    def next_completion(self, now: float) -> float | None:
        """When the next transfer completes if nothing else starts or is cancelled."""
        del now  # the answer depends only on the state; kept for a symmetric API
        if self._done:
            return self._time
        probe = Fabric(self.spine_bps)
        probe._nics = self._nics
        probe._active = {
            i: _Transfer(t.id, t.src, t.dst, t.remaining, t.latency_s, t.rate)
            for i, t in self._active.items()
        }
        probe._draining = list(self._draining)
        probe._draining_ids = set(self._draining_ids)
        probe._time = self._time
        return probe._first_completion()

    # -- internals ------------------------------------------------------------------------------
    def _first_completion(self) -> float | None:
        while True:
            t_bytes, t_done = self._next_bytes_done(), self._next_drained()
            if t_done is not None and (t_bytes is None or t_done <= t_bytes):
                return t_done
            if t_bytes is None:
                return None
            self._progress(t_bytes)
            self._finish_bytes()

    def _settle(self, now: float) -> float:
        """Process every event up to `now`, then move the state to `now`."""
        now = max(now, self._time)
        while True:
            t_bytes, t_done = self._next_bytes_done(), self._next_drained()
            if t_done is not None and t_done <= now and (t_bytes is None or t_done <= t_bytes):
                _, tid = heapq.heappop(self._draining)
                if tid in self._draining_ids:
                    self._draining_ids.discard(tid)
                    self._done.append(tid)
                continue
            if t_bytes is not None and t_bytes <= now:
                self._progress(t_bytes)
                self._finish_bytes()
                continue
            break
        self._progress(now)
        return now

    def _next_drained(self) -> float | None:
        heap = self._draining
        while heap and heap[0][1] not in self._draining_ids:
            heapq.heappop(heap)  # cancelled during its latency tail
        return heap[0][0] if heap else None

    def _next_bytes_done(self) -> float | None:
        best: float | None = None
        for t in self._active.values():
            end = self._time + t.remaining / t.rate
            if best is None or end < best:
                best = end
        return best

    def _progress(self, now: float) -> None:
        dt = now - self._time
        if dt > 0 and self._active:
            for t in self._active.values():
                t.remaining -= t.rate * dt
        self._time = now

    def _finish_bytes(self) -> None:
        finished = [t for t in self._active.values() if t.remaining <= _EPS_BYTES]
        if not finished:  # rounding left the earliest one a hair short: it is done now
            finished = [min(self._active.values(), key=lambda t: t.remaining / t.rate)]
        for t in finished:
            del self._active[t.id]
            self._drain(t.id, self._time + t.latency_s)
        self._reallocate()

    def _drain(self, tid: int, completion: float) -> None:
        heapq.heappush(self._draining, (completion, tid))
        self._draining_ids.add(tid)

    def _reallocate(self) -> None:
        """Max-min fair rates by progressive filling over egress, ingress and spine."""
        capacity: dict[str, float] = {}
        users: dict[str, list[_Transfer]] = {}
        for t in self._active.values():
            for res in self._resources(t):
                if res not in users:
                    users[res] = []
                    capacity[res] = self._capacity(res)
                users[res].append(t)
        unfrozen = set(self._active)
        count = {res: len(ts) for res, ts in users.items()}
        while unfrozen:
            bottleneck = min(
                (res for res in users if count[res] > 0), key=lambda r: capacity[r] / count[r]
            )
            share = capacity[bottleneck] / count[bottleneck]
            for t in users[bottleneck]:
                if t.id not in unfrozen:
                    continue
                unfrozen.discard(t.id)
                t.rate = share
                for res in self._resources(t):
                    capacity[res] = max(0.0, capacity[res] - share)
                    count[res] -= 1

    def _resources(self, t: _Transfer) -> tuple[str, ...]:
        egress, ingress = "e\x00" + t.src, "i\x00" + t.dst
        return (egress, ingress) if self.spine_bps is None else (egress, ingress, _SPINE)

    def _capacity(self, res: str) -> float:
        if res == _SPINE:
            assert self.spine_bps is not None
            return self.spine_bps
        nic = self._nics[res[2:]]
        return nic.egress_bps if res[0] == "e" else nic.ingress_bps
