"""The parameters of the `adaptive` policy (`--policy-param NAME=VALUE`), validated."""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from policies.costmodel.priors import gpu_prior, model_prior
from policies.params import PolicyConfigError


class AdaptiveParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`adaptive`: priors, admission and the few knobs of the I > H + dQ + dC placement."""

    on_infeasible: Literal["reject", "serve"] = "reject"
    gpu: str = "h200-sxm"
    model: str = "llama-3.1-8b"
    tp: int = 1
    chunked_prefill: int | None = None
    retry_after_s: float = 1.0
    migrate_queue_threshold: int = 4
    migrate_kv_usage: float = 0.9
    link_horizon_s: float = 1.0
    default_link_bps: float = 12.5e9
    shortlist: int = 3
    learning_rate: float = 0.1
    stall_window_s: float = 5.0
    # How long the share of filled KV that evicts live contexts is remembered (its decay).
    cache_window_s: float = 10.0
    # The engine's sequence cap (vLLM's --max-num-seqs, 256 by default): past it a request
    # waits for a running stream to finish.
    max_num_seqs: int = 256
    # The longest the router holds a turn for the streams on its prefill worker to end, so
    # the prefill stalls none of them (0: never hold).
    max_hold_s: float = 5.0

    def __post_init__(self) -> None:
        gpu_prior(self.gpu)
        model_prior(self.model)
        _require(self.tp >= 1, "tp", self.tp, ">= 1")
        if self.chunked_prefill is not None:
            _require(self.chunked_prefill >= 1, "chunked_prefill", self.chunked_prefill, ">= 1")
        _require(
            math.isfinite(self.retry_after_s) and self.retry_after_s >= 0,
            "retry_after_s",
            self.retry_after_s,
            "a finite number >= 0",
        )
        _require(
            self.migrate_queue_threshold >= 1,
            "migrate_queue_threshold",
            self.migrate_queue_threshold,
            ">= 1",
        )
        _require(
            0.0 < self.migrate_kv_usage <= 1.0,
            "migrate_kv_usage",
            self.migrate_kv_usage,
            "in (0, 1]",
        )
        _require(
            0.0 < self.link_horizon_s < math.inf,
            "link_horizon_s",
            self.link_horizon_s,
            "a finite number > 0",
        )
        _require(
            0.0 < self.default_link_bps < math.inf,
            "default_link_bps",
            self.default_link_bps,
            "a finite number > 0",
        )
        _require(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, ">= 1")
        _require(
            0.0 <= self.max_hold_s < math.inf,
            "max_hold_s",
            self.max_hold_s,
            "a finite number >= 0",
        )
        _require(self.shortlist >= 1, "shortlist", self.shortlist, ">= 1")
        _require(0.0 < self.learning_rate <= 1.0, "learning_rate", self.learning_rate, "in (0, 1]")
        _require(
            0.0 < self.stall_window_s < math.inf,
            "stall_window_s",
            self.stall_window_s,
            "a finite number > 0",
        )
        _require(
            0.0 < self.cache_window_s < math.inf,
            "cache_window_s",
            self.cache_window_s,
            "a finite number > 0",
        )


def _require(ok: bool, name: str, value: object, wanted: str) -> None:
    if not ok:
        raise PolicyConfigError(f"{name} must be {wanted}, got {value!r}")
