"""Which role each worker of a comparison cluster plays under a policy, and the cluster spec.

One rule for every bench command (live `bench compare` and `bench simulate`), so a policy is
always compared on the same GPUs laid out the same way: colocate, which never splits a turn,
gets only mixed workers; adaptive, which splits a turn only when that pays, gets mixed workers
unless `prefill_workers` is given; every other policy (disaggregate, threshold, round-robin,
and plugins) gets `prefill_workers` prefill workers (default a quarter of the cluster, at
least one) followed by decode workers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import msgspec

from policies.types import Role

MIXED_POLICIES: frozenset[str] = frozenset(("colocate",))
# Policies that decide per turn whether to split it: mixed workers unless a split is asked for.
MIXED_BY_DEFAULT: frozenset[str] = frozenset(("adaptive",))

# Policy parameters that describe the hardware; filled from the cluster unless given.
_HARDWARE_PARAMS = ("gpu", "model", "tp", "chunked_prefill", "max_num_seqs")

_CLUSTER = re.compile(r"^(?P<count>\d+)x(?P<gpu>[^/\s]+)/(?P<model>[^/\s]+)$")


def default_prefill_workers(workers: int) -> int:
    """A quarter of the cluster, at least one."""
    return max(1, workers // 4)


def worker_roles(policy: str, workers: int, prefill_workers: int | None = None) -> list[Role]:
    """The role of each of `workers` workers under `policy`, prefill workers first.

    ValueError when a splitting policy cannot have at least one prefill and one decode worker.
    """
    if workers < 1:
        raise ValueError(f"a cluster needs at least one worker, got {workers}")
    if policy in MIXED_POLICIES or (policy in MIXED_BY_DEFAULT and prefill_workers is None):
        return ["mixed"] * workers
    prefill = default_prefill_workers(workers) if prefill_workers is None else prefill_workers
    if workers < 2 or not 1 <= prefill <= workers - 1:
        raise ValueError(
            f"policy {policy!r} splits prefill from decode: it needs 1 <= prefill workers <= "
            f"{workers - 1} on {workers} workers, got {prefill}"
        )
    prefill_roles: list[Role] = ["prefill"] * prefill
    decode_roles: list[Role] = ["decode"] * (workers - prefill)
    return prefill_roles + decode_roles


class ClusterSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`workers` identical `gpu` x `tp` deployments of `model` (names from sim.engine.presets)."""

    workers: int
    gpu: str
    model: str
    tp: int = 1

    @classmethod
    def parse(cls, text: str, tp: int = 1) -> ClusterSpec:
        """Parse `NxGPU/MODEL`, e.g. `8xh200-sxm/llama-3.1-8b`."""
        match = _CLUSTER.match(text.strip())
        if match is None:
            raise ValueError(f"cluster must look like 8xh200-sxm/llama-3.1-8b, got {text!r}")
        count = int(match["count"])
        if count < 1 or tp < 1:
            raise ValueError(f"cluster {text!r}: worker count and tp must be >= 1")
        return cls(count, match["gpu"], match["model"], tp)

    def __str__(self) -> str:
        tp = f" (tp {self.tp})" if self.tp > 1 else ""
        return f"{self.workers}x{self.gpu}/{self.model}{tp}"


def hardware_params(
    params_type: type[msgspec.Struct] | None,
    given: Mapping[str, str],
    cluster: ClusterSpec,
    chunked_prefill: int | None = None,
    max_num_seqs: int | None = None,
) -> dict[str, object]:
    """`given` plus the cluster's hardware for the hardware parameters a policy declares.

    A policy such as `adaptive` takes the GPU and model as priors, and the engines' chunk size
    and sequence cap; an operator configures them for the cluster it runs on, so the bench does
    the same. Parameters the user gave win.
    """
    out: dict[str, object] = dict(given)
    declared = params_type.__struct_fields__ if params_type is not None else ()
    values: dict[str, object] = {
        "gpu": cluster.gpu,
        "model": cluster.model,
        "tp": cluster.tp,
        "chunked_prefill": chunked_prefill,
        "max_num_seqs": max_num_seqs,
    }
    for name in _HARDWARE_PARAMS:
        if name in declared and name not in out and values[name] is not None:
            out[name] = values[name]
    return out
