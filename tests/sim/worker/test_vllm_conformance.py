"""The simulated worker against vLLM 0.32.0 as captured (tests/fixtures/vllm_0_32/).

The captures: a NIXL handoff of a 1,107-token prompt between two vLLM 0.32.0 CPU engines
serving the tiny Llama (block size 128, 1,024 bytes of KV per token), the prefill engine's and
the decode engine's /metrics after it, and a prefill leg's reply. The same handoff is replayed
on two simulated workers of the same shape and compared with `sim.worker.conformance`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.stack.up import free_port_block
from sim.worker.conformance import (
    ROUTER_METRICS,
    compare_json,
    compare_metrics,
    compare_reply,
)
from tests import vllm_wire
from tests.procs import Process
from tests.vllm_wire import PREFILL_LEG, request

CAPTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vllm_0_32"
MODEL = "/models/tiny-llama"
PROMPT = " ".join(f"w{i}" for i in range(1107))  # 1,107 tokens to the simulated tokenizer
# What one handoff must leave on both engines' pages, exactly as in the captures.
SAME_VALUES = (
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:num_requests_waiting_by_reason", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_by_source_total",
    "vllm:nixl_xfer_time_seconds_count", "vllm:nixl_bytes_transferred_sum",
    "vllm:nixl_bytes_transferred_count", "vllm:nixl_num_descriptors_sum",
)  # fmt: skip


def capture(name: str) -> str:
    return (CAPTURES / name).read_text()


def cluster(*options: str) -> Iterator[list[str]]:
    base = free_port_block("127.0.0.1", 2)
    proc = Process(
        ["sim-cluster", "--base-port", str(base), "--workers", "2", "--noise", "0",
         "--model", "tiny-llama", "--block-size", "128", "--num-gpu-blocks-override", "8192",
         "--max-model-len", "4096", "--served-model-name", MODEL, *options]
    )  # fmt: skip
    urls = [f"http://127.0.0.1:{base + i}" for i in range(2)]
    proc.wait_healthy(urls)
    yield urls
    assert proc.stop() == 0, proc.output()


def handoff(prefill: str, decode: str) -> tuple[Any, Any]:
    """The captured scenario: a prefill leg, then a decode leg of 8 tokens with its params."""
    return vllm_wire.handoff(prefill, decode, MODEL, PROMPT)


@pytest.fixture(scope="module")
def replayed() -> Iterator[dict[str, Any]]:
    """Both replies and both pages, taken right after the one handoff on fresh workers."""
    for urls in cluster():
        first, second = handoff(*urls)
        pages = [request(url + "/metrics")[1] for url in urls]
        yield {"urls": urls, "prefill_reply": first, "decode_reply": second,
               "prefill_metrics": pages[0], "decode_metrics": pages[1]}  # fmt: skip


@pytest.fixture(scope="module")
def legacy() -> Iterator[list[str]]:
    yield from cluster("--vllm-version", "legacy")


@pytest.mark.parametrize("page", ["prefill_metrics", "decode_metrics"])
def test_metrics_the_router_reads_conform(replayed: dict[str, Any], page: str) -> None:
    assert compare_metrics(capture(f"{page}.txt"), replayed[page], ROUTER_METRICS,
                           SAME_VALUES) == []  # fmt: skip


def test_nixl_metrics_conform_on_both_sides(replayed: dict[str, Any]) -> None:
    names = [f"vllm:nixl_{name}" for name in (
        "xfer_time_seconds_bucket", "post_time_seconds_bucket", "post_time_seconds_sum",
        "bytes_transferred_bucket", "num_descriptors_bucket", "num_descriptors_sum",
        "num_failed_transfers_total", "num_kv_expired_reqs_total",
    )]  # fmt: skip
    for page in ("prefill_metrics", "decode_metrics"):
        assert compare_metrics(capture(f"{page}.txt"), replayed[page], names) == []


def test_help_and_type_lines_match_the_capture(replayed: dict[str, Any]) -> None:
    ours = set(replayed["decode_metrics"].splitlines())
    theirs = capture("decode_metrics.txt").splitlines()
    # every metadata line of ours for a vllm: family is the capture's, word for word
    ours_meta = {line for line in ours if line.startswith(("# HELP vllm:", "# TYPE vllm:"))}
    assert ours_meta <= set(theirs), sorted(ours_meta - set(theirs))
    assert not [line for line in ours if line.startswith("vllm:gpu_cache_usage_perc")]


def test_prefill_reply_conforms(replayed: dict[str, Any]) -> None:
    reference = json.loads(capture("prefill_reply.json"))
    reply = replayed["prefill_reply"]
    assert compare_reply(reference, reply) == []
    params = reply["kv_transfer_params"]
    assert params["transfer_mode"] == "pull" and params["remote_num_tokens"] == 1107
    assert len(params["remote_block_ids"]) == 1 and len(params["remote_block_ids"][0]) == 9


def test_decode_usage_counts_no_transferred_tokens(replayed: dict[str, Any]) -> None:
    reference = json.loads(capture("prefill_reply.json"))["usage"]
    usage = replayed["decode_reply"]["usage"]
    assert compare_json(reference, usage) == []
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (1107, 8)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # as vLLM 0.32 reports it


def test_the_recorded_transfer_moved_whole_blocks(replayed: dict[str, Any]) -> None:
    """1,107 tokens are 9 blocks of 128: 1,179,648 bytes at 1,024 bytes a token."""
    lines = replayed["decode_metrics"].splitlines()
    sums = [line for line in lines if line.startswith("vllm:nixl_bytes_transferred_sum")]
    assert [float(line.rsplit(" ", 1)[1]) for line in sums] == [1_179_648.0]
    assert (
        'vllm:nixl_bytes_transferred_sum{engine="0",model_name="/models/tiny-llama"} '
        "1.179648e+06" in lines
    )  # written as vLLM writes it


def test_priority_without_priority_scheduling_is_ignored(
    replayed: dict[str, Any], legacy: list[str]
) -> None:
    body = {"model": MODEL, "prompt": "hi there", "max_tokens": 1, "priority": 5}
    status, reply = request(replayed["urls"][0] + "/v1/completions", body)
    assert status == 200 and reply["usage"]["completion_tokens"] == 1
    status, reply = request(legacy[0] + "/v1/completions", body)
    assert status == 400 and reply["error"]["param"] == "priority"


def test_legacy_speaks_the_older_wire(legacy: list[str]) -> None:
    first, second = handoff(*legacy)
    params = first["kv_transfer_params"]
    assert set(params) == {"do_remote_prefill", "do_remote_decode", "remote_block_ids",
                           "remote_engine_id", "remote_request_id", "remote_host",
                           "remote_port", "tp_size"}  # fmt: skip
    assert all(isinstance(block, int) for block in params["remote_block_ids"])
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 1106  # pulled, counted


def moved_bytes(url: str) -> float:
    page = request(url + "/metrics")[1]
    [line] = [line for line in page.splitlines()
              if line.startswith("vllm:nixl_bytes_transferred_sum")]  # fmt: skip
    return float(line.rsplit(" ", 1)[1])


def test_a_flat_block_list_is_still_pulled(replayed: dict[str, Any]) -> None:
    prefill, decode = replayed["urls"]
    before = moved_bytes(decode)
    prompt = " ".join(f"flat{i}" for i in range(300))
    status, first = request(prefill + "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": PREFILL_LEG,
    })  # fmt: skip
    params = first["kv_transfer_params"]
    params["remote_block_ids"] = params["remote_block_ids"][0]
    status, _ = request(decode + "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 2, "kv_transfer_params": params,
    })  # fmt: skip
    assert status == 200
    assert moved_bytes(decode) - before == 3 * 128 * 1024  # 300 tokens: 3 blocks


@pytest.mark.parametrize(
    "blocks",
    ["nine", [[1, "2"]], [[1], 2], [-1], {"0": [1]}, [True]],
)
def test_malformed_block_ids_are_refused(replayed: dict[str, Any], blocks: Any) -> None:
    params = {**replayed["prefill_reply"]["kv_transfer_params"], "remote_block_ids": blocks}
    status, reply = request(replayed["urls"][1] + "/v1/completions", {
        "model": MODEL, "prompt": "x y z", "max_tokens": 1, "kv_transfer_params": params,
    })  # fmt: skip
    assert status == 400 and reply["error"]["param"] == "kv_transfer_params"
