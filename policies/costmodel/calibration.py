"""The learning parts of `policies.costmodel.estimates`: roof correction factors, running means and
the queue-wait model.

Queue wait, as the router can measure it: the router forwards a turn at once, so its own
queue stage (decision to the first leg sent) is about 0 and the wait happens inside the
engine, before the prefill runs. What a turn measures is the prefill stage (a handoff's
prefill leg) or its TTFT (a turn run whole on one worker): queue wait + prefill. The wait
sample is that stage less the prefill predicted for it (plus the router's own queue stage),
so the queue model learns the time the roofline cannot explain, and the roof factors learn
only from turns that found no queue ahead.

    wait(q) = max(0, base + factor x q x typical)

`base` is the mean wait sample at q = 0 (the step in progress, the router's legs; less the
prefill work the placement knew was ahead, which the policy's ledger predicts itself), `factor`
the ratio of the mean excess wait (sample - base) to the mean q x typical over the samples
with q > 0 (a ratio of means, not a mean of ratios, so noisy small samples do not bias it),
starting at 1 (each request ahead costs one typical prefill), kept within the factor bounds.
"""

from __future__ import annotations

import math

from policies.costmodel.roofline import Terms
from policies.types import WorkerView

FACTOR_MIN = 0.05
FACTOR_MAX = 20.0


class Correction:
    """Learned multipliers of the compute and memory roofs of one quantity."""

    __slots__ = ("compute", "memory")

    def __init__(self, compute: float = 1.0, memory: float = 1.0) -> None:
        self.compute = compute
        self.memory = memory

    def copy(self) -> Correction:
        return Correction(self.compute, self.memory)

    def predict(self, terms: Terms) -> float:
        overhead, compute_a, memory_a, compute_b, memory_b = terms
        fc, fm = self.compute, self.memory
        a_compute, a_memory = compute_a * fc, memory_a * fm
        b_compute, b_memory = compute_b * fc, memory_b * fm
        # The slower roof of each part (max() spelled out: every estimate of a turn's
        # candidates runs this).
        a = a_memory if a_memory > a_compute else a_compute
        b = b_memory if b_memory > b_compute else b_compute
        return overhead + a + b

    def update(self, terms: Terms, observed: float, rate: float) -> None:
        overhead, compute_a, memory_a, compute_b, memory_b = terms
        fc, fm = self.compute, self.memory
        a_compute, a_memory = compute_a * fc, memory_a * fm
        b_compute, b_memory = compute_b * fc, memory_b * fm
        a = max(a_compute, a_memory)
        b = max(b_compute, b_memory)
        excess = observed - overhead
        ratio = excess / (a + b)
        # Each roof moves by the observed/predicted ratio, as much as it binds the prediction.
        compute_share = (
            (a if a_compute >= a_memory else 0.0) + (b if b_compute >= b_memory else 0.0)
        ) / (a + b)
        if compute_share > 0.0:
            self.compute = blend(fc, fc * ratio, rate * compute_share)
        if compute_share < 1.0:
            self.memory = blend(fm, fm * ratio, rate * (1.0 - compute_share))
        # A roof that alone exceeds the observation is too high, binding or not.
        compute = compute_a + compute_b
        if compute * fc > excess:
            self.compute = min(self.compute, blend(fc, excess / compute, rate))
        memory = memory_a + memory_b
        if memory * fm > excess:
            self.memory = min(self.memory, blend(fm, excess / memory, rate))


class Average:
    """A running mean (the prior counting as one sample) that turns into an EWMA at `rate`
    once 1 / rate samples are in, so a rough prior is forgotten after the first samples."""

    __slots__ = ("count", "rate", "value")

    def __init__(self, prior: float, rate: float) -> None:
        self.value = prior
        self.rate = rate
        self.count = 1

    def add(self, sample: float) -> None:
        self.count += 1
        weight = 1.0 / self.count
        self.value += (weight if weight > self.rate else self.rate) * (sample - self.value)


class QueueModel:
    """wait(q) = max(0, base + factor x q x typical), learned from wait samples (module)."""

    __slots__ = ("_base", "_excess", "_load")

    def __init__(self, typical_ms: float, rate: float) -> None:
        self._base = Average(0.0, rate)
        self._excess = Average(typical_ms, rate)
        self._load = Average(typical_ms, rate)

    @property
    def base_ms(self) -> float:
        return self._base.value

    @property
    def factor(self) -> float:
        load = self._load.value
        if not load > 0.0:
            return 1.0
        factor = self._excess.value / load
        return min(max(factor, FACTOR_MIN), FACTOR_MAX)

    def wait_ms(self, depth: float, typical_ms: float) -> float:
        wait = self._base.value
        if depth > 0:
            wait += self.factor * depth * typical_ms
        return wait if wait > 0.0 else 0.0

    def observe(self, wait_ms: float, depth: float, typical_ms: float) -> None:
        """One wait sample of a turn that found `depth` requests queued ahead of it (a
        fraction or a multiple of one where a request's prefill is known to be short or long)."""
        if not math.isfinite(wait_ms):
            return
        if depth <= 0:
            self._base.add(wait_ms)
            return
        self._excess.add(wait_ms - self._base.value)
        self._load.add(depth * typical_ms)


def plausible(value: float | None, limit: float) -> bool:
    return value is not None and 0.0 < value < limit


def blend(factor: float, target: float, rate: float) -> float:
    """Move `factor` toward `target` by `rate` in log space, both kept in the factor bounds."""
    target = min(max(target, FACTOR_MIN), FACTOR_MAX) if target == target else factor
    blended = factor * math.exp(rate * math.log(target / factor))
    return min(max(blended, FACTOR_MIN), FACTOR_MAX)


def queue_ahead(worker: WorkerView) -> int:
    """The requests a turn sent to `worker` now queues behind: those its last scrape saw
    waiting, plus the router's legs in flight there that the scrape has not counted yet,
    less those of either that have begun answering since (`started_since_scrape`)."""
    unseen = worker.inflight - worker.running - worker.waiting
    depth = worker.waiting + (unseen if unseen > 0 else 0) - worker.started_since_scrape
    return depth if depth > 0 else 0
