"""The router's configuration: command line over SESSION_ROUTER_* environment over TOML file.

Every option can come from any of the three sources. Worker lists from the command line
(`--prefill/--decode/--mixed URL`) replace the TOML `[[workers]]` table rather than merge with it,
so a command line always says exactly which workers are used.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any, Literal
from urllib.parse import urlsplit

import msgspec

from policies.types import Role

Engine = Literal["vllm", "sglang"]
FirstToken = Literal["decode", "prefill"]
ENV_PREFIX = "SESSION_ROUTER_"


class ConfigError(ValueError):
    """A configuration problem, worded for the person starting the router."""


class WorkerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    url: str
    role: Role = "mixed"
    engine: Engine = "vllm"
    node: str = ""
    nic_gbps: float = 400.0
    id: str = ""
    bootstrap_port: int | None = None  # SGLang's disaggregation bootstrap port
    # The engine admits queued requests by priority (vLLM --scheduling-policy priority,
    # SGLang --enable-priority-scheduling): the router sends each turn's due time as its
    # requests' `priority` where the policy gives one (`due_ms`).
    priority_scheduling: bool = False

    @property
    def worker_id(self) -> str:
        """Stable across router replicas: the configured id, else host:port of the URL."""
        return self.id or urlsplit(self.url).netloc

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/")


class PolicyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str = "colocate"
    params: dict[str, Any] = {}


class RouterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 8000
    workers: tuple[WorkerSpec, ...] = ()
    policy: PolicyConfig = PolicyConfig()
    redis: str = "embedded"
    redis_prefix: str = "sr"
    first_token: FirstToken = "decode"
    admin_token: str | None = None
    api_key: str | None = None
    forward_auth: bool = False
    max_body_bytes: int = 32 * 1024 * 1024
    scrape_interval_ms: int = 250
    events: str | None = None
    slo_ttft_ms: float | None = None  # default: 1000 ms + 0.2 ms per prompt token
    slo_itl_ms: float = 100.0
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 600.0  # a whole (non-streamed) answer; caps first_byte too
    session_ttl_s: float = 3600.0
    kv_bytes_per_token: int = 131072  # llama-3.1-8b bf16; set for your model
    tokenizer: str | None = None  # a tokenizer.json for exact prompt token counts
    log_level: str = "info"
    # Deadlines per leg (from its send): a stream's response head; its first body byte, by
    # max(first_byte_timeout_s, first_byte_ttft_multiple x the turn's TTFT objective) (a
    # prefill leg's whole answer too), capped by request_timeout_s; the gap between body reads.
    head_timeout_s: float = 15.0
    first_byte_timeout_s: float = 30.0
    first_byte_ttft_multiple: float = 10.0
    chunk_gap_timeout_s: float = 30.0
    # Outlier ejection (Envoy's consecutive 5xx): this many 5xx answers or failed legs in a
    # row (0: never) eject a worker for eject_base_s x times ejected (at most eject_max_s),
    # never more than eject_max_percent of the fleet at once.
    eject_consecutive_failures: int = 5
    eject_base_s: float = 30.0
    eject_max_s: float = 300.0
    eject_max_percent: float = 50.0
    # Client connections (router.http.server): a request's head and body must arrive within
    # client_read_timeout_s of its first byte (else 408); past max_connections a new
    # connection gets 503; keep-alive ends after keepalive_timeout_s idle or keepalive_requests.
    client_read_timeout_s: float = 30.0
    max_connections: int = 4096
    keepalive_timeout_s: float = 75.0
    keepalive_requests: int = 10_000
    # Shared state: how long a Redis command, and a connection to Redis, may take before the
    # router counts Redis unreachable and serves degraded from its local view.
    redis_timeout_s: float = 2.0
    redis_connect_timeout_s: float = 5.0
    # PUT /admin/policy may name `module:attr` (an import of any installed module) only with
    # this; without it, only registered policies and the one the router started with
    allow_policy_import: bool = False

    def __post_init__(self) -> None:
        if not self.workers:
            raise ConfigError("no workers: give --prefill/--decode/--mixed URL or [[workers]]")
        ids = [worker.worker_id for worker in self.workers]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"duplicate workers: {sorted(ids)}")
        for worker in self.workers:
            parts = urlsplit(worker.url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ConfigError(f"worker URL must be http(s)://host:port, got {worker.url!r}")
        if self.max_body_bytes <= 0 or self.scrape_interval_ms <= 0:
            raise ConfigError("max_body_bytes and scrape_interval_ms must be positive")
        timeouts = (
            "connect_timeout_s",
            "request_timeout_s",
            "head_timeout_s",
            "first_byte_timeout_s",
            "chunk_gap_timeout_s",
            "eject_base_s",
            "eject_max_s",
        )
        for name in timeouts:
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive")
        if self.first_byte_ttft_multiple < 0 or self.eject_consecutive_failures < 0:
            raise ConfigError(
                "first_byte_ttft_multiple and eject_consecutive_failures must not be negative"
            )
        if not 0 <= self.eject_max_percent <= 100:
            raise ConfigError("eject_max_percent must be within 0..100")
        limits = ("client_read_timeout_s", "max_connections", "keepalive_timeout_s",
                  "keepalive_requests", "redis_timeout_s", "redis_connect_timeout_s")  # fmt: skip
        for name in limits:
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive")


# option name -> converter for values read from the environment or the command line
_SCALARS: Mapping[str, type] = {
    "host": str, "port": int, "redis": str, "redis_prefix": str, "first_token": str,
    "admin_token": str, "api_key": str, "forward_auth": bool, "max_body_bytes": int,
    "scrape_interval_ms": int, "events": str, "slo_ttft_ms": float, "slo_itl_ms": float,
    "connect_timeout_s": float, "request_timeout_s": float, "session_ttl_s": float,
    "kv_bytes_per_token": int, "log_level": str, "tokenizer": str,
    "head_timeout_s": float, "first_byte_timeout_s": float, "first_byte_ttft_multiple": float,
    "chunk_gap_timeout_s": float, "eject_consecutive_failures": int, "eject_base_s": float,
    "eject_max_s": float, "eject_max_percent": float,
    "client_read_timeout_s": float, "max_connections": int, "keepalive_timeout_s": float,
    "keepalive_requests": int, "redis_timeout_s": float, "redis_connect_timeout_s": float,
    "allow_policy_import": bool,
}  # fmt: skip


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--config", help="TOML file ([[workers]], [policy], and any option below)")
    add("--host", help="listen address (default 127.0.0.1)")
    add("--port", type=int, help="listen port (default 8000)")
    for role in ("prefill", "decode", "mixed"):
        add(f"--{role}", action="append", default=None, metavar="URL",
            help=f"a {role} worker (repeatable)")  # fmt: skip
    add("--engine", choices=["vllm", "sglang"], help="engine of the command-line workers")
    add("--priority-scheduling", action="store_true", default=None,
        help="the command-line workers schedule by request priority (vLLM "
             "--scheduling-policy priority, SGLang --enable-priority-scheduling)")  # fmt: skip
    add("--policy", help="placement policy name, entry point or module:attr")
    add("--policy-param", action="append", default=None, metavar="KEY=VALUE")
    add("--redis", help="embedded | redis://... | rediss://... | unix://... | "
        "redis+sentinel://host:port,.../service (default embedded)")  # fmt: skip
    add("--redis-prefix", help="key prefix in Redis (default sr)")
    add("--first-token", choices=["decode", "prefill"], help="first-token convention")
    add("--admin-token", help="enables /admin with this bearer token")
    add("--api-key", help="clients must present this bearer token")
    add("--forward-auth", action="store_true", default=None,
        help="forward the client's Authorization header to workers")  # fmt: skip
    add("--max-body-bytes", type=int)
    add("--scrape-interval-ms", type=int)
    add("--events", metavar="FILE", help="append every turn's stage events as JSON lines")
    add("--slo-ttft-ms", type=float)
    add("--slo-itl-ms", type=float)
    add("--kv-bytes-per-token", type=int)
    add("--tokenizer", metavar="FILE",
        help="tokenizer.json for exact prompt token counts (needs `tokenizers`)")  # fmt: skip
    add("--log-level", choices=["debug", "info", "warning", "error"])
    add("--connect-timeout-s", type=float, help="connecting to a worker (default 2)")
    add(
        "--request-timeout-s",
        type=float,
        help="a non-streamed answer, whole; caps the first-byte deadline (default 600)",
    )
    add("--head-timeout-s", type=float, help="a stream's response head (default 15)")
    add(
        "--first-byte-timeout-s",
        type=float,
        help="least wait for a leg's first body byte (default 30)",
    )
    add(
        "--first-byte-ttft-multiple",
        type=float,
        help="first-byte deadline as a multiple of the turn's TTFT objective (default 10)",
    )
    add("--chunk-gap-timeout-s", type=float, help="silence between body reads (default 30)")
    add(
        "--eject-consecutive-failures",
        type=int,
        help="5xx answers or failed legs in a row that eject a worker; 0: never (default 5)",
    )
    add(
        "--eject-base-s",
        type=float,
        help="ejection time, times the number of ejections (default 30)",
    )
    add("--eject-max-s", type=float, help="longest ejection (default 300)")
    add(
        "--eject-max-percent",
        type=float,
        help="most of the fleet ejected at once, in percent (default 50)",
    )
    add("--client-read-timeout-s", type=float,
        help="a request's head and body must arrive within this of its first byte, else 408 "
             "(default 30)")  # fmt: skip
    add("--max-connections", type=int,
        help="client connections beyond this are answered 503 (default 4096)")  # fmt: skip
    add("--keepalive-timeout-s", type=float,
        help="close a client connection idle this long (default 75)")  # fmt: skip
    add("--keepalive-requests", type=int,
        help="close a client connection after this many requests (default 10000)")  # fmt: skip
    add("--redis-timeout-s", type=float,
        help="a Redis command taking longer means Redis is unreachable (default 2)")  # fmt: skip
    add("--redis-connect-timeout-s", type=float,
        help="connecting to Redis taking longer means it is unreachable (default 5)")  # fmt: skip
    add("--allow-policy-import", action="store_true", default=None,
        help="PUT /admin/policy may name module:attr, importing that module (default: only "
             "registered policies and the one started with)")  # fmt: skip


def _truthy(raw: str) -> bool:
    return raw.strip().lower() in ("1", "true", "yes", "on")


def _convert(name: str, raw: str) -> Any:
    kind = _SCALARS[name]
    return _truthy(raw) if kind is bool else kind(raw)


def load_config(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> RouterConfig:
    environ = os.environ if environ is None else environ
    merged: dict[str, Any] = {}
    config_path = args.config or environ.get(ENV_PREFIX + "CONFIG")
    if config_path:
        try:
            with open(config_path, "rb") as file:
                merged.update(tomllib.load(file))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read {config_path}: {exc}") from exc
    for name in _SCALARS:
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is not None:
            merged[name] = _convert(name, raw)
    for name in _SCALARS:
        value = getattr(args, name, None)
        if value is not None:
            merged[name] = value
    workers = _command_line_workers(args, environ)
    if workers:
        merged["workers"] = workers
    policy = dict(merged.get("policy", {}))
    policy_name = args.policy or environ.get(ENV_PREFIX + "POLICY")
    if policy_name:
        policy["name"] = policy_name
    if args.policy_param:
        params = dict(policy.get("params", {}))
        for assignment in args.policy_param:
            key, sep, value = assignment.partition("=")
            if not sep or not key:
                raise ConfigError(f"--policy-param needs KEY=VALUE, got {assignment!r}")
            params[key.strip()] = value.strip()
        policy["params"] = params
    if policy:
        merged["policy"] = policy
    try:
        return msgspec.convert(merged, RouterConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from exc


def _command_line_workers(
    args: argparse.Namespace, environ: Mapping[str, str]
) -> list[dict[str, Any]]:
    engine = args.engine or environ.get(ENV_PREFIX + "ENGINE") or "vllm"
    by_priority = args.priority_scheduling
    if by_priority is None:
        by_priority = _truthy(environ.get(ENV_PREFIX + "PRIORITY_SCHEDULING", ""))
    workers: list[dict[str, Any]] = []
    for role in ("prefill", "decode", "mixed"):
        urls: Sequence[str] = getattr(args, role) or []
        if not urls:
            env_urls = environ.get(ENV_PREFIX + role.upper())
            urls = [u for u in (env_urls or "").split(",") if u.strip()]
        workers.extend({"url": url.strip(), "role": role, "engine": engine,
                        "priority_scheduling": by_priority} for url in urls)  # fmt: skip
    return workers
