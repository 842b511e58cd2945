"""The plain-number families export exactly what prometheus_client's own would."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from router.obs.cells import CellsCollector, CounterCells, GaugeCells, HistogramCells

BUCKETS = (0.0, 1e-6, 0.001, 0.25, 1.0, 2.5, 123456789.0)
VALUES = [-3.0, 0.0, 1e-6, 5e-7, 0.001, 0.0011, 0.25, 1.0, 2.4999, 2.5, 9.0, 1e12, math.inf]


def _lines(registry: CollectorRegistry) -> list[str]:
    text = generate_latest(registry).decode()
    return sorted(line for line in text.splitlines() if "_created" not in line)


@pytest.mark.parametrize("labelled", [False, True])
def test_histogram_matches_prometheus_client(labelled: bool) -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    labels = ["term"] if labelled else []
    reference = Histogram("probe_seconds", "A probe.", labels, buckets=BUCKETS, registry=theirs)
    cells = HistogramCells("probe_seconds", "A probe.", BUCKETS, labels)
    CellsCollector([cells]).register(ours)
    for i, value in enumerate(VALUES):
        key = (f"t{i % 3}",) if labelled else ()
        (reference.labels(*key) if labelled else reference).observe(value)
        cells.observe(value, key)
    assert _lines(ours) == _lines(theirs)


def test_counter_and_gauge_match_prometheus_client() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    counter = Counter("probe_total", "Probes.", ["a", "b"], registry=theirs)
    unlabelled = Counter("bytes_total", "Bytes.", registry=theirs)
    gauge = Gauge("probe_inflight", "In flight.", ["worker"], registry=theirs)
    counter_cells = CounterCells("probe", "Probes.", ["a", "b"], known=[("x", "y")])
    unlabelled_cells = CounterCells("bytes", "Bytes.")
    gauge_cells = GaugeCells("probe_inflight", "In flight.", ["worker"])
    CellsCollector([counter_cells, unlabelled_cells, gauge_cells]).register(ours)
    counter.labels("x", "y")  # bound up front: exported at 0
    for _ in range(3):
        counter.labels("p", "q").inc()
        counter_cells.inc(("p", "q"))
    unlabelled.inc(1 << 40)
    unlabelled_cells.inc((), 1 << 40)
    for delta in (1, 1, -1, 1):
        gauge.labels("w0").inc(delta)
        gauge_cells.add(("w0",), delta)
    gauge.labels("w1").set(5)
    gauge_cells.set(("w1",), 5)
    assert _lines(ours) == _lines(theirs)


def test_buckets_must_increase() -> None:
    with pytest.raises(ValueError, match="increase strictly"):
        HistogramCells("bad", "Bad.", (1.0, 0.5))
