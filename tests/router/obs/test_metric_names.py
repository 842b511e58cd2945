"""Every family on /metrics follows Prometheus's naming conventions under `session_router_`,
and the older names are still there, marked deprecated, with the same samples."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.obs.aliases import DEPRECATED_NAMES
from router.obs.metrics import RouterMetrics
from tests.router.obs.test_metrics import observe_everything
from tests.router.turn.fake_upstream import Stack, spec

PREFIX = "session_router_"
# Prometheus's base units; a name carrying any other unit of time, size or proportion is wrong
NOT_BASE_UNITS = {
    "ms", "millis", "milliseconds", "us", "micros", "microseconds", "ns", "nanoseconds",
    "minutes", "hours", "days", "kb", "mb", "gb", "kib", "mib", "gib", "kilobytes",
    "megabytes", "bits", "percent", "pct", "perc",
}  # fmt: skip
# a histogram or summary measures something: its name ends with what
MEASURED_SUFFIXES = ("_seconds", "_bytes", "_ratio", "_tokens", "_requests")
PROPORTION_WORDS = re.compile(r"\b(0\.\.1|fraction|ratio|usage)\b", re.I)
LABEL_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def violations(text: str) -> list[str]:
    """What in an exposition breaks the conventions (empty when nothing does)."""
    found: list[str] = []
    old_names = set(DEPRECATED_NAMES.values())
    families = {family.name: family for family in text_string_to_metric_families(text)}
    # the parser puts back a counter sample's missing _total: look at the lines as written
    written = {re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines()
               if line and not line.startswith("#")}  # fmt: skip
    for name, family in families.items():
        where = f"{name} ({family.type})"
        if name.endswith("_created") and name.removesuffix("_created") in families:
            continue  # a counter's or histogram's creation time, written apart by the client
        if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
            found.append(f"{where}: not snake case (colons are for recording rules)")
        if name in old_names:
            if not family.documentation.startswith("Deprecated"):
                found.append(f"{where}: an old name whose help does not say it is deprecated")
            continue
        if not name.startswith(PREFIX):
            found.append(f"{where}: not under {PREFIX}")
        if not family.documentation.strip():
            found.append(f"{where}: no help text")
        words = set(name.split("_"))
        if words & NOT_BASE_UNITS:
            found.append(f"{where}: not in base units ({sorted(words & NOT_BASE_UNITS)})")
        if family.type == "counter" and name in written:
            found.append(f"{where}: counter sample {name} without _total")
        for sample in family.samples:
            if family.type != "counter" and sample.name.endswith("_total"):
                found.append(f"{where}: _total on a {family.type}")
            bad = [label for label in sample.labels if not LABEL_NAME.match(label)]
            if bad:
                found.append(f"{where}: label names {bad}")
        if family.type in ("histogram", "summary") and not name.endswith(MEASURED_SUFFIXES):
            found.append(f"{where}: no unit suffix")
        if family.type == "gauge" and name.endswith("_info"):
            if any(sample.value != 1 for sample in family.samples):
                found.append(f"{where}: an info metric whose value is not 1")
        elif (
            family.type == "gauge"
            and PROPORTION_WORDS.search(family.documentation)
            and not name.endswith("_ratio")
        ):
            found.append(f"{where}: a proportion without _ratio")
    return found


def exposition() -> str:
    metrics = RouterMetrics()
    observe_everything(metrics)
    metrics.bind_workers(["d0"])
    metrics.worker_ejection("d0", ejected=True, ejected_now=1)
    metrics.held(0.2)
    return metrics.render().decode()


def test_the_router_exposition_follows_the_conventions() -> None:
    assert violations(exposition()) == []


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("# HELP session_router_x_ms A time.\n# TYPE session_router_x_ms gauge\n"
         "session_router_x_ms 1\n", "base units"),
        ("# HELP router_x A thing.\n# TYPE router_x gauge\nrouter_x 1\n", "not under"),
        ("# HELP session_router_x Things.\n# TYPE session_router_x counter\n"
         "session_router_x 1\n", "without _total"),
        ("# HELP session_router_x_total Things.\n# TYPE session_router_x_total gauge\n"
         "session_router_x_total 1\n", "_total on a gauge"),
        ("# HELP session_router_kv KV usage, 0..1.\n# TYPE session_router_kv gauge\n"
         "session_router_kv 0.5\n", "without _ratio"),
        ("# HELP session_router_wait Waits.\n# TYPE session_router_wait histogram\n"
         'session_router_wait_bucket{le="+Inf"} 1\nsession_router_wait_count 1\n'
         "session_router_wait_sum 1\n", "no unit suffix"),
        ("# HELP session_router_build_info Build.\n# TYPE session_router_build_info gauge\n"
         "session_router_build_info 2\n", "not 1"),
        ("# HELP router_requests_total Turns.\n# TYPE router_requests_total counter\n"
         "router_requests_total 1\n", "deprecated"),
    ],
)  # fmt: skip
def test_the_checker_finds_each_kind_of_violation(text: str, complaint: str) -> None:
    found = violations(text)
    assert len(found) == 1 and complaint in found[0], found


def test_every_old_name_is_exported_with_the_samples_of_its_new_name() -> None:
    families = {family.name: family for family in text_string_to_metric_families(exposition())}
    assert set(DEPRECATED_NAMES) <= set(families)
    for new, old in DEPRECATED_NAMES.items():
        current, deprecated = families[new], families[old]
        assert deprecated.type == current.type
        assert "renamed " + new in deprecated.documentation
        assert [(s.name[len(old) :], s.labels, s.value) for s in deprecated.samples] == [
            (s.name[len(new) :], s.labels, s.value) for s in current.samples
        ], new
    # every family is either current (and has an old name) or one of the old names
    listed = {name for name in families if not name.endswith("_created")}
    assert listed == set(DEPRECATED_NAMES) | set(DEPRECATED_NAMES.values())


@pytest.fixture
async def stack(redis_url: str) -> AsyncIterator[Stack]:
    async with Stack(redis_url) as stack:
        yield stack


async def test_the_metrics_endpoint_follows_the_conventions_after_turns(stack: Stack) -> None:
    worker = await stack.worker("a")
    router = await stack.router([spec(worker)])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with stack.http.post(router.url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200
        await response.read()
    async with stack.http.get(router.url + "/metrics") as response:
        assert response.status == 200
        text = await response.text()
    assert violations(text) == []
    assert await router.metric(stack.http, "session_router_requests_total") >= 1
    assert await router.metric(stack.http, "router_requests_total") >= 1
