"""`sim.worker.conformance`: each difference it must find, on the vLLM 0.32 captures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sim.worker.conformance import ROUTER_METRICS, compare_metrics, compare_reply, parse_page

CAPTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vllm_0_32"
SAME_VALUES = ("vllm:prompt_tokens_by_source_total", "vllm:nixl_bytes_transferred_sum")


def capture(name: str) -> str:
    return (CAPTURES / name).read_text()


DECODE = "decode_metrics.txt"


def _edit(text: str, old: str, new: str) -> str:
    assert old in text
    return text.replace(old, new)


@pytest.mark.parametrize(
    ("old", "new", "found"),
    [
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
         "vllm:kv_cache_usage_perc: not in the candidate"),
        ("# TYPE vllm:num_requests_waiting gauge", "# TYPE vllm:num_requests_waiting counter",
         "vllm:num_requests_waiting: type counter"),
        ('source="external_kv_transfer"', 'source="remote"', "source values"),
        ('vllm:num_requests_running{engine="0",', "vllm:num_requests_running{",
         "vllm:num_requests_running: labels"),
        ('le="2.097152e+06"', 'le="2.0e+06"', "vllm:nixl_bytes_transferred_bucket: buckets"),
        ('source="external_kv_transfer"} 1107.0', 'source="external_kv_transfer"} 1106.0',
         "vllm:prompt_tokens_by_source_total: values"),
    ],
)  # fmt: skip
def test_compare_metrics_finds_each_difference(old: str, new: str, found: str) -> None:
    reference = capture(DECODE)
    assert compare_metrics(reference, reference, ROUTER_METRICS, SAME_VALUES) == []
    problems = compare_metrics(reference, _edit(reference, old, new), ROUTER_METRICS,
                               SAME_VALUES)  # fmt: skip
    assert any(problem.startswith(found) or found in problem for problem in problems), problems


@pytest.mark.parametrize(
    ("change", "found"),
    [
        (lambda p: p.pop("transfer_mode"), "$.kv_transfer_params.transfer_mode: missing"),
        (lambda p: p.update(extra=1), "$.kv_transfer_params.extra: not in the reference"),
        (lambda p: p.update(remote_block_ids=[9]), "$.kv_transfer_params.remote_block_ids[]"),
        (lambda p: p.update(remote_port="25963"), "$.kv_transfer_params.remote_port: string"),
        (lambda p: p.update(tp_size=1.0), "$.kv_transfer_params.tp_size: number"),
        (lambda p: p.update(remote_blocks_expiry_time=1.5),
         "$.kv_transfer_params.remote_blocks_expiry_time: number"),
    ],
)  # fmt: skip
def test_compare_reply_finds_each_difference(change: Any, found: str) -> None:
    reference = json.loads(capture("prefill_reply.json"))
    candidate = json.loads(capture("prefill_reply.json"))
    assert compare_reply(reference, candidate) == []
    change(candidate["kv_transfer_params"])
    problems = compare_reply(reference, candidate)
    assert any(problem.startswith(found) for problem in problems), problems


def test_parse_page_reads_types_labels_and_values_as_written() -> None:
    samples = parse_page(capture(DECODE))
    assert samples["vllm:prefix_cache_hits_total"].kind == "counter"
    assert samples["vllm:nixl_bytes_transferred_sum"].kind == "histogram"
    assert samples["vllm:num_requests_waiting_by_reason"].label_values["reason"] == {
        "capacity", "deferred"}  # fmt: skip
    transferred = samples["vllm:prompt_tokens_by_source_total"].values
    assert transferred[frozenset({("engine", "0"), ("source", "external_kv_transfer")})] == 1107
    escaped = parse_page('# TYPE m gauge\nm{a="x\\"y\\\\z",b="}"} 2 123\n')["m"]
    assert escaped.label_values == {"a": {'x"y\\z'}, "b": {"}"}}
    with pytest.raises(ValueError, match="bad labels"):
        parse_page("m{a=1} 2\n")
    with pytest.raises(ValueError, match="not a sample"):
        parse_page("m{} \n")
