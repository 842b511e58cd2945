"""The router's configuration: command line over SESSION_ROUTER_* environment over TOML file.

Every option can come from any of the three sources. Worker lists from the command line
(`--prefill/--decode/--mixed URL`) replace the TOML `[[workers]]` table rather than merge with it,
so a command line always says exactly which workers are used.
"""

from __future__ import annotations

import argparse
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any, Literal
from urllib.parse import urlsplit

import msgspec

from policies.registry import available_policies
from policies.types import Role

Engine = Literal["vllm", "sglang"]
FirstToken = Literal["decode", "prefill"]
DiscoveryKind = Literal["static", "file", "dns", "kubernetes"]
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


def check_worker_url(url: str) -> None:
    """Raise ConfigError unless `url` is http://host[:port] or https://host[:port]: the
    schemes the pooled client speaks (every source of workers is checked alike)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"worker URL {url!r}: want http://host:port or https://host:port"
            + (f" (scheme {parts.scheme!r} is not supported)" if parts.scheme else "")
        )
    try:
        _ = parts.port  # a port that is no number raises
    except ValueError as exc:
        raise ConfigError(f"worker URL {url!r}: {exc}") from exc


def check_workers(workers: Sequence[WorkerSpec]) -> None:
    """Raise ConfigError for a duplicate worker id or a URL the router cannot speak."""
    ids = [worker.worker_id for worker in workers]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"duplicate workers: {sorted(ids)}")
    for worker in workers:
        check_worker_url(worker.url)


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
    # the request header naming a turn's session (before `user` and the fingerprint)
    session_header: str = "X-Session-Id"
    # TLS to https:// workers (turns, scrapes, model lists): a CA bundle to verify them with
    # (default: the system's), a client certificate and key for mutual TLS, and skipping
    # verification altogether, which only worker_tls_insecure does.
    worker_ca_file: str | None = None
    worker_cert_file: str | None = None
    worker_key_file: str | None = None
    worker_tls_insecure: bool = False
    # Worker discovery (router.fleet.discovery) beside the static `workers`: a watched file
    # of [[workers]], a headless Service's DNS records, or Kubernetes pods by label selector.
    # Workers found there get discovery_role/discovery_engine unless a pod's labels say
    # otherwise, and discovery_port unless the file, or a pod's annotation, gives one.
    discovery: DiscoveryKind = "static"
    discovery_file: str | None = None
    discovery_interval_s: float = 5.0  # DNS re-resolution; the file's change check (<= 1 s)
    discovery_dns_name: str | None = None
    discovery_dns_server: str | None = None  # host[:port]; default: /etc/resolv.conf's
    discovery_port: int = 8000
    discovery_scheme: Literal["http", "https"] = "http"
    discovery_role: Role = "mixed"
    discovery_engine: Engine = "vllm"
    discovery_namespace: str | None = None  # default: the service account's namespace
    discovery_selector: str = ""
    discovery_api_url: str | None = None  # default: in-cluster, KUBERNETES_SERVICE_HOST/PORT
    discovery_token_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    discovery_ca_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    # a worker that left the fleet is forgotten this long after its last request ended
    # (until then it shows, draining, in /admin/workers and in the policy's view)
    departure_grace_s: float = 10.0
    # OpenTelemetry spans per turn and leg (the `otel` extra; OTEL_* variables configure it)
    otel: bool = False

    def __post_init__(self) -> None:
        if not self.workers and self.discovery == "static":
            raise ConfigError(
                "no workers: give --prefill/--decode/--mixed URL, [[workers]] or --discovery"
            )
        check_workers(self.workers)
        self._check_discovery()
        if self.worker_key_file and not self.worker_cert_file:
            raise ConfigError("worker_key_file needs worker_cert_file (the client certificate)")
        if self.worker_tls_insecure and self.worker_ca_file:
            raise ConfigError("worker_tls_insecure skips verification: drop worker_ca_file")
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
        if not _HEADER_NAME.fullmatch(self.session_header):
            raise ConfigError(
                f"session_header must be an HTTP header name, got {self.session_header[:64]!r}"
            )

    def _check_discovery(self) -> None:
        kind = self.discovery
        if not self.discovery_interval_s > 0 or not self.departure_grace_s >= 0:
            raise ConfigError("discovery_interval_s must be positive, departure_grace_s not "
                              "negative")  # fmt: skip
        if not 0 < self.discovery_port < 65536:
            raise ConfigError(f"discovery_port must be a TCP port, got {self.discovery_port}")
        if kind == "file" and not self.discovery_file:
            raise ConfigError("--discovery file needs --discovery-file FILE")
        if kind == "dns" and not self.discovery_dns_name:
            raise ConfigError("--discovery dns needs --discovery-dns-name (a headless Service)")
        if kind == "kubernetes" and not self.discovery_selector:
            raise ConfigError(
                "--discovery kubernetes needs --discovery-selector (a label selector, "
                "e.g. app=vllm)"
            )
        if self.discovery_api_url is not None:
            check_worker_url(self.discovery_api_url)  # the same schemes, the same checks


# an HTTP header name (RFC 9110 token)
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")

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
    "allow_policy_import": bool, "worker_ca_file": str, "worker_cert_file": str,
    "worker_key_file": str, "worker_tls_insecure": bool,
    "session_header": str, "discovery": str, "discovery_file": str,
    "discovery_interval_s": float, "discovery_dns_name": str, "discovery_dns_server": str,
    "discovery_port": int, "discovery_scheme": str, "discovery_role": str,
    "discovery_engine": str, "discovery_namespace": str, "discovery_selector": str,
    "discovery_api_url": str, "discovery_token_file": str, "discovery_ca_file": str,
    "departure_grace_s": float, "otel": bool,
}  # fmt: skip


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    """The `serve` options; each help states its default (None: unset unless given, so the
    environment and the TOML file can still set it)."""
    add = parser.add_argument
    add(
        "--config",
        metavar="FILE",
        help="TOML file ([[workers]], [policy], and any option below) (default: none)",
    )
    add("--host", help="listen address (default 127.0.0.1)")
    add("--port", type=int, help="listen port (default 8000)")
    for role in ("prefill", "decode", "mixed"):
        add(
            f"--{role}",
            action="append",
            default=None,
            metavar="URL",
            help=f"a {role} worker, http:// or https:// (repeatable; default: none)",
        )
    add(
        "--worker-urls",
        dest="mixed",
        action="extend",
        nargs="+",
        default=None,
        metavar="URL",
        help="mixed workers, as vllm-router and sglang-router take them: the same as --mixed "
        "for each URL (default: none)",
    )
    add(
        "--engine",
        choices=["vllm", "sglang"],
        help="engine of the command-line workers (default vllm)",
    )
    add(
        "--priority-scheduling",
        action="store_true",
        default=None,
        help="the command-line workers schedule by request priority (vLLM "
        "--scheduling-policy priority, SGLang --enable-priority-scheduling) (default off)",
    )
    add(
        "--policy",
        metavar="NAME",
        help=f"placement policy: {', '.join(available_policies())} (underscores for dashes "
        "too), an entry point's name or module:attr (default colocate)",
    )
    add(
        "--policy-param",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="a parameter of the policy (repeatable; default: the policy's own defaults)",
    )
    add(
        "--redis",
        help="embedded | redis://... | rediss://... | unix://... | "
        "redis+sentinel://host:port,.../service | redis+cluster://host:port,... "
        "(default embedded)",
    )
    add("--redis-prefix", help="key prefix in Redis (default sr)")
    add(
        "--first-token",
        choices=["decode", "prefill"],
        help="which worker produces a disaggregated turn's first token (default decode)",
    )
    add("--admin-token", help="enables /admin with this bearer token (default: /admin off)")
    add("--api-key", help="clients must present this bearer token (default: none asked)")
    add(
        "--forward-auth",
        action="store_true",
        default=None,
        help="forward the client's Authorization header to workers (default off)",
    )
    add(
        "--max-body-bytes",
        type=int,
        help="largest request body accepted, else 413 (default 33554432, 32 MiB)",
    )
    add(
        "--scrape-interval-ms",
        type=int,
        help="how often each worker's /metrics is scraped (default 250)",
    )
    add(
        "--events",
        metavar="FILE",
        help="append every turn's stage events as JSON lines (default: none)",
    )
    add(
        "--slo-ttft-ms",
        type=float,
        help="time-to-first-token objective (default 1000 ms + 0.2 ms per prompt token)",
    )
    add("--slo-itl-ms", type=float, help="inter-token latency objective (default 100)")
    add(
        "--session-ttl-s",
        type=float,
        help="a session's state is forgotten this long after its last turn (default 3600)",
    )
    add(
        "--kv-bytes-per-token",
        type=int,
        help="KV-cache bytes per token of the served model (default 131072, llama-3.1-8b bf16)",
    )
    add(
        "--tokenizer",
        metavar="FILE",
        help="tokenizer.json for exact prompt token counts (needs `tokenizers`; default: "
        "estimated from the text)",
    )
    add("--log-level", choices=["debug", "info", "warning", "error"], help="(default info)")
    add(
        "--connect-timeout-s",
        type=float,
        help="connecting to a worker, TLS handshake included (default 2)",
    )
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
    add(
        "--client-read-timeout-s",
        type=float,
        help="a request's head and body must arrive within this of its first byte, else 408 "
        "(default 30)",
    )
    add(
        "--max-connections",
        type=int,
        help="client connections beyond this are answered 503 (default 4096)",
    )
    add(
        "--keepalive-timeout-s",
        type=float,
        help="close a client connection idle this long (default 75)",
    )
    add(
        "--keepalive-requests",
        type=int,
        help="close a client connection after this many requests (default 10000)",
    )
    add(
        "--redis-timeout-s",
        type=float,
        help="a Redis command taking longer means Redis is unreachable (default 2)",
    )
    add(
        "--redis-connect-timeout-s",
        type=float,
        help="connecting to Redis taking longer means it is unreachable (default 5)",
    )
    add(
        "--allow-policy-import",
        action="store_true",
        default=None,
        help="PUT /admin/policy may name module:attr, importing that module (default: only "
        "registered policies and the one started with)",
    )
    add(
        "--worker-ca-file",
        metavar="FILE",
        help="CA bundle (PEM) that https:// workers' certificates are verified against "
        "(default: the system's CAs)",
    )
    add(
        "--worker-cert-file",
        metavar="FILE",
        help="client certificate (PEM) for https:// workers that ask for one, mutual TLS; "
        "may hold the key too (default: none)",
    )
    add(
        "--worker-key-file",
        metavar="FILE",
        help="the client certificate's private key (PEM) (default: in --worker-cert-file)",
    )
    add(
        "--worker-tls-insecure",
        action="store_true",
        default=None,
        help="do not verify https:// workers' certificates or names; for tests only "
        "(default off: verified)",
    )
    add(
        "--session-header",
        metavar="NAME",
        help="request header naming a turn's session (default X-Session-Id)",
    )
    add(
        "--otel",
        action="store_true",
        default=None,
        help="OpenTelemetry spans per turn and leg, exported as the OTEL_* variables say "
        "(needs the `otel` extra; default off)",
    )
    _add_discovery_options(add)


def _add_discovery_options(add: Any) -> None:
    add(
        "--discovery",
        choices=["static", "file", "dns", "kubernetes"],
        help="where workers come from besides the static ones: a watched file, a headless "
        "Service's DNS records, Kubernetes pods by label selector (default static)",
    )
    add(
        "--discovery-file",
        metavar="FILE",
        help="TOML file of [[workers]], reloaded when it changes and on SIGHUP (default: none)",
    )
    add(
        "--discovery-interval-s",
        type=float,
        help="DNS re-resolution period; the file is checked at least every second (default 5)",
    )
    add(
        "--discovery-dns-name",
        metavar="NAME",
        help="a headless Service's name: each A/AAAA record is a worker (default: none)",
    )
    add(
        "--discovery-dns-server",
        metavar="HOST[:PORT]",
        help="DNS server to ask (default: the nameservers in /etc/resolv.conf)",
    )
    add(
        "--discovery-port",
        type=int,
        help="discovered workers' port, unless a pod's session-router/port says (default 8000)",
    )
    add(
        "--discovery-scheme",
        choices=["http", "https"],
        help="discovered workers' scheme (default http)",
    )
    add(
        "--discovery-role",
        choices=["prefill", "decode", "mixed"],
        help="discovered workers' role, unless a pod's labels say (default mixed)",
    )
    add(
        "--discovery-engine",
        choices=["vllm", "sglang"],
        help="discovered workers' engine, unless a pod's labels say (default vllm)",
    )
    add(
        "--discovery-namespace",
        metavar="NS",
        help="Kubernetes namespace of the worker pods (default: the router's own)",
    )
    add(
        "--discovery-selector",
        metavar="SELECTOR",
        help="label selector of the worker pods, e.g. app=vllm,tier in (p,d) (default: none)",
    )
    add(
        "--discovery-api-url",
        metavar="URL",
        help="Kubernetes API server (default: in-cluster, from KUBERNETES_SERVICE_HOST/PORT)",
    )
    add(
        "--discovery-token-file",
        metavar="FILE",
        help="bearer token for the Kubernetes API, re-read as it rotates (default: the "
        "service account's)",
    )
    add(
        "--discovery-ca-file",
        metavar="FILE",
        help="CA bundle for the Kubernetes API (default: the service account's)",
    )
    add(
        "--departure-grace-s",
        type=float,
        help="a worker that left is forgotten this long after its last request ended (default 10)",
    )


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
