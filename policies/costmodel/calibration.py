"""The learning parts of `policies.costmodel.estimates`: the fit of the roofline's correction,
running means and the queue-wait model.

The correction (`Correction`) is a linear model of a stage's ms in five numbers, theta =
(base, fo, fl, fa, fm), over the stage's terms x = (1 for a prefill stage's base, the step
overhead, and the linear, attention or memory terms of the roof that binds each part):
observed = theta . x. Each observation is a step of recursive least squares with forgetting
(about `memory_s` samples), on the error relative to sqrt(observed x predicted), so a stage
4x faster than predicted weighs what one 4x slower does, and seconds-long outliers weigh what
their ratio says, not their ms. The covariance starts at the prior's spread (`FACTOR_SPREAD`,
the base's own spread) and no variance may grow past it: a direction no sample excites (a
roof that never binds) would otherwise grow without bound as it is forgotten. A step that
would take a number past its bound pins it there and is taken again for the others.

Queue wait, as the router can measure it: the router forwards a turn at once, so its own
queue stage (decision to the first leg sent) is about 0 and the wait happens inside the
engine, before the prefill runs. What a turn measures is the prefill stage (a handoff's
prefill leg) or its TTFT (a turn run whole on one worker): queue wait + prefill.

    wait(q) = max(0, base + factor x q x typical)

`base` is the fit's: what a turn that finds no queue waits besides its prefill (the step in
progress, the engine's handling, the router's legs; the prefill work the placement knew was
ahead is the policy's ledger's to predict). `factor` is the ratio of the mean excess wait
(the stage less the predicted prefill and the base) to the mean q x typical over the samples
with q > 0 (a ratio of means, not a mean of ratios, so noisy small samples do not bias it),
starting at 1 (each request ahead costs one typical prefill), kept within the factor bounds.
"""

from __future__ import annotations

import math

from policies.costmodel.roofline import Terms
from policies.types import WorkerView

FACTOR_MIN = 0.05
FACTOR_MAX = 20.0
# How far a roof factor may be from its prior before the first sample: a preset GPU a few
# times off the real one (a CPU build, other engines sharing its cores).
FACTOR_SPREAD = 4.0
# The base stays below a minute.
BASE_MAX_MS = 60_000.0
# The fitted numbers: the base, then the factors of the step overhead, the weights' products,
# attention and the memory roof.
PARAMETERS = 5
_LOWER = (0.0, FACTOR_MIN, FACTOR_MIN, FACTOR_MIN, FACTOR_MIN)
_UPPER = (BASE_MAX_MS, FACTOR_MAX, FACTOR_MAX, FACTOR_MAX, FACTOR_MAX)


class Correction:
    """The roofline's correction for one GPU, fitted as one model (module): a base (what a
    prefill stage that found no queue holds besides its steps) and multipliers of the step
    overhead and of the roofs (the compute roof's two parts, the weights' matrix products and
    attention over the context, and the memory roof)."""

    __slots__ = ("_cov", "_prior_var", "attention", "base", "linear", "memory", "overhead")

    def __init__(self, *, base_spread_ms: float = 1.0) -> None:
        self.base = 0.0
        self.overhead = 1.0
        self.linear = 1.0
        self.attention = 1.0
        self.memory = 1.0
        spread = FACTOR_SPREAD * FACTOR_SPREAD
        self._prior_var = (base_spread_ms * base_spread_ms, spread, spread, spread, spread)
        self._cov = [[v if i == j else 0.0 for j, v in enumerate(self._prior_var)]
                     for i in range(PARAMETERS)]  # fmt: skip

    def copy(self) -> Correction:
        out = Correction()
        out.base, out.overhead = self.base, self.overhead
        out.linear, out.attention, out.memory = self.linear, self.attention, self.memory
        out._prior_var = self._prior_var
        out._cov = [list(row) for row in self._cov]
        return out

    def predict(self, terms: Terms) -> float:
        """The stage the terms describe, without the base."""
        overhead, linear_a, attention_a, memory_a, linear_b, attention_b, memory_b = terms
        fl, fa, fm = self.linear, self.attention, self.memory
        a_compute, a_memory = linear_a * fl + attention_a * fa, memory_a * fm
        b_compute, b_memory = linear_b * fl + attention_b * fa, memory_b * fm
        # The slower roof of each part (max() spelled out: every estimate of a turn's
        # candidates runs this).
        a = a_memory if a_memory > a_compute else a_compute
        b = b_memory if b_memory > b_compute else b_compute
        return overhead * self.overhead + a + b

    def update(self, terms: Terms, observed: float, with_base: bool, memory_s: float) -> None:
        """One observed stage (with the base when `with_base`): a step of recursive least
        squares, forgetting over `memory_s` samples, on the error relative to the geometric
        mean of the observation and the prediction (symmetric: a turn 4x faster than predicted
        weighs what one 4x slower does)."""
        overhead, linear_a, attention_a, memory_a, linear_b, attention_b, memory_b = terms
        theta = [self.base, self.overhead, self.linear, self.attention, self.memory]
        fl, fa, fm = self.linear, self.attention, self.memory
        # Each part teaches the roof that binds it now.
        x = [1.0 if with_base else 0.0, overhead, 0.0, 0.0, 0.0]
        for linear, attention, memory in ((linear_a, attention_a, memory_a),
                                          (linear_b, attention_b, memory_b)):  # fmt: skip
            if linear * fl + attention * fa >= memory * fm:
                x[2] += linear
                x[3] += attention
            else:
                x[4] += memory
        n = PARAMETERS
        predicted = sum(theta[i] * x[i] for i in range(n))
        if not observed > 0.0 or not predicted > 0.0:
            return
        scale = math.sqrt(observed * predicted)
        z = [value / scale for value in x]
        target = observed / scale
        cov = self._cov
        forget = 1.0 - 1.0 / memory_s
        # A step that would take a number past its bound pins it there, and the step is taken
        # again for the others with it fixed: clipped after the step, a number at its bound
        # (attention's factor at FACTOR_MIN, say) dropped its share of the step while the
        # numbers correlated with it kept theirs, and the base, stepping against it sample
        # after sample, went from tens of ms to a minute while every turn took 30 ms.
        free = [True] * n
        for _ in range(n):
            zf = [z[i] if free[i] else 0.0 for i in range(n)]
            pz = [sum(cov[i][j] * zf[j] for j in range(n)) if free[i] else 0.0
                  for i in range(n)]  # fmt: skip
            denominator = forget + sum(zf[i] * pz[i] for i in range(n))
            if not denominator > 0.0:
                return
            error = target - sum(theta[i] * z[i] for i in range(n))
            gains = [pz[i] / denominator for i in range(n)]
            stepped = [theta[i] + gains[i] * error for i in range(n)]
            out = [i for i in range(n) if free[i] and not _LOWER[i] <= stepped[i] <= _UPPER[i]]
            if not out:
                theta = stepped
                break
            for i in out:
                theta[i] = _LOWER[i] if stepped[i] < _LOWER[i] else _UPPER[i]
                free[i] = False
        for i in range(n):
            if not free[i]:
                continue
            row = cov[i]
            for j in range(i, n):
                if free[j]:
                    # symmetric by construction: rounding apart, the two halves would drift
                    row[j] = cov[j][i] = (row[j] - gains[i] * pz[j]) / forget
        if not all(free):
            # The pinned numbers' covariances with the others no longer hold: dropped, the
            # matrix stays positive semi-definite (two blocks that each are).
            for i in range(n):
                for j in range(n):
                    if free[i] != free[j]:
                        cov[i][j] = 0.0
        # A direction no sample excites would grow without bound as it is forgotten (windup):
        # no number is ever less certain than its prior.
        for i in range(n):
            variance = cov[i][i]
            if variance > self._prior_var[i]:
                shrink = math.sqrt(self._prior_var[i] / variance)
                for j in range(n):
                    cov[i][j] *= shrink
                    cov[j][i] *= shrink
        self.base, self.overhead, self.linear, self.attention, self.memory = theta


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
    """wait(q) = max(0, base + factor x q x typical), learned from wait samples (module); the
    base is the prefill fit's (`Correction.base`)."""

    __slots__ = ("_excess", "_load")

    def __init__(self, typical_ms: float, rate: float) -> None:
        self._excess = Average(typical_ms, rate)
        self._load = Average(typical_ms, rate)

    @property
    def factor(self) -> float:
        load = self._load.value
        if not load > 0.0:
            return 1.0
        factor = self._excess.value / load
        return min(max(factor, FACTOR_MIN), FACTOR_MAX)

    def wait_ms(self, depth: float, typical_ms: float, base_ms: float) -> float:
        wait = base_ms
        if depth > 0:
            wait += self.factor * depth * typical_ms
        return wait if wait > 0.0 else 0.0

    def observe(self, excess_ms: float, depth: float, typical_ms: float) -> None:
        """The wait past the base of a turn that found `depth` > 0 requests queued ahead of
        it (a fraction or a multiple of one where a request's prefill is known to be short or
        long)."""
        if not math.isfinite(excess_ms) or depth <= 0:
            return
        self._excess.add(excess_ms)
        self._load.add(depth * typical_ms)


def plausible(value: float | None, limit: float) -> bool:
    return value is not None and 0.0 < value < limit


def queue_ahead(worker: WorkerView) -> int:
    """The requests a turn sent to `worker` now queues behind: those its last scrape saw
    waiting, plus the router's legs in flight there that the scrape has not counted yet,
    less those of either that have begun answering since (`started_since_scrape`)."""
    unseen = worker.inflight - worker.running - worker.waiting
    depth = worker.waiting + (unseen if unseen > 0 else 0) - worker.started_since_scrape
    return depth if depth > 0 else 0
