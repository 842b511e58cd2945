"""Hardware and model presets, and the KV-cache capacity a deployment derives from them."""

from __future__ import annotations

import msgspec

# Activations, CUDA graphs and allocator slack that vLLM keeps out of the KV cache, per GPU.
ACTIVATION_RESERVE_BYTES = 2e9


class GpuSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One accelerator: dense bf16 FLOP/s, HBM bytes/s, HBM bytes.

    `interconnect_bandwidth` (bytes/s per direction) and `interconnect_latency_s` describe the
    intra-node fabric used by tensor-parallel all-reduces.
    """

    name: str
    peak_flops: float
    mem_bandwidth: float
    mem_bytes: float
    interconnect_bandwidth: float = 450e9
    interconnect_latency_s: float = 5e-6


class ModelSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A decoder-only transformer's shape."""

    name: str
    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    params: float
    max_model_len: int


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("h100-sxm", 989e12, 3.35e12, 80e9),
        GpuSpec("h200-sxm", 989e12, 4.8e12, 141e9),
        GpuSpec("a100-80g", 312e12, 2.0e12, 80e9, interconnect_bandwidth=300e9),
    )
}

MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, 8.03e9, 131072),
        ModelSpec("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256, 70.6e9, 131072),
        # the seeded random Llama the real-engine suite serves (design/REAL_VLLM.md): 1,024
        # bytes of KV per token in bf16, as the vLLM 0.32 captures measured
        ModelSpec("tiny-llama", 2, 256, 4, 2, 64, 512, 8192, 5.4e6, 4096),
    )
}


class Deployment(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A model served on `tp` identical GPUs (one vLLM instance)."""

    gpu: GpuSpec
    model: ModelSpec
    tp: int = 1
    dtype_bytes: int = 2
    gpu_memory_utilization: float = 0.9
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.dtype_bytes < 1:
            raise ValueError(f"dtype_bytes must be >= 1, got {self.dtype_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer, summed over all GPUs of the deployment."""
        m = self.model
        return 2 * m.layers * m.kv_heads * m.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.model.params * self.dtype_bytes

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV that fit after weights and activations; ValueError if none fit."""
        budget = self.gpu.mem_bytes * self.tp * self.gpu_memory_utilization
        free = budget - self.weight_bytes - ACTIVATION_RESERVE_BYTES * self.tp
        tokens = int(free // self.kv_bytes_per_token)
        if tokens < self.block_size:
            raise ValueError(
                f"{self.model.name} does not fit on {self.tp} x {self.gpu.name}: "
                f"{self.weight_bytes / 1e9:.1f} GB of weights and "
                f"{ACTIVATION_RESERVE_BYTES * self.tp / 1e9:.1f} GB of activations "
                f"exceed {budget / 1e9:.1f} GB usable"
            )
        return tokens

    @property
    def kv_capacity_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_size


def get_gpu(name: str) -> GpuSpec:
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(sorted(GPUS))}") from None


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None


def deployment_from_names(gpu: str, model: str, tp: int = 1, block_size: int = 16) -> Deployment:
    return Deployment(gpu=get_gpu(gpu), model=get_model(model), tp=tp, block_size=block_size)
