"""Kubernetes pods as workers: the pods of a namespace matching a label selector.

List, then watch from the list's resourceVersion (bookmarks asked for, so a quiet watch stays
resumable): ADDED and MODIFIED events update a pod, DELETED removes it, BOOKMARK moves the
resourceVersion on, and a 410 Gone (the watch's status or an ERROR event) lists again. A
watch that times out is resumed from the last resourceVersion seen; any other failure is
retried with backoff (1 s doubling to 30 s), the last set of workers kept meanwhile.

A pod is a worker while it is Running, has an IP, is Ready and is not being deleted: a pod
turning unready, or terminating, leaves the fleet (and drains), one turning ready joins.
Its id is the pod's name; its URL `scheme://podIP:port`. Labels or annotations (labels
first) may say, under `session-router/`: `port`, `role` (prefill|decode|mixed; llm-d's
`llm-d.ai/role` prefill|decode|both is read too), `engine` (vllm|sglang),
`bootstrap-port` (SGLang), `priority-scheduling` (true|false), `nic-gbps`. A pod whose
values are wrong is no worker (logged once per change).

In the cluster the API server is KUBERNETES_SERVICE_HOST:KUBERNETES_SERVICE_PORT over
https, verified with the service account's CA, with its token (read again at every
connection: projected tokens rotate); the namespace defaults to the service account's.
RBAC: `get`, `list` and `watch` on `pods` in that namespace.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import ssl
from typing import Any
from urllib.parse import urlencode, urlsplit

import aiohttp
import msgspec

from policies.types import Role
from router.config import ConfigError, Engine, RouterConfig, WorkerSpec, check_worker_url
from router.fleet.discovery.source import OnWorkers, WorkerDefaults

log = logging.getLogger("router.fleet.discovery.kubernetes")

PREFIX = "session-router/"
LLM_D_ROLE = "llm-d.ai/role"
_SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
_ROLES: dict[str, Role] = {"prefill": "prefill", "decode": "decode", "mixed": "mixed",
                           "both": "mixed"}  # fmt: skip
_ENGINES: dict[str, Engine] = {"vllm": "vllm", "sglang": "sglang"}
_BOOLEANS = {"true": True, "false": False}
_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
_MAX_LINE_BYTES = 4 * 1024 * 1024  # one watch event (a pod, managed fields and all)


# The API's objects, decoded for the fields read here only: unknown fields are the norm in
# Kubernetes objects, so these structs (unlike our own messages) let them pass.
class _Meta(msgspec.Struct, frozen=True):
    name: str = ""
    resourceVersion: str = ""
    deletionTimestamp: str | None = None
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}


class _Condition(msgspec.Struct, frozen=True):
    type: str = ""
    status: str = ""


class _PodStatus(msgspec.Struct, frozen=True):
    phase: str = ""
    podIP: str = ""
    conditions: list[_Condition] = []


class _PodSpec(msgspec.Struct, frozen=True):
    nodeName: str = ""


class Pod(msgspec.Struct, frozen=True):
    metadata: _Meta = _Meta()
    spec: _PodSpec = _PodSpec()
    status: _PodStatus = _PodStatus()


class _ListMeta(msgspec.Struct, frozen=True):
    resourceVersion: str = ""


class _PodList(msgspec.Struct, frozen=True):
    metadata: _ListMeta = _ListMeta()
    items: list[Pod] = []


class _Status(msgspec.Struct, frozen=True):
    code: int = 0
    reason: str = ""
    message: str = ""


class _Event(msgspec.Struct, frozen=True):
    type: str
    object: msgspec.Raw


_decode_list = msgspec.json.Decoder(_PodList).decode
_decode_event = msgspec.json.Decoder(_Event).decode
_decode_pod = msgspec.json.Decoder(Pod).decode
_decode_status = msgspec.json.Decoder(_Status).decode


class Gone(Exception):
    """410: the resourceVersion is too old to watch from; list again."""


def pod_worker(pod: Pod, defaults: WorkerDefaults) -> WorkerSpec | None:
    """The worker a pod is now, None while it is not one (not running, no IP, not ready,
    terminating); ValueError for a pod whose labels or annotations say something wrong."""
    meta, status = pod.metadata, pod.status
    if meta.deletionTimestamp is not None or status.phase != "Running" or not status.podIP:
        return None
    if not any(c.type == "Ready" and c.status == "True" for c in status.conditions):
        return None

    def said(key: str) -> str | None:
        value = meta.labels.get(key)
        return meta.annotations.get(key) if value is None else value

    port = _int(said(PREFIX + "port"), "port", 1, 65535)
    role_text = said(PREFIX + "role") or said(LLM_D_ROLE)
    role = defaults.role if role_text is None else _choice(role_text, _ROLES, "role")
    engine_text = said(PREFIX + "engine")
    engine = defaults.engine if engine_text is None else _choice(engine_text, _ENGINES, "engine")
    by_priority = said(PREFIX + "priority-scheduling")
    nic = said(PREFIX + "nic-gbps")
    nic_gbps = 400.0
    if nic is not None:
        try:
            nic_gbps = float(nic)
        except ValueError:
            nic_gbps = math.nan
        if not 0.0 < nic_gbps < math.inf:
            raise ValueError(f"{PREFIX}nic-gbps {nic[:32]!r} is no positive number")
    spec = WorkerSpec(
        url=defaults.url(status.podIP, port),
        role=role,
        engine=engine,
        node=pod.spec.nodeName,
        nic_gbps=nic_gbps,
        id=meta.name,
        bootstrap_port=_int(said(PREFIX + "bootstrap-port"), "bootstrap-port", 1, 65535),
        priority_scheduling=False
        if by_priority is None
        else _choice(by_priority.lower(), _BOOLEANS, "priority-scheduling"),
    )
    try:
        check_worker_url(spec.url)
    except ConfigError as exc:
        raise ValueError(str(exc)) from exc
    return spec


def _int(text: str | None, key: str, low: int, high: int) -> Any:
    if text is None:
        return None
    if not text.isdigit() or not low <= int(text) <= high:
        raise ValueError(f"{PREFIX}{key} {text[:32]!r} is not within {low}..{high}")
    return int(text)


def _choice(text: str, choices: dict[str, Any], key: str) -> Any:
    if text not in choices:
        raise ValueError(f"{PREFIX}{key} {text[:32]!r}: want one of {', '.join(choices)}")
    return choices[text]


class KubernetesSource:
    name = "kubernetes"

    def __init__(
        self,
        api_url: str,
        namespace: str,
        selector: str,
        defaults: WorkerDefaults,
        token_file: str | None = None,
        ca_file: str | None = None,
        watch_timeout_s: int = 240,
        request_timeout_s: float = 30.0,
    ) -> None:
        self.api_url = api_url.rstrip("/")
        self.namespace = namespace
        self.selector = selector
        self._defaults = defaults
        self._token_file = token_file
        self._ca_file = ca_file
        self._watch_timeout_s = watch_timeout_s
        self._request_timeout_s = request_timeout_s
        self._pods: dict[str, WorkerSpec] = {}  # pod name -> the worker it is
        self._bad: dict[str, str] = {}  # pod name -> resourceVersion already warned about
        self._reported: tuple[WorkerSpec, ...] | None = None
        self.resource_version = ""
        self.lists = 0  # how many times the pods were listed (a 410 lists again)

    @classmethod
    def of(cls, config: RouterConfig, defaults: WorkerDefaults) -> KubernetesSource:
        api_url = config.discovery_api_url
        if api_url is None:
            host = os.environ.get("KUBERNETES_SERVICE_HOST")
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise ConfigError("--discovery kubernetes outside a cluster needs "
                                  "--discovery-api-url")  # fmt: skip
            api_url = f"https://{f'[{host}]' if ':' in host else host}:{port}"
        namespace = config.discovery_namespace or _own_namespace()
        return cls(api_url, namespace, config.discovery_selector, defaults,
                   config.discovery_token_file, config.discovery_ca_file)  # fmt: skip

    def reload(self) -> None:
        """The watch keeps the set current: nothing to do."""

    async def run(self, on_workers: OnWorkers) -> None:
        failures = 0
        async with self._session() as session:
            while True:
                try:
                    await self._list(session, on_workers)
                    failures = 0
                    while True:
                        await self._watch(session, on_workers)  # ends at its timeout: resume
                except Gone:
                    log.info("pods watch: resourceVersion %s gone, listing again",
                             self.resource_version)  # fmt: skip
                    continue
                except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as exc:
                    delay = _BACKOFF_S[min(failures, len(_BACKOFF_S) - 1)]
                    failures += 1
                    log.warning("pods of %s (%s): %s: %s; workers kept, again in %g s",
                                self.namespace, self.selector, type(exc).__name__, exc,
                                delay)  # fmt: skip
                    await asyncio.sleep(delay)

    def _session(self) -> aiohttp.ClientSession:
        context: ssl.SSLContext | bool = True
        if urlsplit(self.api_url).scheme == "https" and self._ca_file:
            if os.path.exists(self._ca_file):
                context = ssl.create_default_context(cafile=self._ca_file)
        connector = aiohttp.TCPConnector(ssl=context, limit=2)
        return aiohttp.ClientSession(connector=connector, trust_env=False,
                                     read_bufsize=_MAX_LINE_BYTES // 2)  # fmt: skip

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self._token_file:
            try:
                with open(self._token_file, encoding="utf-8") as file:
                    token = file.read().strip()
            except OSError:
                token = ""  # no service account (a test's API server, a local proxy)
            if token:
                headers["Authorization"] = f"Bearer {token}"
        return headers

    def _url(self, **query: str) -> str:
        params = {"labelSelector": self.selector, **query}
        return f"{self.api_url}/api/v1/namespaces/{self.namespace}/pods?{urlencode(params)}"

    async def _list(self, session: aiohttp.ClientSession, on_workers: OnWorkers) -> None:
        timeout = aiohttp.ClientTimeout(total=self._request_timeout_s)
        async with session.get(self._url(), headers=self._headers(), timeout=timeout) as reply:
            body = await reply.read()
            if reply.status != 200:
                raise ValueError(f"list pods: HTTP {reply.status}: {body[:200]!r}")
        try:
            listed = _decode_list(body)
        except msgspec.DecodeError as exc:
            raise ValueError(f"list pods: {exc}") from exc
        self.lists += 1
        self._pods.clear()
        for pod in listed.items:
            self._apply(pod, deleted=False)
        self.resource_version = listed.metadata.resourceVersion
        self._report(on_workers)

    async def _watch(self, session: aiohttp.ClientSession, on_workers: OnWorkers) -> None:
        url = self._url(watch="true", resourceVersion=self.resource_version,
                        allowWatchBookmarks="true",
                        timeoutSeconds=str(self._watch_timeout_s))  # fmt: skip
        # the server ends the watch at timeoutSeconds; a silent connection ends sooner
        timeout = aiohttp.ClientTimeout(
            total=self._watch_timeout_s + self._request_timeout_s,
            sock_connect=self._request_timeout_s,
        )
        async with session.get(url, headers=self._headers(), timeout=timeout) as reply:
            if reply.status == 410:
                raise Gone()
            if reply.status != 200:
                body = await reply.content.read(200)
                raise ValueError(f"watch pods: HTTP {reply.status}: {body!r}")
            while True:
                line = await reply.content.readline()
                if not line:
                    return  # the watch's time is up
                if line.strip():
                    self._event(line, on_workers)

    def _event(self, line: bytes, on_workers: OnWorkers) -> None:
        try:
            event = _decode_event(line)
        except msgspec.DecodeError as exc:
            raise ValueError(f"watch pods: bad event: {exc}") from exc
        kind = event.type
        if kind == "ERROR":
            status = _decode_status(event.object)
            if status.code == 410:
                raise Gone()
            raise ValueError(f"watch pods: error {status.code} {status.reason}: "
                             f"{status.message[:200]}")  # fmt: skip
        pod = _decode_pod(event.object)
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            self._apply(pod, deleted=kind == "DELETED")
            self._report(on_workers)
        elif kind != "BOOKMARK":
            raise ValueError(f"watch pods: unknown event type {kind[:32]!r}")
        if pod.metadata.resourceVersion:
            self.resource_version = pod.metadata.resourceVersion

    def _apply(self, pod: Pod, deleted: bool) -> None:
        name = pod.metadata.name
        if not name:
            raise ValueError("watch pods: a pod without a name")
        spec: WorkerSpec | None = None
        if not deleted:
            try:
                spec = pod_worker(pod, self._defaults)
            except ValueError as exc:
                version = pod.metadata.resourceVersion
                if self._bad.get(name) != version:
                    self._bad[name] = version
                    log.warning("pod %s is no worker: %s", name, exc)
        if spec is None:
            self._pods.pop(name, None)
            if deleted:
                self._bad.pop(name, None)
        else:
            self._pods[name] = spec

    def _report(self, on_workers: OnWorkers) -> None:
        workers = tuple(self._pods[name] for name in sorted(self._pods))
        if workers != self._reported:
            self._reported = workers
            on_workers(workers)


def _own_namespace() -> str:
    try:
        with open(f"{_SERVICE_ACCOUNT}/namespace", encoding="utf-8") as file:
            return file.read().strip() or "default"
    except OSError:
        return "default"
