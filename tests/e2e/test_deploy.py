"""The deployment files, proven without a Docker engine: compose commands run for real here."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from bench.stack.up import free_port_block
from router.config import load_config
from session_router_cli import build_parser
from tests.conftest import free_port
from tests.e2e.helpers import admin_get, chat
from tests.procs import ROOT, Process

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
OURS = {name: svc for name, svc in SERVICES.items()
        if svc.get("image", "").startswith("session-router")}  # fmt: skip


def test_compose_names_our_services_and_the_vllm_profile() -> None:
    assert {"redis", "sim-cluster", "router-1", "router-2", "prometheus", "grafana"} <= set(
        SERVICES
    )
    vllm = [name for name, svc in SERVICES.items() if "vllm" in svc.get("profiles", [])]
    assert sorted(vllm) == ["router-vllm", "vllm-decode-1", "vllm-decode-2", "vllm-prefill-1",
                            "vllm-prefill-2"]  # fmt: skip
    for name in vllm:
        if name.startswith("vllm-"):
            command = " ".join(SERVICES[name]["command"])
            assert "--enable-prefix-caching" in command
            assert "--enable-prompt-tokens-details" in command
            config = json.loads(SERVICES[name]["command"][-1])
            assert config == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


@pytest.mark.parametrize("service", sorted(OURS))
def test_every_service_command_is_a_valid_invocation(service: str) -> None:
    args = build_parser().parse_args(OURS[service]["command"])
    if args.command == "serve":
        config = load_config(args, environ={"SESSION_ROUTER_ADMIN_TOKEN": "x"})
        assert config.workers and config.redis.startswith("redis://")
        assert config.admin_token == "x"


def _localise(command: list[str], ports: dict[int, int], redis_url: str) -> list[str]:
    out = []
    for arg in command:
        for old, new in ports.items():
            arg = re.sub(rf"^http://sim-cluster:{old}$", f"http://127.0.0.1:{new}", arg)
            if arg == str(old):
                arg = str(new)
        arg = arg.replace("redis://redis:6379/0", redis_url).replace("0.0.0.0", "127.0.0.1")
        out.append(arg)
    return out


async def test_compose_routers_and_sim_cluster_run_for_real_and_share_session_owners(
    redis_url: str,
) -> None:
    sim_command = SERVICES["sim-cluster"]["command"]
    base = free_port_block("127.0.0.1", 4)
    ports = {8101 + i: base + i for i in range(4)}
    router_ports = [free_port(), free_port()]
    prefix = f"compose-{uuid.uuid4().hex[:6]}"
    sim = Process(_localise(sim_command, ports, redis_url))
    routers: list[Process] = []
    try:
        sim.wait_healthy([f"http://127.0.0.1:{p}" for p in ports.values()])
        for name, port in zip(("router-1", "router-2"), router_ports, strict=True):
            command = _localise(SERVICES[name]["command"], {**ports, 8000: port}, redis_url)
            routers.append(Process([*command, "--redis-prefix", prefix],
                                   env={"SESSION_ROUTER_ADMIN_TOKEN": "t"}))  # fmt: skip
        urls = [f"http://127.0.0.1:{port}" for port in router_ports]
        for process, url in zip(routers, urls, strict=True):
            process.wait_healthy([url])
        messages = [{"role": "user", "content": "compose " * 50}]
        async with aiohttp.ClientSession() as http:
            _answer, _usage, response = await chat(http, urls[0], messages, session_id="c1")
            assert response.status == 200
            owners = []
            for url in urls:
                # the commit is written after the client got its answer: poll briefly
                for _ in range(100):
                    status, record = await admin_get(http, url, "t", "/admin/sessions/c1")
                    if status == 200:
                        break
                    await asyncio.sleep(0.01)
                assert status == 200, url
                owners.append(record["worker_id"])
        assert owners[0] == owners[1]
    finally:
        for process in routers:
            process.stop()
        sim.stop()


def _dashboard_metrics() -> set[str]:
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/session-router.json").read_text())
    names: set[str] = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            # SGLang's are checked by name in tests/deploy/test_grafana.py: no SGLang runs here
            names |= set(re.findall(r"\b((?:session_router_|vllm:)[a-z_:]+)", target["expr"]))
    return names


async def test_every_dashboard_metric_is_exported_by_a_router_or_sim_worker(
    redis_url: str,
) -> None:
    base = free_port_block("127.0.0.1", 2)
    sim = Process(["sim-cluster", "--base-port", str(base), "--workers", "2"])
    port = free_port()
    sim_urls = [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
    router = Process(["serve", "--port", str(port), "--redis", redis_url, "--redis-prefix",
                      f"dash-{uuid.uuid4().hex[:6]}", "--prefill", sim_urls[0], "--decode",
                      sim_urls[1], "--policy", "disaggregate"])  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        sim.wait_healthy(sim_urls)
        router.wait_healthy([url])
        async with aiohttp.ClientSession() as http:
            await chat(http, url, [{"role": "user", "content": "metrics " * 30}])
            exported: set[str] = set()
            for target in (url, *sim_urls):
                async with http.get(target + "/metrics") as response:
                    for line in (await response.text()).splitlines():
                        if line and not line.startswith("#"):
                            exported.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    finally:
        router.stop()
        sim.stop()
    wanted = _dashboard_metrics()
    assert len(wanted) >= 15
    missing = sorted(name for name in wanted if name not in exported)
    assert missing == []


def test_dockerfile_runs_the_console_script_as_a_non_root_user_with_a_healthcheck() -> None:
    text = (ROOT / "Dockerfile").read_text()
    bases = re.findall(r"^FROM (\S+)", text, re.M)
    # two stages on one pinned base: a build stage that compiles the hot path, a slim runtime
    assert len(bases) == 2 and bases[0] == bases[1]
    assert re.fullmatch(r"python:3\.1[1-9]\.\d+-slim-\w+", bases[0]), bases[0]
    build, runtime = text.split("\nFROM ", 1)[1].split("\nFROM ", 1)
    assert "native.build(" in build and "native status" in build and "gcc" in build
    assert "COPY --from=build /install /usr/local" in runtime
    assert "gcc" not in runtime and "mypy" not in runtime and "[bench]" not in text
    assert re.search(r"^USER (?!root)\w+", runtime, re.M)
    assert 'ENTRYPOINT ["session-router"]' in runtime
    assert "HEALTHCHECK" in runtime and "/health" in runtime
    for path in re.findall(r"^COPY (?!--from)(\S+)", text, re.M):
        assert (ROOT / path).exists(), path


def test_compose_pins_its_images_and_needs_an_admin_token() -> None:
    for name, service in COMPOSE["services"].items():
        image = service.get("image", "")
        if image and not image.startswith("session-router"):
            assert ":" in image and not image.endswith(":latest"), (name, image)
    token = COMPOSE["x-router"]["environment"]["SESSION_ROUTER_ADMIN_TOKEN"]
    assert token.startswith("${SESSION_ROUTER_ADMIN_TOKEN:?"), token  # no default secret


def test_the_license_is_the_apache_license_pyproject_names() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()


def test_example_plugin_installs_and_loads_through_its_entry_point(tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(ROOT / "examples/policy-plugin")],
        check=True, capture_output=True,
    )  # fmt: skip
    script = (
        "from policies import available_policies, create_policy, PolicyConfigError\n"
        "policy = create_policy('least-waiting', {'max_waiting': '2'})\n"
        "assert policy.params.max_waiting == 2, policy.params\n"
        "assert 'least-waiting' in available_policies()\n"
        "try:\n    create_policy('least-waiting', {'max_wating': 1})\n"
        "except PolicyConfigError as exc:\n    print('refused:', exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
        env={"PYTHONPATH": f"{target}:{ROOT}", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "refused:" in result.stdout and "max_wating" in result.stdout
