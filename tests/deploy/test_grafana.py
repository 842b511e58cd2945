"""The Grafana dashboard imports into an existing Grafana (its data source is a variable) and
queries only metrics that exist: the router's own, or the workers' (vLLM or SGLang)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.obs.aliases import DEPRECATED_NAMES
from router.obs.metrics import RouterMetrics
from tests.procs import ROOT
from tests.router.obs.test_metrics import observe_everything
from tests.sim.worker.test_vllm_metrics import _worker_metrics

DASHBOARD_PATH = ROOT / "deploy/grafana/dashboards/session-router.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# SGLang's histograms the dashboard may read (python/sglang/srt/metrics/collector.py,
# TokenizerMetricsCollector; docs/references/production_metrics.md)
SGLANG_HISTOGRAMS = (
    "sglang:time_to_first_token_seconds",
    "sglang:inter_token_latency_seconds",
    "sglang:e2e_request_latency_seconds",
)
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
                "unless", "offset", "bool", "inf", "nan"}  # fmt: skip


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD_PATH.read_text())
    return loaded


def targets() -> Iterator[tuple[str, dict[str, Any]]]:
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            yield panel["title"], target


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)  # grouping labels
    words = re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", expr)
    return {word for word, call in words if not call and word.lower() not in PROMQL_WORDS}


def exported() -> set[str]:
    """Every sample name the router and a simulated vLLM worker write, and SGLang's."""
    metrics = RouterMetrics()
    observe_everything(metrics)
    pages = [metrics.render().decode(), _worker_metrics().render().decode()]
    names = {sample.name for page in pages
             for family in text_string_to_metric_families(page)
             for sample in family.samples}  # fmt: skip
    names |= {name + suffix for name in SGLANG_HISTOGRAMS
              for suffix in ("_bucket", "_sum", "_count")}  # fmt: skip
    return names


def test_every_panel_and_query_uses_the_datasource_variable() -> None:
    board = dashboard()
    assert [v["name"] for v in board["templating"]["list"] if v["type"] == "datasource"] == [
        "datasource"
    ]
    variable = next(v for v in board["templating"]["list"] if v["name"] == "datasource")
    assert variable["query"] == "prometheus"
    assert board["id"] is None  # an import creates the dashboard anew
    for panel in board["panels"]:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
    # no data source uid of one Grafana left anywhere
    uids = re.findall(r'"uid":\s*"([^"]*)"', DASHBOARD_PATH.read_text())
    assert set(uids) == {"${datasource}", board["uid"]}


@pytest.mark.parametrize(("title", "target"), list(targets()))
def test_every_query_reads_metrics_that_exist(title: str, target: dict[str, Any]) -> None:
    names = metric_names(target["expr"])
    assert names, (title, target["expr"])
    assert names <= exported(), (title, sorted(names - exported()))
    # the current names, not those kept for one release
    old = set(DEPRECATED_NAMES.values())
    assert not {n for n in names if re.sub(r"_(bucket|sum|count|total)$", "", n) in old}


def test_inter_token_latency_reads_vllm_and_sglang_workers() -> None:
    panel = next(p for p in dashboard()["panels"] if "Inter-token latency" in p["title"])
    names = set().union(*(metric_names(t["expr"]) for t in panel["targets"]))
    assert names == {
        "vllm:inter_token_latency_seconds_bucket",
        "sglang:inter_token_latency_seconds_bucket",
    }
    assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("sum(rate(a_total[1m])) by (le, kind)", {"a_total"}),
        ('max(b{worker="x"}) by (worker) / on (worker) c', {"b", "c"}),
        ("histogram_quantile(0.99, sum(rate(vllm:x_bucket[5m])) by (le))", {"vllm:x_bucket"}),
    ],
)
def test_metric_names_finds_the_series_of_an_expression(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names
