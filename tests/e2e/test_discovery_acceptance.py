"""Issue 43's acceptance, with real processes: a fake Kubernetes API adds and removes three
simulated workers (one serving a second model) while a multi-turn load runs through two router
replicas sharing one Redis. Every turn is answered, or refused with an OpenAI-shaped error;
none is misrouted (a turn for the second model only ever reaches a worker serving it).

The fake API server runs in this test's event loop; the routers, the simulated workers and
Redis are processes. What happens to the fleet, in order: two `llama` pods from the start; a
`llama` and a `qwen` pod join (created unready, then turning ready); a second `llama` pod
joins; the first added one turns unready and back; a bookmark, then a compaction (410 Gone,
listed again); the `qwen` pod terminates and is deleted, and its process stopped; the second
added `llama` pod is deleted and its process stopped. Misrouting is judged from both routers'
stage events (which worker served each turn, by the client's X-Request-Id naming its model)
and from every answer's `model`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench.stack.up import free_port_block
from tests.e2e.conftest import StartRouter, start_sim_cluster
from tests.fake_kubernetes import FakeKubernetes
from tests.procs import Process

LLAMA, QWEN = "llama", "qwen"
CLIENTS = 6
TURN_TIMEOUT_S = 30.0


@pytest.fixture
async def api() -> AsyncIterator[FakeKubernetes]:
    server = FakeKubernetes()
    await server.start()
    yield server
    await server.stop()


def pod(api: FakeKubernetes, name: str, url: str, ready: bool = True, **options: Any) -> None:
    port = url.rsplit(":", 1)[1]
    api.set_pod(name, "127.0.0.1", ready=ready,
                annotations={"session-router/port": port}, **options)  # fmt: skip


class Load:
    """Clients running multi-turn sessions through both routers in turn, a third of them for
    the second model, until stopped; every answer classified."""

    def __init__(self, routers: list[str]) -> None:
        self.routers = routers
        self.counts: Counter[str] = Counter()
        self.problems: list[str] = []
        self.models: dict[str, str] = {}  # client's request id -> the model it asked for
        self._ids = itertools.count()
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self, http: aiohttp.ClientSession, client: int) -> None:
        rng = random.Random(client)
        router_turn = itertools.cycle(self.routers[client % 2 :] + self.routers[: client % 2])
        while not self._stop.is_set():
            model = QWEN if rng.random() < 1 / 3 else LLAMA
            session = f"c{client}-{next(self._ids)}"
            messages = [{"role": "system", "content": "You are terse."}]
            for turn in range(rng.randint(2, 5)):
                if self._stop.is_set():
                    return
                messages.append({"role": "user", "content": f"turn {turn} " * rng.randint(5, 40)})
                answer = await self.turn(http, next(router_turn), session, model, messages,
                                         stream=rng.random() < 0.5)  # fmt: skip
                messages.append({"role": "assistant", "content": answer or "..."})

    async def turn(
        self, http: aiohttp.ClientSession, url: str, session: str, model: str,
        messages: list[dict[str, str]], stream: bool,
    ) -> str | None:  # fmt: skip
        request_id = f"{model}-{next(self._ids)}"
        self.models[request_id] = model
        body = {"model": model, "messages": messages, "max_tokens": 8, "stream": stream}
        headers = {"X-Session-Id": session, "X-Request-Id": request_id}
        self.counts[f"sent_{model}"] += 1
        try:
            async with asyncio.timeout(TURN_TIMEOUT_S):
                async with http.post(url + "/v1/chat/completions", json=body,
                                     headers=headers) as response:  # fmt: skip
                    raw = await response.read()
                    status = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.problems.append(f"{request_id}: {type(exc).__name__}: {exc}")
            return None
        if status != 200:
            if _openai_error(raw, status):
                self.counts[f"refused_{status}_{model}"] += 1
            else:
                self.problems.append(f"{request_id}: {status} not OpenAI-shaped: {raw[:200]!r}")
            return None
        answered = _answer(raw, stream)
        if answered is None:
            self.problems.append(f"{request_id}: 200 without a whole answer: {raw[-300:]!r}")
            return None
        text, served_model, error_frame = answered
        if error_frame:  # a stream that failed after its start ends with an error event
            self.counts["refused_midstream"] += 1
            return None
        if served_model != model:
            self.counts["misrouted"] += 1
            self.problems.append(f"{request_id}: asked {model}, answered by {served_model}")
        self.counts[f"answered_{model}"] += 1
        return text


def _openai_error(raw: bytes, status: int) -> bool:
    try:
        body = json.loads(raw)
    except ValueError:
        return False
    error = body.get("error") if isinstance(body, dict) else None
    return (
        isinstance(error, dict)
        and set(error) == {"message", "type", "param", "code"}
        and error["code"] == status
        and bool(error["message"])
    )


def _answer(raw: bytes, stream: bool) -> tuple[str, str, bool] | None:
    """(text, the model that answered, whether an error event came) of a 200."""
    if not stream:
        body = json.loads(raw)
        return body["choices"][0]["message"]["content"], body["model"], False
    text, model, error = [], "", False
    lines = raw.split(b"\n")
    if b"data: [DONE]" not in lines:
        return None
    for line in lines:
        if line.startswith(b"data: {"):
            frame = json.loads(line[6:])
            if "error" in frame:
                error = True
                continue
            model = frame.get("model", model)
            for choice in frame.get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text), model, error


async def ready(http: aiohttp.ClientSession, url: str) -> None:
    async with asyncio.timeout(30):
        while True:
            async with http.get(url + "/ready") as response:
                if response.status == 200:
                    return
            await asyncio.sleep(0.1)


async def fleet(http: aiohttp.ClientSession, url: str, token: str) -> dict[str, Any]:
    async with http.get(url + "/admin/workers",
                        headers={"Authorization": f"Bearer {token}"}) as response:  # fmt: skip
        assert response.status == 200
        return {w["id"]: w for w in (await response.json())["workers"]}


async def test_workers_come_and_go_under_load_through_two_routers_and_none_is_misrouted(
    api: FakeKubernetes, start_router: StartRouter, tmp_path: Path
) -> None:
    base = start_sim_cluster(2, "--served-model-name", LLAMA)
    first_port = free_port_block("127.0.0.1", 3)
    ports = range(first_port, first_port + 3)
    added: dict[str, tuple[str, Process]] = {}
    for name, model, port in zip(("add-llama-1", "add-qwen", "add-llama-2"),
                                 (LLAMA, QWEN, LLAMA), ports, strict=True):  # fmt: skip
        process = Process(["sim-worker", "--port", str(port), "--served-model-name", model,
                           "--noise", "0"])  # fmt: skip
        added[name] = (f"http://127.0.0.1:{port}", process)
    serves = {"base-0": LLAMA, "base-1": LLAMA, "add-llama-1": LLAMA, "add-qwen": QWEN,
              "add-llama-2": LLAMA}  # fmt: skip
    try:
        for url, process in added.values():
            process.wait_healthy([url])
        pod(api, "base-0", base.urls[0])
        pod(api, "base-1", base.urls[1])
        events = [tmp_path / "events-0.jsonl", tmp_path / "events-1.jsonl"]
        prefix = f"accept-43-{uuid.uuid4().hex[:8]}"  # both replicas share this state
        # started from a thread: this loop serves the API they list and watch as they start
        discovery = ["--discovery", "kubernetes", "--discovery-api-url", api.url,
                     "--discovery-namespace", api.namespace, "--discovery-selector", "app=vllm",
                     "--discovery-token-file", str(tmp_path / "no-token"),
                     "--departure-grace-s", "1"]  # fmt: skip
        routers = [
            await asyncio.to_thread(start_router, *discovery, "--events", str(path), prefix=prefix)
            for path in events
        ]
        timeout = aiohttp.ClientTimeout(total=2 * TURN_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            for router in routers:
                await ready(http, router.url)
            load = Load([router.url for router in routers])
            clients = [asyncio.create_task(load.run(http, i)) for i in range(CLIENTS)]
            started = time.monotonic()

            async def at(second: float) -> None:
                await asyncio.sleep(max(0.0, started + second - time.monotonic()))

            await at(2)
            pod(api, "add-llama-1", added["add-llama-1"][0], ready=False)
            pod(api, "add-qwen", added["add-qwen"][0], ready=False)
            await at(2.5)
            pod(api, "add-llama-1", added["add-llama-1"][0])
            pod(api, "add-qwen", added["add-qwen"][0])
            await at(5)
            pod(api, "add-llama-2", added["add-llama-2"][0])
            await at(8)
            pod(api, "add-llama-1", added["add-llama-1"][0], ready=False)
            await at(9.5)
            pod(api, "add-llama-1", added["add-llama-1"][0])
            await at(11)
            api.bookmark()
            api.expire()  # every watch gets 410 Gone: both routers list again
            await at(13)
            pod(api, "add-qwen", added["add-qwen"][0], terminating=True)
            await at(14)
            api.delete_pod("add-qwen")
            await at(16)
            added["add-qwen"][1].stop()
            api.delete_pod("add-llama-2")
            await at(18)
            added["add-llama-2"][1].stop()
            await at(20)
            load.stop()
            async with asyncio.timeout(2 * TURN_TIMEOUT_S):
                await asyncio.gather(*clients)
            fleets = [await fleet(http, r.url, r.admin_token) for r in routers]
        served = Counter()
        misrouted_by_events = []
        for path in events:
            for line in path.read_text().splitlines():
                event = json.loads(line)
                asked = load.models.get(event.get("client_request_id") or "")
                for worker in {event.get("prefill_worker"), event.get("decode_worker")} - {None}:
                    served[worker] += 1
                    if asked is not None and serves[worker] != asked:
                        misrouted_by_events.append((event["client_request_id"], worker))
        counts = load.counts
        sent = counts["sent_llama"] + counts["sent_qwen"]
        answered = counts["answered_llama"] + counts["answered_qwen"]
        refused = sum(v for k, v in counts.items() if k.startswith("refused_"))
        print(f"\nacceptance-43: turns {sent}, answered {answered} (llama "
              f"{counts['answered_llama']}, qwen {counts['answered_qwen']}), refused {refused} "
              f"({ {k: v for k, v in counts.items() if k.startswith('refused_')} }), misrouted "
              f"{counts['misrouted'] + len(misrouted_by_events)}, problems "
              f"{len(load.problems)}; placements per worker {dict(served)}; api lists "
              f"{api.lists}, watches {api.watches}")  # fmt: skip
        assert load.problems == []
        assert misrouted_by_events == [] and counts["misrouted"] == 0
        assert sent == answered + refused and sent > 100
        assert counts["answered_qwen"] > 0 and counts["answered_llama"] > answered // 2
        # llama had a worker serving it throughout: none of its turns was refused
        assert not [k for k in counts if k.startswith("refused_") and k.endswith(LLAMA)]
        for name in serves:  # every worker, added ones too, took turns
            assert served[name] > 0, (name, served)
        assert api.lists >= 4  # each router listed at start and again after the 410
        for found in fleets:  # the departed ones drained and were forgotten
            assert set(found) == {"base-0", "base-1", "add-llama-1"}, found
    finally:
        base.process.stop()
        for _, process in added.values():
            process.stop()
