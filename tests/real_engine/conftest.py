"""The real-engine suite's fixtures: three real vLLM engines for the whole session (NIXL
between them, priority scheduling, at most four running sequences each, so that queues form),
and routers started per test in front of them as an operator would start one.

`make test-real` installs the engines first (`make real-engines`); the engines start as
children of this process, in its session (`bench.vllm.engine` says why).
"""

from __future__ import annotations

import json
import os
import random
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import openai
import pytest

from bench.stack.up import free_port_block
from bench.vllm.fleet import FleetSpec, VllmFleet, kv_bytes_per_token
from bench.vllm.install import DEFAULT_CACHE
from router.fleet.prom_text import parse_samples
from tests.procs import Process

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / os.environ.get("SESSION_ROUTER_VLLM_VENV", ".venv-vllm")  # relative: to ROOT
MODEL = ROOT / DEFAULT_CACHE / "tiny-llama-seed0"
HOST = "127.0.0.1"
ADMIN_TOKEN = "real-engine-suite"
MAX_NUM_SEQS = 4
# 1,024 blocks of 128 tokens (128 MB of the tiny model's KV) instead of the 1 GiB that
# VLLM_CPU_KVCACHE_SPACE=1 gives: NIXL registers all of it at start, which is most of an
# engine's start-up on a busy machine
NUM_GPU_BLOCKS = 1024


def _require_install() -> None:
    missing = [str(p) for p in (VENV / "bin" / "vllm", MODEL / "config.json") if not p.exists()]
    if missing:
        pytest.fail(f"missing {', '.join(missing)}: run `make real-engines` first")


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """The URLs of three engines, each able to prefill for another or decode what another
    prefilled. SESSION_ROUTER_REAL_ENGINES (three URLs, comma-separated) names engines already
    running with this suite's options (`session-router up --engine vllm --mixed 3
    --max-num-seqs 4 --num-gpu-blocks 1024`) instead."""
    _require_install()
    given = os.environ.get("SESSION_ROUTER_REAL_ENGINES")
    if given:
        urls = [url.strip().rstrip("/") for url in given.split(",") if url.strip()]
        if len(urls) != 3:
            pytest.fail("SESSION_ROUTER_REAL_ENGINES must name three engine URLs")
        yield urls
        return
    ports = free_port_block(HOST, 6)
    spec = FleetSpec(
        model=str(MODEL), roles=("mixed", "mixed", "mixed"), base_port=ports,
        side_channel_base=ports + 3, scheduling_policy="priority", max_num_seqs=MAX_NUM_SEQS,
        num_gpu_blocks=NUM_GPU_BLOCKS,
    )  # fmt: skip
    engines = VllmFleet(spec, VENV, tmp_path_factory.mktemp("engines"))
    started = time.monotonic()
    engines.start(timeout_s=600)
    print(f"\n[real engines] 3 vLLM engines healthy in {time.monotonic() - started:.0f} s")
    try:
        yield engines.urls
    finally:
        engines.stop()


class Router:
    """`session-router serve` in front of the given workers, with its own embedded Redis,
    ready (its workers scraped) when made."""

    def __init__(
        self, workers: Sequence[tuple[str, str]], policy: str,
        params: Sequence[str] = (), extra: Sequence[str] = (),
    ) -> None:  # fmt: skip
        self.port = free_port_block(HOST, 1)
        self.url = f"http://{HOST}:{self.port}"
        args = [
            "serve", "--host", HOST, "--port", str(self.port), "--redis", "embedded",
            "--policy", policy, "--admin-token", ADMIN_TOKEN, "--scrape-interval-ms", "200",
            "--kv-bytes-per-token", str(kv_bytes_per_token(MODEL)),
            "--tokenizer", str(MODEL / "tokenizer.json"), "--priority-scheduling",
            "--allow-policy-import",
        ]  # fmt: skip
        for param in params:
            args += ["--policy-param", param]
        for role, url in workers:
            args += [f"--{role}", url]
        self._clients: list[openai.OpenAI] = []
        self.process = Process([*args, *extra])
        self.process.wait_healthy([self.url], timeout_s=60, path="/ready")

    def client(self, session: str) -> openai.OpenAI:
        """The openai client, its turns of `session` (closed with the router)."""
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0,
                               timeout=120, default_headers={"X-Session-ID": session})  # fmt: skip
        self._clients.append(client)
        return client

    def admin(self, method: str, path: str) -> object:
        request = urllib.request.Request(
            f"{self.url}/admin/{path}", method=method,
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=10) as answer:
            return json.loads(answer.read() or b"null")

    def decisions(self, session_prefix: str = "", count: int = 0) -> list[dict[str, object]]:
        """The router's decisions of the sessions whose ids start with `session_prefix`, once
        at least `count` have settled (within 10 s): a turn's decision settles just after its
        client has the whole answer, as the router reads the worker's stream to its close."""
        deadline = time.monotonic() + 10.0
        while True:
            found = self.admin("GET", "decisions?limit=1000")
            assert isinstance(found, dict)
            decisions = [d for d in found["decisions"]
                         if str(d["session_id"]).startswith(session_prefix)]  # fmt: skip
            if len(decisions) >= count or time.monotonic() > deadline:
                return decisions
            time.sleep(0.05)

    def stop(self) -> None:
        for client in self._clients:
            client.close()
        self.process.stop(timeout_s=30)


@pytest.fixture
def start_router() -> Iterator[object]:
    routers: list[Router] = []

    def start(
        workers: Sequence[tuple[str, str]], policy: str, params: Sequence[str] = (),
        extra: Sequence[str] = (),
    ) -> Router:  # fmt: skip
        router = Router(workers, policy, params, extra)
        routers.append(router)
        return router

    yield start
    for router in routers:
        router.stop()


def engine_counters(url: str) -> dict[str, float]:
    """The prompt-token sources and the NIXL pull counters of an engine's /metrics page."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
        page = answer.read().decode()
    names = frozenset({
        "vllm:prompt_tokens_by_source_total", "vllm:nixl_bytes_transferred_sum",
        "vllm:nixl_xfer_time_seconds_count", "vllm:prefix_cache_hits_total",
    })  # fmt: skip
    samples = parse_samples(page, names)
    out: dict[str, float] = {}
    for labels, value in samples.get("vllm:prompt_tokens_by_source_total", []):
        out[labels["source"]] = value
    for name in names - {"vllm:prompt_tokens_by_source_total"}:
        out[name] = sum(value for _, value in samples.get(name, []))
    return out


# Prompts differ between runs too: engines named by SESSION_ROUTER_REAL_ENGINES keep what
# earlier runs left in their prefix caches.
RUN = random.SystemRandom().randrange(10**9)


def words(seed: int, count: int) -> str:
    """A prompt of `count` random words, different for every seed and every run (no prefix
    shared by accident with another prompt in the engines' caches)."""
    rng = random.Random(f"{RUN}:{seed}")
    return " ".join(f"w{rng.randrange(10**6)}" for _ in range(count))
