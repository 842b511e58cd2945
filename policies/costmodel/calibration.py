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

# The fit's vectors, one number each: fixed-size tuples of floats, which mypyc keeps unboxed
# (the fit runs up to four times per outcome).
Vector = tuple[float, float, float, float, float]
Mask = tuple[bool, bool, bool, bool, bool]
# The fit's covariance, symmetric: its upper triangle row by row, (0,0) (0,1) .. (0,4) (1,1)
# .. (1,4) (2,2) .. (4,4).
Covariance = tuple[
    float, float, float, float, float, float, float, float, float, float, float, float, float,
    float, float,
]  # fmt: skip
# Where entry (i, j) of the matrix lies in a `Covariance`.
_AT = tuple(tuple((min(i, j) * (2 * PARAMETERS + 1 - min(i, j))) // 2 + abs(i - j)
                  for j in range(PARAMETERS)) for i in range(PARAMETERS))  # fmt: skip


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
        base = base_spread_ms * base_spread_ms
        self._prior_var: Vector = (base, spread, spread, spread, spread)
        self._cov: Covariance = (base, 0.0, 0.0, 0.0, 0.0, spread, 0.0, 0.0, 0.0,
                                 spread, 0.0, 0.0, spread, 0.0, spread)  # fmt: skip

    def copy(self) -> Correction:
        out = Correction()
        out.base, out.overhead = self.base, self.overhead
        out.linear, out.attention, out.memory = self.linear, self.attention, self.memory
        out._prior_var = self._prior_var
        out._cov = self._cov
        return out

    def covariance(self) -> list[list[float]]:
        """The fit's covariance as a matrix."""
        cov = list(self._cov)
        return [[cov[_AT[i][j]] for j in range(PARAMETERS)] for i in range(PARAMETERS)]

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
        fl, fa, fm = self.linear, self.attention, self.memory
        theta: Vector = (self.base, self.overhead, fl, fa, fm)
        # Each part teaches the roof that binds it now.
        x_linear = x_attention = x_memory = 0.0
        if linear_a * fl + attention_a * fa >= memory_a * fm:
            x_linear += linear_a
            x_attention += attention_a
        else:
            x_memory += memory_a
        if linear_b * fl + attention_b * fa >= memory_b * fm:
            x_linear += linear_b
            x_attention += attention_b
        else:
            x_memory += memory_b
        x: Vector = (1.0 if with_base else 0.0, overhead, x_linear, x_attention, x_memory)
        predicted = _dot(theta, x)
        if not observed > 0.0 or not predicted > 0.0:
            return
        scale = math.sqrt(observed * predicted)
        z: Vector = (x[0] / scale, x[1] / scale, x[2] / scale, x[3] / scale, x[4] / scale)
        target = observed / scale
        cov = self._cov
        forget = 1.0 - 1.0 / memory_s
        # A step that would take a number past its bound pins it there, and the step is taken
        # again for the others with it fixed: clipped after the step, a number at its bound
        # (attention's factor at FACTOR_MIN, say) dropped its share of the step while the
        # numbers correlated with it kept theirs, and the base, stepping against it sample
        # after sample, went from tens of ms to a minute while every turn took 30 ms.
        free: Mask = (True, True, True, True, True)
        gains: Vector = (0.0, 0.0, 0.0, 0.0, 0.0)
        pz = gains
        for _ in range(PARAMETERS):
            zf = _masked(z, free)
            pz = _masked(_times(cov, zf), free)
            denominator = forget + _dot(zf, pz)
            if not denominator > 0.0:
                return
            error = target - _dot(theta, z)
            gains = (pz[0] / denominator, pz[1] / denominator, pz[2] / denominator,
                     pz[3] / denominator, pz[4] / denominator)  # fmt: skip
            stepped = (theta[0] + gains[0] * error, theta[1] + gains[1] * error,
                       theta[2] + gains[2] * error, theta[3] + gains[3] * error,
                       theta[4] + gains[4] * error)  # fmt: skip
            out = _outside(stepped, free)
            if not (out[0] or out[1] or out[2] or out[3] or out[4]):
                theta = stepped
                break
            theta = _pinned(theta, stepped, out)
            free = (free[0] and not out[0], free[1] and not out[1], free[2] and not out[2],
                    free[3] and not out[3], free[4] and not out[4])  # fmt: skip
        cov = _downdated(cov, gains, pz, forget, free)
        if not (free[0] and free[1] and free[2] and free[3] and free[4]):
            # The pinned numbers' covariances with the others no longer hold: dropped, the
            # matrix stays positive semi-definite (two blocks that each are).
            cov = _decoupled(cov, free)
        # A direction no sample excites would grow without bound as it is forgotten (windup):
        # no number is ever less certain than its prior.
        prior = self._prior_var
        if (cov[0] > prior[0] or cov[5] > prior[1] or cov[9] > prior[2] or cov[12] > prior[3]
                or cov[14] > prior[4]):  # fmt: skip
            cov = _wound_down(cov, prior)
        self._cov = cov
        self.base, self.overhead, self.linear, self.attention, self.memory = theta


def _dot(a: Vector, b: Vector) -> float:
    return 0.0 + a[0] * b[0] + a[1] * b[1] + a[2] * b[2] + a[3] * b[3] + a[4] * b[4]


def _masked(v: Vector, keep: Mask) -> Vector:
    """`v`, 0 where not `keep`."""
    return (v[0] if keep[0] else 0.0, v[1] if keep[1] else 0.0, v[2] if keep[2] else 0.0,
            v[3] if keep[3] else 0.0, v[4] if keep[4] else 0.0)  # fmt: skip


def _times(c: Covariance, v: Vector) -> Vector:
    """The matrix `c` times `v`, each row summed in column order."""
    v0, v1, v2, v3, v4 = v
    return (
        0.0 + c[0] * v0 + c[1] * v1 + c[2] * v2 + c[3] * v3 + c[4] * v4,
        0.0 + c[1] * v0 + c[5] * v1 + c[6] * v2 + c[7] * v3 + c[8] * v4,
        0.0 + c[2] * v0 + c[6] * v1 + c[9] * v2 + c[10] * v3 + c[11] * v4,
        0.0 + c[3] * v0 + c[7] * v1 + c[10] * v2 + c[12] * v3 + c[13] * v4,
        0.0 + c[4] * v0 + c[8] * v1 + c[11] * v2 + c[13] * v3 + c[14] * v4,
    )


def _outside(v: Vector, free: Mask) -> Mask:
    """Which free numbers of `v` lie past their bounds."""
    return (
        free[0] and not _LOWER[0] <= v[0] <= _UPPER[0],
        free[1] and not _LOWER[1] <= v[1] <= _UPPER[1],
        free[2] and not _LOWER[2] <= v[2] <= _UPPER[2],
        free[3] and not _LOWER[3] <= v[3] <= _UPPER[3],
        free[4] and not _LOWER[4] <= v[4] <= _UPPER[4],
    )


def _pinned(theta: Vector, stepped: Vector, out: Mask) -> Vector:
    """`theta` with each number `out` at the bound `stepped` passed."""
    pinned = list(theta)
    for i in range(PARAMETERS):
        if out[i]:
            pinned[i] = _LOWER[i] if stepped[i] < _LOWER[i] else _UPPER[i]
    return pinned[0], pinned[1], pinned[2], pinned[3], pinned[4]


def _downdated(c: Covariance, g: Vector, p: Vector, forget: float, free: Mask) -> Covariance:
    """(c - g p') / forget on the free rows and columns (entry (i, j), i <= j, from g[i] and
    p[j]), the rest as it was."""
    f0, f1, f2, f3, f4 = free
    return (
        (c[0] - g[0] * p[0]) / forget if f0 else c[0],
        (c[1] - g[0] * p[1]) / forget if f0 and f1 else c[1],
        (c[2] - g[0] * p[2]) / forget if f0 and f2 else c[2],
        (c[3] - g[0] * p[3]) / forget if f0 and f3 else c[3],
        (c[4] - g[0] * p[4]) / forget if f0 and f4 else c[4],
        (c[5] - g[1] * p[1]) / forget if f1 else c[5],
        (c[6] - g[1] * p[2]) / forget if f1 and f2 else c[6],
        (c[7] - g[1] * p[3]) / forget if f1 and f3 else c[7],
        (c[8] - g[1] * p[4]) / forget if f1 and f4 else c[8],
        (c[9] - g[2] * p[2]) / forget if f2 else c[9],
        (c[10] - g[2] * p[3]) / forget if f2 and f3 else c[10],
        (c[11] - g[2] * p[4]) / forget if f2 and f4 else c[11],
        (c[12] - g[3] * p[3]) / forget if f3 else c[12],
        (c[13] - g[3] * p[4]) / forget if f3 and f4 else c[13],
        (c[14] - g[4] * p[4]) / forget if f4 else c[14],
    )


def _decoupled(c: Covariance, free: Mask) -> Covariance:
    """`c` with the entries between a free and a pinned number at 0."""
    entries = list(c)
    for i in range(PARAMETERS):
        for j in range(i + 1, PARAMETERS):
            if free[i] != free[j]:
                entries[_AT[i][j]] = 0.0
    return _covariance(entries)


def _wound_down(c: Covariance, prior: Vector) -> Covariance:
    """`c` with each number's variance past its prior scaled back to it (its row and column
    by the same factor, in number order)."""
    entries = list(c)
    for i in range(PARAMETERS):
        variance = entries[_AT[i][i]]
        if variance > prior[i]:
            shrink = math.sqrt(prior[i] / variance)
            for j in range(PARAMETERS):
                entries[_AT[i][j]] *= shrink
            entries[_AT[i][i]] *= shrink  # the diagonal twice: in its row and its column
    return _covariance(entries)


def _covariance(e: list[float]) -> Covariance:
    return (e[0], e[1], e[2], e[3], e[4], e[5], e[6], e[7], e[8], e[9], e[10], e[11], e[12],
            e[13], e[14])  # fmt: skip


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
