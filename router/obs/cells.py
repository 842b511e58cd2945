"""Per-request counters and histograms as plain numbers, exported through prometheus_client.

prometheus_client takes a lock and validates on every `inc` and `observe`; on a request's path
that is about a tenth of the router's Python work. These families keep their values in dicts
of floats (the router runs on one event loop thread, so no lock is needed) and turn them into
metric families only when /metrics is scraped. The exposition is the one prometheus_client
writes for its own Counter and Histogram, less the `_created` samples.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

LabelValues = tuple[str, ...]


class _Family:
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = list(labelnames)


class _ScalarCells(_Family):
    """One number per label values, moved by deltas."""

    _exported_as: type[CounterMetricFamily | GaugeMetricFamily]

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        known: Iterable[LabelValues] = (),
    ) -> None:
        super().__init__(name, documentation, labelnames)
        self.values: dict[LabelValues, float] = {key: 0.0 for key in known}
        if not self.labelnames:
            self.values[()] = 0.0

    def collect(self) -> Metric:
        family = self._exported_as(self.name, self.documentation, labels=self.labelnames)
        for key, value in self.values.items():
            family.add_metric(list(key), value)
        return family


class CounterCells(_ScalarCells):
    """A counter family; `name` without `_total` (exported as `name_total`)."""

    _exported_as = CounterMetricFamily

    def inc(self, key: LabelValues = (), amount: float = 1.0) -> None:
        self.values[key] = self.values.get(key, 0.0) + amount


class GaugeCells(_ScalarCells):
    """A gauge family moved by deltas (e.g. requests in flight per worker)."""

    _exported_as = GaugeMetricFamily

    def add(self, key: LabelValues, delta: float) -> None:
        self.values[key] = self.values.get(key, 0.0) + delta

    def set(self, key: LabelValues, value: float) -> None:
        self.values[key] = value


class HistogramCells(_Family):
    """A histogram family: per label values, a count per bucket (not cumulative) and a sum."""

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: Sequence[float],
        labelnames: Sequence[str] = (),
        known: Iterable[LabelValues] = (),
    ) -> None:
        super().__init__(name, documentation, labelnames)
        bounds = [float(b) for b in buckets if not math.isinf(b)]
        if bounds != sorted(bounds) or len(set(bounds)) != len(bounds):
            raise ValueError(f"{name}: buckets must increase strictly, got {buckets}")
        self.bounds = tuple(bounds)
        self._le: tuple[str, ...] = tuple(
            floatToGoString(b)  # type: ignore[no-untyped-call]  # as prometheus_client writes `le`
            for b in (*bounds, math.inf)
        )
        self._size = len(bounds) + 2  # the finite buckets, +Inf, and the sum last
        self.cells: dict[LabelValues, list[float]] = {key: [0.0] * self._size for key in known}
        if not self.labelnames:
            self.cells[()] = [0.0] * self._size

    def observe(self, value: float, key: LabelValues = ()) -> None:
        cell = self.cells.get(key)
        if cell is None:
            cell = self.cells[key] = [0.0] * self._size
        cell[bisect_left(self.bounds, value)] += 1.0  # `le` is inclusive, as Prometheus has it
        cell[-1] += value

    def collect(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, cell in self.cells.items():
            running = 0.0
            buckets: list[tuple[str, float]] = []
            for le, count in zip(self._le, cell, strict=False):
                running += count
                buckets.append((le, running))
            family.add_metric(list(key), buckets, cell[-1])
        return family


class CellsCollector(Collector):
    """Exports the given families from a prometheus_client registry."""

    def __init__(self, families: Sequence[CounterCells | GaugeCells | HistogramCells]) -> None:
        self._families = tuple(families)

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            yield family.collect()

    def register(self, registry: CollectorRegistry) -> None:
        registry.register(self)
