from __future__ import annotations

from collections.abc import Callable

import pytest

from sim.engine.presets import (
    ACTIVATION_RESERVE_BYTES,
    GPUS,
    MODELS,
    Deployment,
    deployment_from_names,
    get_gpu,
    get_model,
)


@pytest.mark.parametrize(
    ("name", "flops", "bandwidth", "memory"),
    [
        ("h100-sxm", 989e12, 3.35e12, 80e9),
        ("h200-sxm", 989e12, 4.8e12, 141e9),
        ("a100-80g", 312e12, 2.0e12, 80e9),
    ],
)
def test_gpu_presets(name: str, flops: float, bandwidth: float, memory: float) -> None:
    gpu = get_gpu(name)
    assert (gpu.name, gpu.peak_flops, gpu.mem_bandwidth, gpu.mem_bytes) == (
        name,
        flops,
        bandwidth,
        memory,
    )


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("llama-3.1-8b", (32, 4096, 32, 8, 128, 14336, 128256, 8.03e9, 131072)),
        ("llama-3.1-70b", (80, 8192, 64, 8, 128, 28672, 128256, 70.6e9, 131072)),
        ("tiny-llama", (2, 256, 4, 2, 64, 512, 8192, 5.4e6, 4096)),
    ],
)
def test_model_presets(name: str, shape: tuple[float, ...]) -> None:
    m = get_model(name)
    assert (
        m.layers,
        m.hidden_size,
        m.heads,
        m.kv_heads,
        m.head_dim,
        m.intermediate_size,
        m.vocab_size,
        m.params,
        m.max_model_len,
    ) == shape


@pytest.mark.parametrize(
    ("model", "kv_bytes", "weights"),
    [
        ("llama-3.1-8b", 131072, 16.06e9),
        ("llama-3.1-70b", 327680, 141.2e9),
        ("tiny-llama", 1024, 10.8e6),
    ],
)
def test_kv_bytes_per_token_and_weights(model: str, kv_bytes: int, weights: float) -> None:
    dep = deployment_from_names("h200-sxm", model, tp=2)
    assert dep.kv_bytes_per_token == kv_bytes
    assert dep.weight_bytes == pytest.approx(weights)


def test_kv_capacity_8b_on_h200() -> None:
    dep = deployment_from_names("h200-sxm", "llama-3.1-8b")
    free = 141e9 * 0.9 - 8.03e9 * 2 - ACTIVATION_RESERVE_BYTES
    assert dep.kv_capacity_tokens == int(free // 131072) == 830383
    assert dep.kv_capacity_blocks == 830383 // 16


def test_kv_capacity_scales_with_tp() -> None:
    dep = deployment_from_names("h100-sxm", "llama-3.1-70b", tp=4)
    free = 4 * 80e9 * 0.9 - 70.6e9 * 2 - 4 * ACTIVATION_RESERVE_BYTES
    assert dep.kv_capacity_tokens == int(free // 327680)


@pytest.mark.parametrize(("gpu", "tp"), [("h100-sxm", 1), ("a100-80g", 1), ("h100-sxm", 2)])
def test_model_that_does_not_fit_raises(gpu: str, tp: int) -> None:
    dep = deployment_from_names(gpu, "llama-3.1-70b", tp=tp)
    with pytest.raises(ValueError, match="does not fit"):
        _ = dep.kv_capacity_tokens
    with pytest.raises(ValueError, match="does not fit"):
        _ = dep.kv_capacity_blocks


@pytest.mark.parametrize(
    ("call", "known"),
    [
        (lambda: get_gpu("tpu-v5"), ", ".join(sorted(GPUS))),
        (lambda: get_model("gpt-9"), ", ".join(sorted(MODELS))),
        (lambda: deployment_from_names("h100-sxm", "nope"), ", ".join(sorted(MODELS))),
    ],
)
def test_unknown_names_list_known_ones(call: Callable[[], object], known: str) -> None:
    with pytest.raises(ValueError, match=f"known: {known}"):
        call()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tp": 0},
        {"gpu_memory_utilization": 0.0},
        {"gpu_memory_utilization": 1.5},
        {"block_size": 0},
    ],
)
def test_deployment_rejects_nonsense(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Deployment(gpu=GPUS["h100-sxm"], model=MODELS["llama-3.1-8b"], **kwargs)  # type: ignore[arg-type]
