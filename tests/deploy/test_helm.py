"""The Helm chart (deploy/helm/session-router) rendered by Helm itself and checked against
Kubernetes' schemas, offline.

Rendering and lint are Helm's own Go engine (v4), through helm-python-sdk's libhelm_c (a PyPI
wheel; no helm binary installs from our registries). The manifests are validated strictly
against the OpenAPI-derived JSON schemas kubernetes-validate ships, for the oldest and newest
Kubernetes minor it knows; the ServiceMonitor (a CRD) is checked by its fields."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.config import load_config
from session_router_cli import build_parser
from tests.procs import ROOT

helm = pytest.importorskip("helm_python", reason="the dev extra installs helm-python-sdk")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

CHART = ROOT / "deploy/helm/session-router"
EXAMPLE = ROOT / "deploy/helm/examples/vllm-pd-values.yaml"
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")
REDIS_URL = {"redis": {"url": "redis://redis.infra:6379/0"}}
STATIC: dict[str, Any] = {
    **REDIS_URL,
    "discovery": {"mode": "static"},
    "config": {"workers": [
        {"url": "http://prefill-0.vllm:8000", "role": "prefill"},
        {"url": "http://decode-0.vllm:8000", "role": "decode", "engine": "vllm"},
    ]},
}  # fmt: skip

SCENARIOS: dict[str, dict[str, Any]] = {
    "defaults with a Redis URL": REDIS_URL,
    "static workers": STATIC,
    "example vLLM P/D fleet": yaml.safe_load(EXAMPLE.read_text()),
    "redis subchart": {"redis": {"enabled": True}, "serviceMonitor": {"enabled": True}},
    "redis URL from a Secret, OpenTelemetry on": {
        "redis": {"urlSecret": {"name": "redis-url"}},
        "otel": {"enabled": True, "env": {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4317"}},
        "adminToken": {"secretName": "admin"},
        "apiKey": {"secretName": "api"},
    },
}


def render(
    values: dict[str, Any], release: str = "sr", namespace: str = "llm"
) -> list[dict[str, Any]]:
    chart = helm.Chart.load(CHART)
    rendered: dict[str, str] = chart.render(values=values, name=release, namespace=namespace)
    return [doc for path, text in sorted(rendered.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]  # fmt: skip


def one(manifests: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [m for m in manifests if m["kind"] == kind
             and (name is None or m["metadata"]["name"] == name)]  # fmt: skip
    assert len(found) == 1, (kind, name, [m["metadata"]["name"] for m in found])
    return found[0]


def router_container(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = one(manifests, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(container)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {entry["name"]: entry.get("value", entry.get("valueFrom")) for entry in container["env"]}


def router_toml(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    return tomllib.loads(one(manifests, "ConfigMap")["data"]["router.toml"])


@pytest.mark.parametrize("values", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_helm_lint_finds_no_error(values: dict[str, Any]) -> None:
    report = helm.lint(CHART, values, strict=True)
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("values", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_every_manifest_is_valid_for_kubernetes(values: dict[str, Any], version: str) -> None:
    manifests = render(values)
    assert {"Deployment", "Service", "ServiceAccount", "ConfigMap", "PodDisruptionBudget"} <= {
        m["kind"] for m in manifests
    }
    for manifest in manifests:
        if manifest["apiVersion"] == "monitoring.coreos.com/v1":
            continue  # a CRD: test_service_monitor_scrapes_the_router_service
        kubernetes_validate.validate(manifest, version, strict=True)


def test_the_deployment_runs_replicas_with_probes_on_health_and_ready() -> None:
    manifests = render({**REDIS_URL, "replicaCount": 3})
    deployment = one(manifests, "Deployment")
    assert deployment["spec"]["replicas"] == 3
    container = router_container(manifests)
    assert container["args"] == ["serve", "--config", "/etc/session-router/router.toml"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert [p["name"] for p in container["ports"]] == ["http"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    pod = deployment["spec"]["template"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    # Service, PDB and the pods agree on labels
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert one(manifests, "Service")["spec"]["selector"] == selector
    assert one(manifests, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"] == selector
    assert one(manifests, "PodDisruptionBudget")["spec"]["minAvailable"] == 1
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert mount["mountPath"] == "/etc/session-router"
    assert env_of(container)["SESSION_ROUTER_REDIS"] == "redis://redis.infra:6379/0"


def test_the_router_listens_where_the_probes_and_service_look() -> None:
    manifests = render({**REDIS_URL, "containerPort": 9000, "service": {"port": 80}})
    container = router_container(manifests)
    # the image sets SESSION_ROUTER_PORT=8000, which would outrank the TOML file's port
    assert env_of(container)["SESSION_ROUTER_PORT"] == "9000"
    assert env_of(container)["SESSION_ROUTER_HOST"] == "0.0.0.0"
    assert router_toml(manifests)["port"] == 9000
    assert container["ports"] == [{"name": "http", "containerPort": 9000, "protocol": "TCP"}]
    (port,) = one(manifests, "Service")["spec"]["ports"]
    assert (port["port"], port["targetPort"]) == (80, "http")


def test_a_changed_configuration_rolls_the_pods() -> None:
    def checksum(values: dict[str, Any]) -> str:
        pod = one(render(values), "Deployment")["spec"]["template"]
        return str(pod["metadata"]["annotations"]["checksum/config"])

    assert checksum(REDIS_URL) == checksum(REDIS_URL)
    assert checksum(REDIS_URL) != checksum({**REDIS_URL, "config": {"slo_itl_ms": 40}})


def test_static_workers_configuration_loads_in_the_router(tmp_path: Path) -> None:
    toml = router_toml(render(STATIC))
    assert toml["host"] == "0.0.0.0" and toml["port"] == 8000
    assert "discovery" not in toml and "otel" not in toml
    path = tmp_path / "router.toml"
    config = {**STATIC["config"], "kv_bytes_per_token": 65536}
    values = {**STATIC, "otel": {"enabled": True}, "config": config}
    path.write_text(one(render(values), "ConfigMap")["data"]["router.toml"])
    args = build_parser().parse_args(["serve", "--config", str(path)])
    loaded = load_config(args, environ={"SESSION_ROUTER_REDIS": "redis://redis.infra:6379/0"})
    assert [(w.url, w.role) for w in loaded.workers] == [
        ("http://prefill-0.vllm:8000", "prefill"), ("http://decode-0.vllm:8000", "decode")
    ]  # fmt: skip
    assert loaded.policy.name == "adaptive" and loaded.host == "0.0.0.0"
    assert loaded.redis == "redis://redis.infra:6379/0"
    assert loaded.otel is True and loaded.kv_bytes_per_token == 65536  # YAML numbers: floats
    # no discovery, so no RBAC
    assert not [m for m in render(STATIC) if m["kind"] in ("Role", "RoleBinding")]


def test_example_configuration_loads_in_the_router(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text(one(render(SCENARIOS["example vLLM P/D fleet"]), "ConfigMap")["data"][
        "router.toml"])  # fmt: skip
    args = build_parser().parse_args(["serve", "--config", str(path)])
    config = load_config(args, environ={"SESSION_ROUTER_REDIS": "redis://r:6379/0"})
    assert config.policy.name == "adaptive" and config.kv_bytes_per_token == 131072


def test_kubernetes_discovery_gets_a_role_to_watch_pods_in_the_workers_namespace() -> None:
    values = {**REDIS_URL, "discovery": {"mode": "kubernetes", "namespace": "workers",
                                         "selector": "app=vllm"}}  # fmt: skip
    manifests = render(values, namespace="routers")
    role = one(manifests, "Role")
    assert role["metadata"]["namespace"] == "workers"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]  # fmt: skip
    binding = one(manifests, "RoleBinding")
    account = one(manifests, "ServiceAccount")
    assert binding["metadata"]["namespace"] == "workers"
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": "routers"}]  # fmt: skip
    deployment = one(manifests, "Deployment")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"][
        "name"]  # fmt: skip
    toml = router_toml(manifests)
    assert (toml["discovery"], toml["discovery_namespace"], toml["discovery_selector"]) == (
        "kubernetes", "workers", "app=vllm")  # fmt: skip
    assert "workers" not in toml


def test_the_redis_subchart_is_what_the_routers_connect_to() -> None:
    manifests = render({"redis": {"enabled": True}}, release="pd")
    service = one(manifests, "Service", "pd-redis")
    assert service["spec"]["ports"][0]["port"] == 6379
    statefulset = one(manifests, "StatefulSet", "pd-redis")
    assert statefulset["spec"]["template"]["spec"]["containers"][0]["image"].startswith("redis:7.")
    secret = one(manifests, "Secret", "pd-redis")
    assert "password" in secret["data"]
    env = env_of(router_container(manifests))
    assert env["REDIS_PASSWORD"] == {"secretKeyRef": {"name": "pd-redis", "key": "password"}}
    assert env["SESSION_ROUTER_REDIS"] == "redis://:$(REDIS_PASSWORD)@pd-redis:6379/0"
    names = [entry["name"] for entry in router_container(manifests)["env"]]
    assert names.index("REDIS_PASSWORD") < names.index("SESSION_ROUTER_REDIS")  # $(VAR) order


def test_service_monitor_scrapes_the_router_service() -> None:
    assert not [m for m in render(REDIS_URL) if m["kind"] == "ServiceMonitor"]
    manifests = render({**REDIS_URL, "serviceMonitor": {"enabled": True,
                                                        "labels": {"release": "kps"}}})  # fmt: skip
    monitor = one(manifests, "ServiceMonitor")
    service = one(manifests, "Service")
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"][
        "labels"].items()  # fmt: skip
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in [port["name"] for port in service["spec"]["ports"]]


def test_secrets_and_otel_reach_the_environment() -> None:
    env = env_of(router_container(render(SCENARIOS["redis URL from a Secret, OpenTelemetry on"])))
    assert env["SESSION_ROUTER_REDIS"] == {"secretKeyRef": {"name": "redis-url", "key": "url"}}
    assert env["SESSION_ROUTER_ADMIN_TOKEN"] == {"secretKeyRef": {"name": "admin", "key": "token"}}
    assert env["SESSION_ROUTER_API_KEY"] == {"secretKeyRef": {"name": "api", "key": "key"}}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel:4317"
    assert env["OTEL_SERVICE_NAME"] == "sr-session-router"


@pytest.mark.parametrize(
    ("values", "error", "message"),
    [
        ({}, "HelmRenderError", "exactly one of redis.url"),
        ({"redis": {"url": "redis://a:6379", "enabled": True}}, "HelmRenderError",
         "exactly one of redis.url"),
        ({**REDIS_URL, "discovery": {"mode": "static"}}, "HelmRenderError", "config.workers"),
        ({**REDIS_URL, "discovery": {"selector": ""}}, "HelmRenderError", "discovery.selector"),
        ({"redis": {"url": "http://not-redis"}}, "HelmValuesError", "/redis/url"),
        ({**REDIS_URL, "replicaCount": 0}, "HelmValuesError", "/replicaCount"),
        ({**REDIS_URL, "config": {"host": "127.0.0.1"}}, "HelmValuesError", "/config"),
        ({**REDIS_URL, "discovery": {"mode": "consul"}}, "HelmValuesError", "/discovery/mode"),
    ],
)  # fmt: skip
def test_bad_values_are_refused_with_a_reason(
    values: dict[str, Any], error: str, message: str
) -> None:
    with pytest.raises(getattr(helm, error)) as caught:
        render(values)
    assert message in str(caught.value)


def test_the_schema_check_refuses_what_kubernetes_would() -> None:
    deployment = one(render(REDIS_URL), "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"][
        "paths"] = "/health"  # a misspelt field  # fmt: skip
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)
    deployment = one(render(REDIS_URL), "Deployment")
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)
