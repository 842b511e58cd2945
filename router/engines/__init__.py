"""How each serving engine is spoken to: one module per engine (`vllm`, `sglang`) with its
handoff legs, what the router reads back, its priority order and its metric names;
`leg_body` for what every engine's legs share."""

from __future__ import annotations

from types import ModuleType

from router.engines import sglang, vllm

ENGINES: dict[str, ModuleType] = {"vllm": vllm, "sglang": sglang}
