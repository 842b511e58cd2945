from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from router.config import ConfigError, add_serve_options, load_config


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_options(parser)
    return parser.parse_args(argv)


def test_command_line_workers_roles_and_defaults() -> None:
    argv = ("--prefill", "http://p:1", "--decode", "http://d:2", "--decode", "http://e:3",
            "--mixed", "http://m:4")  # fmt: skip
    config = load_config(parse(*argv), environ={})
    assert [(w.worker_id, w.role, w.engine) for w in config.workers] == [
        ("p:1", "prefill", "vllm"), ("d:2", "decode", "vllm"), ("e:3", "decode", "vllm"),
        ("m:4", "mixed", "vllm"),
    ]  # fmt: skip
    assert config.port == 8000 and config.redis == "embedded" and config.first_token == "decode"
    assert config.policy.name == "colocate" and config.admin_token is None


def test_precedence_is_command_line_then_environment_then_file(tmp_path: Path) -> None:
    toml = tmp_path / "router.toml"
    toml.write_text(
        'port = 7000\nredis_prefix = "file"\nslo_itl_ms = 50\n'
        'policy = { name = "threshold", params = { threshold = 2048 } }\n'
        '[[workers]]\nurl = "http://a:1"\nrole = "prefill"\nengine = "sglang"\n'
        'bootstrap_port = 8998\nnic_gbps = 100\nnode = "rack-1"\n'
        '[[workers]]\nurl = "http://b:1"\nrole = "decode"\nid = "bee"\n'
    )
    env = {"SESSION_ROUTER_PORT": "7100", "SESSION_ROUTER_REDIS_PREFIX": "env",
           "SESSION_ROUTER_ADMIN_TOKEN": "secret",
           "SESSION_ROUTER_FORWARD_AUTH": "true"}  # fmt: skip
    config = load_config(parse("--config", str(toml), "--port", "7200", "--policy-param",
                               "threshold=512"), environ=env)  # fmt: skip
    assert config.port == 7200  # command line over environment over file
    assert config.redis_prefix == "env" and config.admin_token == "secret"
    assert config.forward_auth is True and config.slo_itl_ms == 50
    assert config.policy.name == "threshold"
    assert config.policy.params == {"threshold": "512"}  # the command line's value wins
    first, second = config.workers
    assert (first.engine, first.bootstrap_port, first.nic_gbps, first.node) == (
        "sglang", 8998, 100, "rack-1")  # fmt: skip
    assert second.worker_id == "bee"


def test_environment_worker_lists() -> None:
    config = load_config(parse(), environ={"SESSION_ROUTER_DECODE": "http://a:1, http://b:2",
                                           "SESSION_ROUTER_PREFILL": "http://c:3"})  # fmt: skip
    assert [(w.role, w.url) for w in config.workers] == [
        ("prefill", "http://c:3"), ("decode", "http://a:1"), ("decode", "http://b:2")]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ((), "no workers"),
        (("--mixed", "ftp://x:1"), "http"),
        (("--mixed", "http://a:1", "--mixed", "http://a:1"), "duplicate"),
        (("--mixed", "http://a:1", "--policy-param", "novalue"), "KEY=VALUE"),
        (("--mixed", "http://a:1", "--max-body-bytes", "0"), "positive"),
    ],
)
def test_bad_configurations_fail_with_a_clear_message(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(parse(*argv), environ={})


def test_unknown_toml_keys_are_refused(tmp_path: Path) -> None:
    toml = tmp_path / "router.toml"
    toml.write_text('prot = 1\n[[workers]]\nurl = "http://a:1"\n')
    with pytest.raises(ConfigError, match="prot"):
        load_config(parse("--config", str(toml)), environ={})


@pytest.mark.parametrize(
    ("argv", "environ", "toml", "expected"),
    [
        ((), {}, "", False),
        (("--priority-scheduling",), {}, "", True),
        ((), {"SESSION_ROUTER_PRIORITY_SCHEDULING": "1"}, "", True),
        ((), {"SESSION_ROUTER_PRIORITY_SCHEDULING": "0"}, "", False),
        ((), {}, "priority_scheduling = true\n", True),  # per worker in the file
    ],
    ids=["default", "flag", "environment", "environment off", "file"],
)
def test_which_workers_schedule_by_priority(
    tmp_path: Path, argv: tuple[str, ...], environ: dict[str, str], toml: str, expected: bool
) -> None:
    if toml:
        path = tmp_path / "router.toml"
        path.write_text(f'[[workers]]\nurl = "http://a:1"\n{toml}')
        argv = (*argv, "--config", str(path))
    else:
        argv = (*argv, "--mixed", "http://a:1")
    (worker,) = load_config(parse(*argv), environ=environ).workers
    assert worker.priority_scheduling is expected


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--discovery", "file"), "--discovery-file"),
        (("--discovery", "dns"), "--discovery-dns-name"),
        (("--discovery", "kubernetes"), "--discovery-selector"),
        (("--discovery", "dns", "--discovery-dns-name", "x", "--discovery-port", "0"), "port"),
        (("--discovery", "dns", "--discovery-dns-name", "x", "--discovery-interval-s", "0"),
         "discovery_interval_s"),
        (("--discovery", "kubernetes", "--discovery-selector", "app=x",
          "--discovery-api-url", "ftp://api:1"), "scheme"),
        ((), "--discovery"),  # no workers from anywhere
    ],
)  # fmt: skip
def test_discovery_options_are_checked(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(parse(*argv), environ={})


def test_discovery_needs_no_static_workers_and_keeps_them_when_given() -> None:
    config = load_config(parse("--discovery", "kubernetes", "--discovery-selector", "app=vllm",
                               "--discovery-role", "decode", "--mixed", "http://a:1"),
                         environ={})  # fmt: skip
    assert config.discovery == "kubernetes" and config.discovery_role == "decode"
    assert [w.url for w in config.workers] == ["http://a:1"]
    env = {"SESSION_ROUTER_DISCOVERY": "dns", "SESSION_ROUTER_DISCOVERY_DNS_NAME": "w.ns"}
    config = load_config(parse(), environ=env)
    assert config.discovery_dns_name == "w.ns" and config.workers == ()
