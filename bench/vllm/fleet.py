"""Several real vLLM engines on consecutive ports, wired for NIXL handoffs between them.

Every engine gets a NixlConnector (`kv_both`: any of them can prefill for another or decode
what another prefilled, as a flexible placement needs) on its own side-channel port, and its
OpenMP threads pinned to one of the cores this process may use, in turn.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import msgspec

from bench.vllm.engine import EngineSpec, VllmEngine
from policies.costmodel.priors import DTYPE_BYTES, ModelPrior
from policies.types import Role


class FleetSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`roles` has one entry per engine, in port order; the side channels use the ports from
    `side_channel_base` on. `kv_connector` False: engines without NIXL (whole turns only)."""

    model: str
    roles: tuple[Role, ...]
    base_port: int
    side_channel_base: int
    host: str = "127.0.0.1"
    kv_connector: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    kv_cache_gib: int = 1
    max_model_len: int = 4096
    num_gpu_blocks: int | None = None
    max_num_seqs: int | None = None

    def __post_init__(self) -> None:
        if not self.roles:
            raise ValueError("a fleet needs at least one engine")


def available_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def engine_specs(spec: FleetSpec, cpus: Sequence[int]) -> list[EngineSpec]:
    if not cpus:
        raise ValueError("no CPU to pin the engines to")
    return [
        EngineSpec(
            model=spec.model, port=spec.base_port + i, host=spec.host,
            kv_role="kv_both" if spec.kv_connector else None,
            side_channel_port=spec.side_channel_base + i if spec.kv_connector else None,
            cpus=str(cpus[i % len(cpus)]), kv_cache_gib=spec.kv_cache_gib,
            max_model_len=spec.max_model_len, scheduling_policy=spec.scheduling_policy,
            num_gpu_blocks=spec.num_gpu_blocks, max_num_seqs=spec.max_num_seqs,
        )
        for i in range(len(spec.roles))
    ]  # fmt: skip


def kv_bytes_per_token(model_dir: str | Path) -> int:
    """A token's KV bytes in the engine's cache for the model at `model_dir` (its
    config.json), by the cost model's formula (`ModelPrior.kv_bytes_per_token`, bf16) scaled
    to the model's dtype."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    shape = ModelPrior(
        name=str(model_dir), layers=int(config["num_hidden_layers"]),
        hidden_size=int(config["hidden_size"]), heads=heads,
        kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // heads), params=0.0,
    )  # fmt: skip
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    width = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}.get(dtype, 2)
    return shape.kv_bytes_per_token * width // DTYPE_BYTES


class VllmFleet:
    """`with VllmFleet(spec, venv, workdir) as fleet:` starts every engine at once and waits
    until all answer /health; any failure stops them all."""

    def __init__(self, spec: FleetSpec, venv: Path, workdir: Path) -> None:
        self.spec = spec
        self.engines = [
            VllmEngine(engine, venv, workdir, name=f"{role}-{i}")
            for i, (engine, role) in enumerate(
                zip(engine_specs(spec, available_cpus()), spec.roles, strict=True)
            )
        ]

    @property
    def urls(self) -> list[str]:
        return [engine.spec.url for engine in self.engines]

    def start(self, timeout_s: float = 300.0) -> None:
        try:
            for engine in self.engines:
                engine.start()
            with ThreadPoolExecutor(len(self.engines)) as pool:
                for waited in [pool.submit(e.wait_healthy, timeout_s) for e in self.engines]:
                    waited.result()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for engine in self.engines:
            engine.stop()

    def exited(self) -> list[str]:
        """The names of engines that are no longer running."""
        return [engine.name for engine in self.engines if not engine.alive()]

    def __enter__(self) -> VllmFleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
