"""What the KV a placement fills on a worker costs the sessions whose contexts it evicts there.

An engine keeps a finished request's KV cached until new KV needs its blocks, the least
recently used first. Where a worker's cache turns over faster than its sessions come back,
the blocks a placement fills there come out of contexts that sessions will come back for and
prefill again (a long context's prefill again is a slow step for every stream beside it). A
turn moved off its resident worker fills its whole context on a second worker, where a
colocated one fills its new tokens.

The cache a worker has for finished contexts is its free KV, (1 - kv_usage) x capacity
(capacity: the GPU's memory at vLLM's default utilisation, less the weights); the placements
fill it at the rate this policy places KV there (prompt tokens not cached, answers). It turns
over in free / rate seconds, so the context it evicts next is one its session left that long
ago: live when the session continues (`continuing`) and has not come back yet, P(gap >
turnover), the gaps between a session's turns taken as exponential about their learned mean.
A gap lasts until the next turn's prefill begins, past its queue (in a full fleet the queue
can be as long as the sessions' think time: the context must stay cached through it too).
"""

from __future__ import annotations

import math

from policies.adaptive import tuning
from policies.adaptive.ledgers.legs import decayed_add, decayed_rate, forget_oldest
from policies.costmodel.calibration import Average
from policies.costmodel.priors import gpu_prior, model_prior

Fill = tuple[str, int]  # a worker, and the tokens of KV a placement fills there


def kv_capacity_tokens(gpu: str, model: str, tp: int) -> float:
    """Tokens of KV an engine of `model` on `tp` x `gpu` holds (a prior: the engine reserves
    activations too)."""
    g, m = gpu_prior(gpu), model_prior(model)
    free = g.mem_bytes * tp * tuning.GPU_MEMORY_UTILIZATION - m.weight_bytes
    return free / m.kv_bytes_per_token if free > 0.0 else 0.0


class CacheLedger:
    """The KV this policy places on each worker (a rate, over a decaying `window_s`), and the
    gaps between its sessions' turns."""

    def __init__(self, capacity_tokens: float, window_s: float, rate: float) -> None:
        if not 0.0 < window_s < math.inf:
            raise ValueError(f"window_s must be a finite number > 0, got {window_s!r}")
        self._capacity = capacity_tokens
        self._window_s = window_s
        self._rate = rate
        self._filled: dict[str, tuple[float, float]] = {}  # worker -> (decaying sum, at)
        self._placed: dict[str, tuple[float, tuple[Fill, ...]]] = {}  # request -> (at, fills)
        self._ended: dict[str, float] = {}  # session -> when its last turn ended
        self._gap: Average | None = None

    def live_share(self, worker_id: str, kv_usage: float, now_s: float, continuing: float) -> float:
        """The share of KV filled on the worker now that comes out of live contexts."""
        gap = self._gap
        if gap is None or not gap.value > 0.0 or not continuing > 0.0:
            return 0.0
        total, as_of = self._filled.get(worker_id, (0.0, now_s))
        rate = decayed_rate(total, as_of, now_s, self._window_s, None)
        if not rate > 0.0:
            return 0.0
        free = (1.0 - kv_usage) * self._capacity
        turnover = (free if free > 0.0 else 0.0) / rate
        return continuing * math.exp(-turnover / gap.value)

    def place(self, request_id: str, fills: tuple[Fill, ...], now_s: float) -> None:
        """Count a placement's fills (deciding a request again replaces its earlier ones)."""
        earlier = self._placed.pop(request_id, None)
        if earlier is not None:
            at, old = earlier
            for worker_id, tokens in old:
                self._add(worker_id, -float(tokens), at)
        for worker_id, tokens in fills:
            self._add(worker_id, float(tokens), now_s)
        self._placed[request_id] = (now_s, fills)
        forget_oldest(self._placed)

    def returned(self, session_id: str, start_s: float) -> None:
        """A session's turn was placed to begin its prefill at `start_s` (its context must be
        cached until then): learn the gap since its last turn ended."""
        ended = self._ended.pop(session_id, None)
        if ended is None or start_s < ended:
            return
        if self._gap is None:
            self._gap = Average(start_s - ended, self._rate)
        else:
            self._gap.add(start_s - ended)

    def ended(self, request_id: str, session_id: str, now_s: float) -> None:
        """The session's turn `request_id` ended at `now_s`; its fills stay counted."""
        self._placed.pop(request_id, None)
        self._ended[session_id] = now_s
        forget_oldest(self._ended)

    def _add(self, worker_id: str, tokens: float, at_s: float) -> None:
        known = self._filled.get(worker_id, (0.0, at_s))
        total, as_of = decayed_add(*known, at_s, tokens, self._window_s)
        if worker_id in self._filled or len(self._filled) < tuning.MAX_TRACKED_WORKERS:
            self._filled[worker_id] = (total if total > 0.0 else 0.0, as_of)
