"""A fake Kubernetes API server for pods: list and watch, as the real one answers them.

A real aiohttp server: `GET /api/v1/namespaces/{ns}/pods?labelSelector=...` lists the pods
matching an equality selector (`a=b`, `a==b`, `a!=b`, comma-separated) with the list's
resourceVersion; with `watch=true` it streams chunked JSON lines, one event each: first every
event after the given resourceVersion, then new ones as the test makes them, until
`timeoutSeconds`. `expire()` compacts the history: a watch from before it gets an ERROR event
with a 410 Status (or, with `gone_as_status`, an HTTP 410). Objects carry fields the router
does not read (managedFields, containers), as real ones do.
"""

from __future__ import annotations

import asyncio
import copy
import json
import ssl
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Seen:
    """One request the server answered."""

    query: dict[str, str]
    authorization: str | None


@dataclass
class FakeKubernetes:
    namespace: str = "ns"
    gone_as_status: bool = False
    requests: list[Seen] = field(default_factory=list)
    _pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    _history: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    _version: int = 100
    _compacted: int = 0  # watches from a resourceVersion below this are gone (410)
    _watchers: set[asyncio.Queue[tuple[str, dict[str, Any]] | None]] = field(default_factory=set)
    _runner: web.AppRunner | None = None
    port: int = 0
    tls: ssl.SSLContext | None = None  # served over https with this context

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def watches(self) -> int:
        """Watch requests answered so far."""
        return sum(1 for seen in self.requests if seen.query.get("watch") == "true")

    @property
    def lists(self) -> int:
        return sum(1 for seen in self.requests if seen.query.get("watch") != "true")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods_endpoint)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self.tls)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        self.end_watches()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def start_again(self) -> None:
        """Listen again on the same port (after `stop`), history and pods kept."""
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods_endpoint)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=self.tls).start()

    # -- what the test does ---------------------------------------------------------------
    def set_pod(
        self, name: str, ip: str = "127.0.0.1", *, ready: bool = True, phase: str = "Running",
        labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
        terminating: bool = False,
    ) -> None:  # fmt: skip
        """Create or change a pod: an ADDED or MODIFIED event."""
        kind = "MODIFIED" if name in self._pods else "ADDED"
        metadata: dict[str, Any] = {
            "name": name, "namespace": self.namespace, "uid": f"uid-{name}",
            "labels": {"app": "vllm", **(labels or {})},
            "annotations": annotations or {},
            "managedFields": [{"manager": "kubelet", "operation": "Update",
                               "fieldsV1": {"f:status": {}}}],
        }  # fmt: skip
        if terminating:
            metadata["deletionTimestamp"] = "2025-01-01T00:00:00Z"
        pod = {
            "kind": "Pod", "apiVersion": "v1", "metadata": metadata,
            "spec": {"nodeName": "node-1", "containers": [{"name": "vllm", "image": "x"}]},
            "status": {"phase": phase, "podIP": ip, "hostIP": "10.0.0.1", "conditions": [
                {"type": "Initialized", "status": "True"},
                {"type": "Ready", "status": "True" if ready else "False"},
            ]},
        }  # fmt: skip
        self._pods[name] = pod
        self._emit(kind, pod)

    def delete_pod(self, name: str) -> None:
        pod = self._pods.pop(name)
        self._emit("DELETED", pod)

    def bookmark(self) -> None:
        """A BOOKMARK: only a new resourceVersion, for the open watches."""
        self._version += 1
        marker = {"kind": "Pod", "apiVersion": "v1",
                  "metadata": {"resourceVersion": str(self._version)}}  # fmt: skip
        for queue in self._watchers:
            queue.put_nowait(("BOOKMARK", marker))

    def expire(self) -> None:
        """Compact the history: the open watches get a 410 ERROR event and end; a watch from
        an older resourceVersion is gone."""
        self._version += 1
        self._compacted = self._version
        self._history.clear()
        status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
                  "reason": "Expired", "message": "too old resource version"}  # fmt: skip
        for queue in self._watchers:
            queue.put_nowait(("ERROR", status))
            queue.put_nowait(None)

    def end_watches(self) -> None:
        """End the open watches, as their timeout would."""
        for queue in self._watchers:
            queue.put_nowait(None)

    # -- the API ----------------------------------------------------------------------------
    def _emit(self, kind: str, pod: dict[str, Any]) -> None:
        self._version += 1
        pod["metadata"]["resourceVersion"] = str(self._version)
        snapshot = copy.deepcopy(pod)
        self._history.append((self._version, kind, snapshot))
        for queue in self._watchers:
            queue.put_nowait((kind, snapshot))

    async def _pods_endpoint(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append(Seen(query, request.headers.get("Authorization")))
        if request.match_info["namespace"] != self.namespace:
            return web.json_response({"kind": "PodList", "metadata": {"resourceVersion":
                                      str(self._version)}, "items": []})  # fmt: skip
        selector = _selector(query.get("labelSelector", ""))
        if query.get("watch") != "true":
            items = [p for p in self._pods.values() if _matches(p, selector)]
            return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": str(self._version)},
                                      "items": items})  # fmt: skip
        since = int(query.get("resourceVersion") or 0)
        if since < self._compacted and self.gone_as_status:
            return web.json_response({"kind": "Status", "code": 410}, status=410)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        queue: asyncio.Queue[tuple[str, dict[str, Any]] | None] = asyncio.Queue()
        if since < self._compacted:
            queue.put_nowait(("ERROR", {"kind": "Status", "code": 410, "reason": "Expired",
                                        "message": "too old resource version"}))  # fmt: skip
            queue.put_nowait(None)
        else:
            for version, kind, pod in self._history:
                if version > since:
                    queue.put_nowait((kind, pod))
        self._watchers.add(queue)
        try:
            async with asyncio.timeout(float(query.get("timeoutSeconds", "60"))):
                while (item := await queue.get()) is not None:
                    kind, obj = item
                    if kind not in ("BOOKMARK", "ERROR") and not _matches(obj, selector):
                        continue
                    await response.write(json.dumps({"type": kind, "object": obj}).encode()
                                         + b"\n")  # fmt: skip
        except TimeoutError:
            pass
        finally:
            self._watchers.discard(queue)
        await response.write_eof()
        return response


def _selector(text: str) -> list[tuple[str, str, bool]]:
    """`a=b,c!=d` -> [(a, b, True), (c, d, False)]."""
    terms = []
    for term in filter(None, text.split(",")):
        if "!=" in term:
            key, value = term.split("!=", 1)
            terms.append((key.strip(), value.strip(), False))
        else:
            key, value = term.replace("==", "=").split("=", 1)
            terms.append((key.strip(), value.strip(), True))
    return terms


def _matches(pod: dict[str, Any], selector: list[tuple[str, str, bool]]) -> bool:
    labels = pod["metadata"].get("labels", {})
    return all((labels.get(key) == value) == equal for key, value, equal in selector)
