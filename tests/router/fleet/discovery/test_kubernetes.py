"""Kubernetes discovery against a fake API server (a real aiohttp server in the test speaking
list and watch with chunked JSON lines): pods joining, turning unready, terminating and deleted;
bookmarks; 410 Gone by an ERROR event and by status, each listed again; watches resumed from
the last resourceVersion; pods with wrong labels refused; the token sent."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from router.config import WorkerSpec
from router.fleet.discovery.kubernetes import KubernetesSource, Pod, pod_worker
from router.fleet.discovery.source import WorkerDefaults
from tests.fake_kubernetes import FakeKubernetes
from tests.router.http.test_client_tls import _server_context, certs  # noqa: F401 (fixture)

WAIT_S = 5.0


class Seen:
    """What the source reported, last set first."""

    def __init__(self) -> None:
        self.sets: list[tuple[WorkerSpec, ...]] = []

    def __call__(self, workers: tuple[WorkerSpec, ...]) -> None:
        self.sets.append(workers)

    @property
    def ids(self) -> list[str]:
        return [w.worker_id for w in self.sets[-1]] if self.sets else []


async def until(probe: Callable[[], bool], within_s: float = WAIT_S) -> None:
    async with asyncio.timeout(within_s):
        while True:
            if probe():
                return
            await asyncio.sleep(0.01)


@pytest.fixture
async def api() -> AsyncIterator[FakeKubernetes]:
    server = FakeKubernetes()
    await server.start()
    yield server
    await server.stop()


@contextlib.asynccontextmanager
async def running(source: KubernetesSource, seen: Seen) -> AsyncIterator[None]:
    task = asyncio.create_task(source.run(seen))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def source_for(api: FakeKubernetes, token_file: str | None = None) -> KubernetesSource:
    return KubernetesSource(api.url, api.namespace, "app=vllm", WorkerDefaults(port=8000),
                            token_file=token_file)  # fmt: skip


async def test_pods_join_and_leave_as_they_turn_ready_terminate_and_are_deleted(
    api: FakeKubernetes, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("secret-1\n")
    api.set_pod("p0", "10.0.0.1", labels={"session-router/role": "prefill"})
    api.set_pod("d0", "10.0.0.2", ready=False)
    api.set_pod("other", "10.0.0.9", labels={"app": "web"})  # not selected
    seen = Seen()
    async with running(source_for(api, str(token)), seen):
        await until(lambda: seen.ids == ["p0"])
        (p0,) = seen.sets[-1]
        assert (p0.url, p0.role, p0.engine, p0.node) == ("http://10.0.0.1:8000", "prefill",
                                                         "vllm", "node-1")  # fmt: skip
        api.set_pod("d0", "10.0.0.2", ready=True,
                    annotations={"session-router/port": "9000", "session-router/role": "decode",
                                 "session-router/engine": "sglang"})  # fmt: skip
        await until(lambda: seen.ids == ["d0", "p0"])
        d0 = seen.sets[-1][0]
        assert (d0.url, d0.role, d0.engine) == ("http://10.0.0.2:9000", "decode", "sglang")
        api.set_pod("d0", "10.0.0.2", ready=False)  # turns unready: leaves
        await until(lambda: seen.ids == ["p0"])
        api.set_pod("d0", "10.0.0.3", ready=True)  # back, at a new address
        await until(lambda: seen.ids == ["d0", "p0"])
        assert seen.sets[-1][0].url == "http://10.0.0.3:8000"
        api.set_pod("p0", "10.0.0.1", terminating=True, labels={"session-router/role": "prefill"})
        await until(lambda: seen.ids == ["d0"])
        api.delete_pod("d0")
        await until(lambda: seen.ids == [])
        api.set_pod("web2", labels={"app": "web"})  # events for others report nothing
        api.bookmark()
        await asyncio.sleep(0.1)
    assert [len(s) for s in seen.sets] == [1, 2, 1, 2, 1, 0]  # one report per change
    assert {r.authorization for r in api.requests} == {"Bearer secret-1"}
    assert all(r.query["labelSelector"] == "app=vllm" for r in api.requests)
    watches = [r.query for r in api.requests if r.query.get("watch") == "true"]
    assert watches[0]["allowWatchBookmarks"] == "true" and watches[0]["resourceVersion"]


async def test_a_bookmark_moves_the_resource_version_a_resumed_watch_starts_from(
    api: FakeKubernetes,
) -> None:
    api.set_pod("a")
    seen = Seen()
    source = source_for(api)
    async with running(source, seen):
        await until(lambda: seen.ids == ["a"] and api.watches == 1)
        api.bookmark()
        await until(lambda: source.resource_version == str(api._version))
        marked = source.resource_version
        api.end_watches()  # as its timeoutSeconds would
        await until(lambda: api.watches == 2)
        api.set_pod("b")
        await until(lambda: seen.ids == ["a", "b"])
    assert api.lists == 1  # resumed, not listed again
    assert api.requests[-1].query["resourceVersion"] == marked


@pytest.mark.parametrize("as_status", [False, True], ids=["error-event", "http-410"])
async def test_410_gone_lists_again_and_catches_up_with_what_changed(
    api: FakeKubernetes, as_status: bool
) -> None:
    api.gone_as_status = as_status
    api.set_pod("a")
    api.set_pod("b")
    seen = Seen()
    source = source_for(api)
    async with running(source, seen):
        await until(lambda: seen.ids == ["a", "b"] and api.watches == 1)
        # while the watch is down the history is compacted and pods change
        api.end_watches()
        api.expire()
        api.delete_pod("a")
        api.set_pod("c")
        api.expire()
        await until(lambda: seen.ids == ["b", "c"])
        assert source.lists >= 2
        api.set_pod("d")  # the watch after the new list sees what comes next
        await until(lambda: seen.ids == ["b", "c", "d"])


async def test_an_unreachable_api_keeps_the_workers_and_is_retried(api: FakeKubernetes) -> None:
    api.set_pod("a")
    seen = Seen()
    source = source_for(api)
    async with running(source, seen):
        await until(lambda: seen.ids == ["a"] and api.watches == 1)
        await api.stop()  # the watch ends, the next connection is refused
        await asyncio.sleep(0.3)
        assert seen.ids == ["a"] and len(seen.sets) == 1
        await api.start_again()
        api.set_pod("b")
        await until(lambda: seen.ids == ["a", "b"], within_s=8.0)


POD: dict[str, Any] = {
    "metadata": {"name": "w", "labels": {}, "annotations": {}},
    "status": {"phase": "Running", "podIP": "10.1.1.1",
               "conditions": [{"type": "Ready", "status": "True"}]},
}  # fmt: skip


@pytest.mark.parametrize(
    ("labels", "status_change", "expected"),
    [
        ({}, {}, ("http://10.1.1.1:8000", "mixed", "vllm")),
        ({"llm-d.ai/role": "both"}, {}, ("http://10.1.1.1:8000", "mixed", "vllm")),
        ({"llm-d.ai/role": "decode"}, {}, ("http://10.1.1.1:8000", "decode", "vllm")),
        ({"session-router/port": "8200"}, {}, ("http://10.1.1.1:8200", "mixed", "vllm")),
        ({}, {"podIP": "fd00::7"}, ("http://[fd00::7]:8000", "mixed", "vllm")),
        ({}, {"phase": "Pending"}, None),
        ({}, {"podIP": ""}, None),
        ({}, {"conditions": [{"type": "Ready", "status": "False"}]}, None),
        ({}, {"conditions": []}, None),
        ({"session-router/port": "0"}, {}, ValueError),
        ({"session-router/port": "80x"}, {}, ValueError),
        ({"session-router/role": "leader"}, {}, ValueError),
        ({"session-router/engine": "trt"}, {}, ValueError),
        ({"session-router/nic-gbps": "nan"}, {}, ValueError),
        ({"session-router/priority-scheduling": "maybe"}, {}, ValueError),
    ],
)
def test_pod_worker_reads_the_pod(
    labels: dict[str, str], status_change: dict[str, object], expected: object
) -> None:
    import msgspec

    raw = {**POD, "metadata": {**POD["metadata"], "labels": labels},
           "status": {**POD["status"], **status_change}}  # fmt: skip
    pod = msgspec.convert(raw, Pod)
    if expected is ValueError:
        with pytest.raises(ValueError, match="session-router/"):
            pod_worker(pod, WorkerDefaults())
        return
    spec = pod_worker(pod, WorkerDefaults())
    if expected is None:
        assert spec is None
    else:
        assert spec is not None and spec.worker_id == "w"
        assert (spec.url, spec.role, spec.engine) == expected


async def test_a_pod_with_wrong_labels_is_no_worker_until_they_are_fixed(
    api: FakeKubernetes,
) -> None:
    api.set_pod("a", labels={"session-router/role": "boss"})
    api.set_pod("b")
    seen = Seen()
    async with running(source_for(api), seen):
        await until(lambda: seen.ids == ["b"])
        api.set_pod("a", labels={"session-router/role": "decode"})
        await until(lambda: seen.ids == ["a", "b"])


@pytest.mark.parametrize("authority", ["ca", "rogue-ca"])
async def test_the_api_server_over_tls_is_verified_against_the_ca_file(
    certs: Path,  # noqa: F811
    authority: str,
) -> None:
    api = FakeKubernetes(tls=_server_context(certs))
    await api.start()
    try:
        api.set_pod("a")
        source = KubernetesSource(api.url, api.namespace, "app=vllm", WorkerDefaults(),
                                  ca_file=str(certs / f"{authority}.pem"))  # fmt: skip
        seen = Seen()
        async with running(source, seen):
            if authority == "ca":
                await until(lambda: seen.ids == ["a"])
            else:  # not the API server's CA: nothing is believed
                await asyncio.sleep(0.5)
                assert seen.sets == [] and source.lists == 0
    finally:
        await api.stop()
