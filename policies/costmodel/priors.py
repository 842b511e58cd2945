"""Priors: the accelerator and model figures the cost model starts from, and their roofline.

These are priors only: policies.costmodel.estimates corrects them online from observed outcomes, so
a wrong preset costs accuracy for the first turns, never correctness. Numbers are dense bf16 peak
FLOP/s, HBM bytes per second and HBM bytes per GPU; model shapes are the published configs.
The roofline reaches 60% of peak FLOP/s and 85% of peak bandwidth, plus 1.5 ms per engine step
(the formulas are in policies.costmodel.estimates; the roofline's terms in
policies.costmodel.roofline).
"""

from __future__ import annotations

import msgspec

from policies.params import PolicyConfigError

DTYPE_BYTES = 2  # bf16 weights and KV cache
COMPUTE_EFFICIENCY = 0.6
MEMORY_EFFICIENCY = 0.85
STEP_OVERHEAD_MS = 1.5


class GpuPrior(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One accelerator: dense bf16 FLOP/s, HBM bytes/s, HBM bytes."""

    name: str
    peak_flops: float
    mem_bandwidth: float
    mem_bytes: float


class ModelPrior(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A decoder-only transformer's shape, as far as the cost model needs it."""

    name: str
    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    params: float

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token: 2 x layers x kv heads x head dim x 2 bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES

    @property
    def weight_bytes(self) -> float:
        return self.params * DTYPE_BYTES


GPU_PRIORS: dict[str, GpuPrior] = {
    g.name: g
    for g in (
        GpuPrior("h100-sxm", 989e12, 3.35e12, 80e9),
        GpuPrior("h200-sxm", 989e12, 4.8e12, 141e9),
        GpuPrior("a100-80g", 312e12, 2.0e12, 80e9),
        # vLLM's CPU backend on two cores (REAL_VLLM.md): a figure fitted to its observed
        # 10 to 20 ms prefill of 512 tokens and 1.8 ms decode step of the tiny model
        GpuPrior("cpu", 6e11, 5e10, 24e9),
    )
}

MODEL_PRIORS: dict[str, ModelPrior] = {
    m.name: m
    for m in (
        ModelPrior("llama-3.1-8b", 32, 4096, 32, 8, 128, 8.03e9),
        ModelPrior("llama-3.1-70b", 80, 8192, 64, 8, 128, 70.6e9),
        # the real-engine suite's model (bench.vllm.tiny_model)
        ModelPrior("tiny-llama", 2, 256, 4, 2, 64, 5.4e6),
    )
}


def gpu_prior(name: str) -> GpuPrior:
    """The GPU preset `name`; PolicyConfigError listing the known ones otherwise."""
    try:
        return GPU_PRIORS[name]
    except KeyError:
        raise PolicyConfigError(
            f"unknown GPU preset {name!r}; known: {', '.join(sorted(GPU_PRIORS))}"
        ) from None


def model_prior(name: str) -> ModelPrior:
    """The model preset `name`; PolicyConfigError listing the known ones otherwise."""
    try:
        return MODEL_PRIORS[name]
    except KeyError:
        raise PolicyConfigError(
            f"unknown model preset {name!r}; known: {', '.join(sorted(MODEL_PRIORS))}"
        ) from None
