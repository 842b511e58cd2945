"""Admission: reject a turn only when even a lucky outcome of its prediction misses the
TTFT objective.

Predicted TTFTs err both ways (a queue estimated from a ledger of estimates, a scrape up to
an interval old). Rejecting a turn that would have met its objective loses a good request
outright, and its session's next turn finds no cache; serving one that misses only costs the
work it takes. So the policy keeps the ratios of measured to predicted TTFT of its recent
turns and rejects only when the prediction times their `quantile` still exceeds the
objective. Until `min_samples` turns are known the prediction stands as it is, and
optimistic predictions never make admission stricter than it.
"""

from __future__ import annotations

import math
from collections import deque

WINDOW = 256
QUANTILE = 0.2
MIN_SAMPLES = 32
REFRESH = 16  # new ratios between two sorts of the window
RATIO_MIN = 0.25  # a few wild samples never admit everything


class Admission:
    """The measured / predicted TTFT ratios of the latest `window` turns, and the verdict."""

    __slots__ = ("_fresh", "_low", "_ratios", "min_samples", "quantile")

    def __init__(
        self, window: int = WINDOW, quantile: float = QUANTILE, min_samples: int = MIN_SAMPLES
    ) -> None:
        if window < 1 or not 0.0 <= quantile <= 1.0 or min_samples < 1:
            raise ValueError("window >= 1, 0 <= quantile <= 1 and min_samples >= 1")
        self._ratios: deque[float] = deque(maxlen=window)
        self._fresh = 0
        self._low = 1.0
        self.quantile = quantile
        self.min_samples = min_samples

    @property
    def low_ratio(self) -> float:
        """How far below its prediction a turn's TTFT lands at the `quantile` (<= 1)."""
        return self._low

    def observe(self, predicted_ms: float, measured_ms: float | None) -> None:
        if measured_ms is None or not (predicted_ms > 0.0 and measured_ms > 0.0):
            return
        ratio = measured_ms / predicted_ms
        if not math.isfinite(ratio):
            return
        self._ratios.append(ratio)
        self._fresh += 1
        if self._fresh >= REFRESH and len(self._ratios) >= self.min_samples:
            self._fresh = 0
            ordered = sorted(self._ratios)
            low = ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]
            self._low = min(1.0, max(RATIO_MIN, low))

    def admits(self, predicted_ms: float, objective_ms: float) -> bool:
        return predicted_ms * self._low <= objective_ms
