"""Real clients run unchanged against the router in front of real engines: vLLM's own
benchmark (`vllm bench serve`, shipped with vLLM) and guidellm, both from `make
real-engines`."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.real_engine.conftest import MODEL, VENV, Router

StartRouter = Callable[..., Router]
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
PROMPTS = 40


def _split_router(fleet: list[str], start_router: StartRouter) -> Router:
    return start_router([("prefill", fleet[0]), ("decode", fleet[1]), ("decode", fleet[2])],
                        "adaptive", params=["gpu=cpu", "model=tiny-llama"])  # fmt: skip


@pytest.mark.parametrize(
    ("backend", "endpoint"),
    [("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")],
)
def test_vllm_bench_serve_finishes_without_errors(
    fleet: list[str], start_router: StartRouter, tmp_path: Path, backend: str, endpoint: str
) -> None:
    router = _split_router(fleet, start_router)
    run = subprocess.run(
        [str(VENV / "bin" / "vllm"), "bench", "serve", "--backend", backend,
         "--base-url", router.url, "--endpoint", endpoint, "--model", str(MODEL),
         "--tokenizer", str(MODEL), "--dataset-name", "random", "--random-input-len", "300",
         "--random-output-len", "16", "--num-prompts", str(PROMPTS), "--request-rate", "2",
         "--ignore-eos", "--seed", "0", "--save-result", "--result-dir", str(tmp_path),
         "--result-filename", "result.json"],
        cwd=tmp_path, env={**os.environ, **OFFLINE}, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    print(f"\n[vllm bench serve {backend}] {result['completed']} completed, "
          f"{result.get('failed', 0)} failed, mean TTFT {result['mean_ttft_ms']:.1f} ms, "
          f"mean ITL {result['mean_itl_ms']:.2f} ms, "
          f"{result['request_throughput']:.2f} req/s")  # fmt: skip
    assert result["completed"] == PROMPTS
    assert not any(result.get("errors") or [])
    assert result["total_output_tokens"] == PROMPTS * 16


def test_guidellm_finishes_without_errors(
    fleet: list[str], start_router: StartRouter, tmp_path: Path
) -> None:
    router = _split_router(fleet, start_router)
    run = subprocess.run(
        [str(VENV / "bin" / "guidellm"), "run",
         "--backend", f"kind=openai_http,target={router.url},model={MODEL}",
         "--profile", "kind=constant,rate=2",
         "--constraint", f"kind=max_requests,count={PROMPTS}",
         "--data", "kind=synthetic_text,prompt_tokens=300,output_tokens=16",
         "--tokenizer", f"kind=huggingface_auto,model={MODEL}",
         "--disable-console-interactive"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, **OFFLINE, "GUIDELLM__DEFAULT_RESULTS_DIR": str(tmp_path)},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "benchmarks.json").read_text())
    totals = report["benchmarks"][0]["metrics"]["request_totals"]
    print(f"\n[guidellm] {totals}")
    assert totals["errored"] == 0 and totals["incomplete"] == 0
    # guidellm ends the run at its request count and leaves out a request it queued but had
    # not started by then (guidellm/benchmark/schemas/accumulator.py: "cancelled before
    # starting"): every request it sent succeeded, all or all but that one
    assert totals["successful"] == totals["total"] >= PROMPTS - 1
