"""Whether one engine's wire matches another's where the router reads it.

Each function takes a reference (a real vLLM's page or reply: a capture, or a live engine) and a
candidate (the simulated worker's, or another engine's) and returns the differences found, one
sentence each: an empty list means they conform. Values are not compared unless asked: two
engines run different models at different speeds, so conformance is names, types, label names
and label values, JSON keys and value types; a scenario replayed on both can also compare the
values that must agree (tokens by source, bytes per transfer).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# The samples the router reads from a vLLM worker's /metrics (load, prefix cache, transfers).
ROUTER_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_requests_waiting_by_reason",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prompt_tokens_by_source_total",
    "vllm:nixl_xfer_time_seconds_sum",
    "vllm:nixl_xfer_time_seconds_count",
    "vllm:nixl_bytes_transferred_sum",
    "vllm:nixl_bytes_transferred_count",
)
# Labels whose values name the deployment, not the meaning of a sample.
_DEPLOYMENT_LABELS = frozenset({"model_name"})


@dataclass
class _Sample:
    kind: str  # the family's TYPE
    label_names: set[frozenset[str]] = field(default_factory=set)
    label_values: dict[str, set[str]] = field(default_factory=dict)
    values: dict[frozenset[tuple[str, str]], float] = field(default_factory=dict)


_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created", "_info")
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def parse_page(page: str) -> dict[str, _Sample]:
    """A /metrics page (text format 0.0.4) by sample name (`x_total`, `x_bucket`, `x_sum`,
    a gauge's own name), each with the type its family's `# TYPE` line gives, as written:
    `untyped` where there is none. Raises ValueError on a line that is not a sample."""
    types: dict[str, str] = {}
    samples: dict[str, _Sample] = {}
    for number, line in enumerate(page.splitlines(), 1):
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            types[name] = kind.strip()
            continue
        if not line.strip() or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise ValueError(f"line {number} is not a sample: {line!r}")
        name, body, value = match.groups()
        labels = _labels(body or "", number)
        entry = samples.get(name)
        if entry is None:
            entry = samples[name] = _Sample(_type_of(name, types))
        entry.label_names.add(frozenset(labels))
        for label, text in labels.items():
            entry.label_values.setdefault(label, set()).add(text)
        key = frozenset(item for item in labels.items() if item[0] not in _DEPLOYMENT_LABELS)
        entry.values[key] = float(value)
    return samples


def _labels(body: str, number: int) -> dict[str, str]:
    labels: dict[str, str] = {}
    at = 0
    while at < len(body):
        match = _LABEL.match(body, at)
        if match is None:
            raise ValueError(f"line {number}: bad labels {body!r}")
        labels[match.group(1)] = re.sub(r'\\[\\"n]', lambda m: _UNESCAPE[m.group(0)],
                                        match.group(2))  # fmt: skip
        at = match.end()
    return labels


def _type_of(sample: str, types: dict[str, str]) -> str:
    """The sample's family's declared type: its own name's, else the name less a suffix."""
    if sample in types:
        return types[sample]
    for suffix in _SUFFIXES:
        if sample.endswith(suffix) and sample[: -len(suffix)] in types:
            return types[sample[: -len(suffix)]]
    return "untyped"


def compare_metrics(
    reference: str, candidate: str, names: Iterable[str] = ROUTER_METRICS,
    same_values: Iterable[str] = (),
) -> list[str]:  # fmt: skip
    """How `candidate`'s page differs from `reference`'s for the samples `names`: presence,
    the family's type, label names, label values (all but `model_name`) and, for a histogram,
    its buckets. Samples named in `same_values` must also have equal values, label set by
    label set."""
    ours, theirs = parse_page(reference), parse_page(candidate)
    problems: list[str] = []
    for name in names:
        ref, got = ours.get(name), theirs.get(name)
        if ref is None or got is None:
            where = "either page" if ref is got else "the candidate" if got is None else (
                "the reference")  # fmt: skip
            problems.append(f"{name}: not in {where}")
            continue
        if ref.kind != got.kind:
            problems.append(f"{name}: type {got.kind}, the reference's is {ref.kind}")
        if ref.label_names != got.label_names:
            problems.append(
                f"{name}: labels {_sets(got.label_names)}, the reference's {_sets(ref.label_names)}"
            )
        for label, values in ref.label_values.items():
            found = got.label_values.get(label, set())
            if label not in _DEPLOYMENT_LABELS and found != values:
                problems.append(f"{name}: {label} values {sorted(found)}, the reference's "
                                f"{sorted(values)}")  # fmt: skip
        if ref.kind == "histogram":
            problems += _compare_buckets(name, ours, theirs)
    for name in same_values:
        ref, got = ours.get(name), theirs.get(name)
        if ref is not None and got is not None and ref.values != got.values:
            problems.append(f"{name}: values {_values(got)}, the reference's {_values(ref)}")
    return problems


def _compare_buckets(name: str, ours: dict[str, _Sample], theirs: dict[str, _Sample]) -> list[str]:
    family = name.rsplit("_", 1)[0] + "_bucket"
    ref, got = ours.get(family), theirs.get(family)
    bounds = [sorted(float(le) for le in s.label_values.get("le", ())) if s else [] for s in
              (ref, got)]  # fmt: skip
    if bounds[0] != bounds[1]:
        return [f"{family}: buckets {bounds[1]}, the reference's {bounds[0]}"]
    return []


def compare_json(reference: Any, candidate: Any, path: str = "$") -> list[str]:
    """How `candidate` differs from `reference` in shape: object keys, and every value's JSON
    type (null, boolean, integer, number, string, array, object), arrays element by element
    type. Values themselves are not compared."""
    ref_type, got_type = _json_type(reference), _json_type(candidate)
    if ref_type != got_type:
        return [f"{path}: {got_type}, the reference's is {ref_type}"]
    if isinstance(reference, Mapping):
        problems = [f"{path}.{key}: missing" for key in reference if key not in candidate]
        problems += [f"{path}.{key}: not in the reference" for key in candidate
                     if key not in reference]  # fmt: skip
        for key in reference:
            if key in candidate:
                problems += compare_json(reference[key], candidate[key], f"{path}.{key}")
        return problems
    if isinstance(reference, list):
        ref_items = {_shape(item) for item in reference}
        got_items = {_shape(item) for item in candidate}
        if ref_items and got_items and ref_items != got_items:
            return [f"{path}[]: {sorted(got_items)}, the reference's {sorted(ref_items)}"]
    return []


def compare_reply(reference: Mapping[str, Any], candidate: Mapping[str, Any]) -> list[str]:
    """The fields of a completion reply the router reads: `usage` and `kv_transfer_params`."""
    return [
        problem
        for key in ("usage", "kv_transfer_params")
        for problem in compare_json(reference.get(key), candidate.get(key), f"$.{key}")
    ]


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _shape(value: Any) -> str:
    """A value's type, an array's with its elements' (`array[array[integer]]`)."""
    if isinstance(value, list):
        return f"array[{'|'.join(sorted({_shape(item) for item in value}))}]"
    return _json_type(value)


def _sets(names: set[frozenset[str]]) -> list[list[str]]:
    return sorted(sorted(group) for group in names)


def _values(sample: _Sample) -> dict[str, float]:
    return {
        ",".join(f"{k}={v}" for k, v in sorted(labels)) or "-": value
        for labels, value in sorted(sample.values.items(), key=lambda kv: sorted(kv[0]))
    }
