"""The roofline of the priors (`policies.costmodel.priors`): each stage's uncorrected terms,
in its own module so that it compiles with the policy's hot path (`policies.native`: a module
defining a msgspec Struct, as `priors` does, cannot be)."""

from __future__ import annotations

from policies.costmodel.priors import (
    COMPUTE_EFFICIENCY,
    MEMORY_EFFICIENCY,
    STEP_OVERHEAD_MS,
    GpuPrior,
    ModelPrior,
)

# (overhead, linear, attention, memory, linear, attention, memory) in ms: a stage as two parts,
# each bound by the slower of its roofs (compute = linear + attention), so a short last chunk
# is not averaged into the full ones. Compute is two terms because the weights' matrix products
# and attention over the context reach different shares of peak: attention's share grows with
# a session's context, and one factor for both mispredicts a long session's turns.
Terms = tuple[float, float, float, float, float, float, float]


class RooflinePrior:
    """The uncorrected roofline terms of each stage, in ms."""

    __slots__ = (
        "_bytes_per_ms",
        "_flops_per_ms",
        "_flops_per_pair",
        "_flops_per_token",
        "_kv_bytes",
        "_weight_bytes",
        "overhead_ms",
    )

    def __init__(
        self,
        gpu: GpuPrior,
        model: ModelPrior,
        tp: int = 1,
        *,
        compute_efficiency: float = COMPUTE_EFFICIENCY,
        memory_efficiency: float = MEMORY_EFFICIENCY,
        overhead_ms: float = STEP_OVERHEAD_MS,
    ) -> None:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        self._flops_per_token = 2.0 * model.params
        self._flops_per_pair = 4.0 * model.layers * model.heads * model.head_dim
        self._weight_bytes = model.weight_bytes
        self._kv_bytes = float(model.kv_bytes_per_token)
        self._flops_per_ms = gpu.peak_flops * tp * compute_efficiency / 1000.0
        self._bytes_per_ms = gpu.mem_bandwidth * tp * memory_efficiency / 1000.0
        self.overhead_ms = overhead_ms

    def prefill_terms(
        self,
        uncached: int,
        cached: int,
        chunk_tokens: int | None = None,
        running: int = 0,
        context: float = 0.0,
    ) -> Terms:
        """The full chunks as one part, the last (possibly short) chunk as the other."""
        fpt, fpp, kv = self._flops_per_token, self._flops_per_pair, self._kv_bytes
        size = chunk_tokens if chunk_tokens is not None and chunk_tokens < uncached else uncached
        chunks = -(-uncached // size)
        full = chunks - 1
        last = uncached - full * size
        before = cached + full * size  # context ahead of the last chunk
        linear_last = fpt * last
        attention_last = fpp * last * (before + 0.5 * last)
        bytes_last = self._weight_bytes + kv * (before + last)
        linear_full = attention_full = bytes_full = 0.0
        if full:
            linear_full = full * size * fpt
            attention_full = full * size * fpp * (cached + 0.5 * size * full)
            bytes_full = full * (self._weight_bytes + kv * (cached + 0.5 * size * (full + 1)))
        if running > 0:
            # The decode step of the streams running beside, fused into every chunk's step.
            linear_step = running * fpt
            attention_step = running * fpp * context
            bytes_step = running * kv * (context + 1.0)
            linear_full += full * linear_step
            attention_full += full * attention_step
            bytes_full += full * bytes_step
            linear_last += linear_step
            attention_last += attention_step
            bytes_last += bytes_step
        per_flop, per_byte = self._flops_per_ms, self._bytes_per_ms
        return (
            chunks * self.overhead_ms,
            linear_full / per_flop,
            attention_full / per_flop,
            bytes_full / per_byte,
            linear_last / per_flop,
            attention_last / per_flop,
            bytes_last / per_byte,
        )

    def decode_terms(self, batch: int, context: float) -> Terms:
        linear = batch * self._flops_per_token
        attention = batch * self._flops_per_pair * context
        nbytes = self._weight_bytes + self._kv_bytes * batch * (context + 1.0)
        per_flop = self._flops_per_ms
        return (
            self.overhead_ms,
            0.0,
            0.0,
            0.0,
            linear / per_flop,
            attention / per_flop,
            nbytes / self._bytes_per_ms,
        )
