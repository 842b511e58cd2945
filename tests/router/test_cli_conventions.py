"""What users of vllm-router and sglang-router expect: --worker-urls, policy names with
underscores, --version, help that states defaults and choices, a build-info metric; and the
worker URL and TLS options' checks."""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import re
from pathlib import Path

import pytest

import session_router_cli
from policies import available_policies, create_policy
from policies.baselines.round_robin import RoundRobinPolicy
from router import native, version
from router.config import ConfigError, add_serve_options, load_config
from router.obs.metrics import RouterMetrics


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_options(parser)
    return parser.parse_args(argv)


def _serve_parser() -> argparse.ArgumentParser:
    parser = session_router_cli.build_parser()
    subparsers = next(
        action for action in parser._actions if isinstance(action, argparse._SubParsersAction)
    )
    serve: argparse.ArgumentParser = subparsers.choices["serve"]
    return serve


def test_worker_urls_takes_mixed_workers_like_vllm_router() -> None:
    config = load_config(
        parse("--worker-urls", "http://a:1", "http://b:2", "--mixed", "http://c:3"), environ={}
    )
    assert [(w.worker_id, w.role) for w in config.workers] == [
        ("a:1", "mixed"), ("b:2", "mixed"), ("c:3", "mixed"),
    ]  # fmt: skip


@pytest.mark.parametrize("name", ["round_robin", "round-robin"])
def test_policy_names_take_underscores_for_dashes(name: str) -> None:
    assert isinstance(create_policy(name), RoundRobinPolicy)


def test_an_unknown_policy_still_names_the_choices() -> None:
    with pytest.raises(ValueError, match="round-robin"):
        create_policy("round_robbin")


def test_version_comes_from_the_package(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        session_router_cli.main(["--version"])
    assert exited.value.code == 0
    expected = importlib.metadata.version("session-router")
    assert capsys.readouterr().out.strip() == f"session-router {expected}"


def test_version_falls_back_to_pyproject_when_not_installed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    pyproject = (Path(version.__file__).parent.parent / "pyproject.toml").read_text()
    declared = re.search(r'^version = "([^"]+)"', pyproject, re.M)
    assert declared is not None
    assert version.version.__wrapped__() == declared.group(1)
    assert version.pyproject_version(tmp_path / "absent.toml") == "unknown"


def test_every_serve_option_says_its_default() -> None:
    undocumented = [
        action.option_strings[0]
        for action in _serve_parser()._actions
        if action.option_strings and action.dest != "help" and "default" not in (action.help or "")
    ]
    assert undocumented == []


def test_policy_help_lists_the_registered_policies() -> None:
    (policy,) = [a for a in _serve_parser()._actions if "--policy" in a.option_strings]
    for name in available_policies():
        assert name in (policy.help or "")


def test_build_info_metric() -> None:
    text = RouterMetrics().render().decode()
    native_state = "on" if native.active else "off"
    labels = (
        f'native="{native_state}",python="{platform.python_version()}",'
        f'version="{version.version()}"'
    )
    lines = [line for line in text.splitlines() if line.startswith("session_router_build_info{")]
    assert len(lines) == 1
    found = dict(re.findall(r'(\w+)="([^"]*)"', lines[0]))
    assert found == dict(re.findall(r'(\w+)="([^"]*)"', labels))
    assert lines[0].endswith(" 1.0")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--mixed", "ftp://x:1"), "scheme 'ftp' is not supported"),
        (("--mixed", "grpc://x:1"), "want http://host:port or https://host:port"),
        (("--mixed", "x:1"), "want http"),
        (("--mixed", "http://x:port"), "port"),
        (("--mixed", "https://a:1", "--worker-key-file", "k.pem"), "needs worker_cert_file"),
        (("--mixed", "https://a:1", "--worker-ca-file", "ca.pem", "--worker-tls-insecure"),
         "drop worker_ca_file"),
    ],
)  # fmt: skip
def test_worker_urls_and_tls_options_are_checked_at_start(
    argv: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(parse(*argv), environ={})


def test_tls_options_from_the_command_line_and_the_environment() -> None:
    args = parse(
        "--mixed", "https://a:1", "--worker-ca-file", "ca.pem", "--worker-cert-file", "c.pem",
        "--worker-key-file", "k.pem",
    )  # fmt: skip
    config = load_config(args, environ={})
    assert (config.workers[0].url, config.worker_ca_file, config.worker_cert_file,
            config.worker_key_file, config.worker_tls_insecure) == (
        "https://a:1", "ca.pem", "c.pem", "k.pem", False)  # fmt: skip
    env = {"SESSION_ROUTER_MIXED": "https://a:1", "SESSION_ROUTER_WORKER_TLS_INSECURE": "1"}
    assert load_config(parse(), environ=env).worker_tls_insecure
