from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from router.fleet.prom_text import Sample, parse_samples

INF = math.inf

CASES: list[tuple[str, str, frozenset[str], dict[str, list[Sample]]]] = [
    ("no labels", "a 1\n", frozenset({"a"}), {"a": [({}, 1.0)]}),
    ("no trailing newline", "x 0\na 2", frozenset({"a"}), {"a": [({}, 2.0)]}),
    (
        "labels",
        'a{x="1",y="two"} 3\n',
        frozenset({"a"}),
        {"a": [({"x": "1", "y": "two"}, 3.0)]},
    ),
    (
        "escapes",
        'a{q="say \\"hi\\"",b="C:\\\\dir",n="two\\nlines"} 1\n',
        frozenset({"a"}),
        {"a": [({"q": 'say "hi"', "b": "C:\\dir", "n": "two\nlines"}, 1.0)]},
    ),
    (
        "unknown escape kept verbatim",
        'a{p="\\d+"} 1\n',
        frozenset({"a"}),
        {"a": [({"p": "\\d+"}, 1.0)]},
    ),
    (
        "separators inside a label value",
        'a{v="x,y} z=\\"w\\""} 5\n',
        frozenset({"a"}),
        {"a": [({"v": 'x,y} z="w"'}, 5.0)]},
    ),
    (
        "timestamp after the value",
        'a{x="1"} 2 1712345678000\n',
        frozenset({"a"}),
        {"a": [({"x": "1"}, 2.0)]},
    ),
    (
        "special and exponent values",
        'a{i="1"} +Inf\na{i="2"} -Inf\na{i="3"} 1.5e+06\na{i="4"} -2E-3\n',
        frozenset({"a"}),
        {
            "a": [
                ({"i": "1"}, INF),
                ({"i": "2"}, -INF),
                ({"i": "3"}, 1.5e6),
                ({"i": "4"}, -2e-3),
            ]
        },
    ),
    (
        "comments and blank lines, name in HELP text",
        "# HELP a a is 7\n# TYPE a gauge\n\n   \na 1\n# a 9\n",
        frozenset({"a"}),
        {"a": [({}, 1.0)]},
    ),
    (
        "longer names sharing the prefix are other metrics",
        "a_total 5\nab 3\na 1\na_total_created 7\n",
        frozenset({"a", "a_total"}),
        {"a": [({}, 1.0)], "a_total": [({}, 5.0)]},
    ),
    (
        "empty label set, trailing comma, spaces and tabs",
        'a{} 4\na{x="1",} 5\na{ x="2" , y="3" }\t6\n',
        frozenset({"a"}),
        {"a": [({}, 4.0), ({"x": "1"}, 5.0), ({"x": "2", "y": "3"}, 6.0)]},
    ),
    (
        "histogram buckets",
        'h_bucket{le="0.5"} 1\nh_bucket{le="+Inf"} 3\nh_sum 2.5\nh_count 3\n',
        frozenset({"h_bucket", "h_count"}),
        {"h_bucket": [({"le": "0.5"}, 1.0), ({"le": "+Inf"}, 3.0)], "h_count": [({}, 3.0)]},
    ),
    ("absent name", "b 1\n", frozenset({"a"}), {}),
    ("carriage returns", "a 1\r\nb 2\r\n", frozenset({"a"}), {"a": [({}, 1.0)]}),
    (
        "malformed lines of other metrics are not examined",
        'b{x="unterminated 1\nc 1 2 3 4\na 8\n',
        frozenset({"a"}),
        {"a": [({}, 8.0)]},
    ),
]


@pytest.mark.parametrize(
    ("text", "wanted", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_parse_samples(
    text: str, wanted: frozenset[str], expected: dict[str, list[Sample]]
) -> None:
    assert parse_samples(text, wanted) == expected


def test_nan_value() -> None:
    parsed = parse_samples('a{x="1"} NaN\n', frozenset({"a"}))
    [(labels, value)] = parsed["a"]
    assert labels == {"x": "1"} and math.isnan(value)


@pytest.mark.parametrize(
    "text",
    [
        'a{x="1" 2\n',
        'a{x="1\n',
        "a{x=1} 2\n",
        'a{x="1"}\n',
        "a \n",
        "a notanumber\n",
        "a 1 2 3\n",
    ],
)
def test_malformed_wanted_line_raises(text: str) -> None:
    with pytest.raises(ValueError, match="'a'"):
        parse_samples(text, frozenset({"a"}))


label_values = st.text(min_size=0, max_size=12)
values = st.floats(allow_nan=False, allow_infinity=True)


@settings(max_examples=200, deadline=None)
@given(series=st.dictionaries(label_values, values, max_size=6))
def test_round_trips_what_prometheus_client_renders(series: dict[str, float]) -> None:
    registry = CollectorRegistry()
    gauge = Gauge("probe_value", "A probe.", ["tag"], registry=registry)
    for tag, value in series.items():
        gauge.labels(tag).set(value)
    text = generate_latest(registry).decode()
    parsed = parse_samples(text, frozenset({"probe_value"}))
    assert {labels["tag"]: value for labels, value in parsed.get("probe_value", [])} == series


def test_reads_histograms_and_counters_as_prometheus_client_writes_them() -> None:
    registry = CollectorRegistry()
    histogram = Histogram("lat_seconds", "Latency.", ["op"], buckets=(0.3, 1.0), registry=registry)
    counter = Counter("ops", "Ops.", ["op"], registry=registry)
    for sample in (0.25, 0.5, 4.0):
        histogram.labels("get").observe(sample)
    counter.labels("get").inc(3)
    text = generate_latest(registry).decode()
    parsed = parse_samples(text, frozenset({"lat_seconds_bucket", "ops_total", "lat_seconds_sum"}))
    assert parsed == {
        "lat_seconds_bucket": [
            ({"op": "get", "le": "0.3"}, 1.0),
            ({"op": "get", "le": "1.0"}, 2.0),
            ({"op": "get", "le": "+Inf"}, 3.0),
        ],
        "lat_seconds_sum": [({"op": "get"}, 4.75)],
        "ops_total": [({"op": "get"}, 3.0)],
    }
