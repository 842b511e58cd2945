"""Roofline cost model: how long one engine step takes on a deployment."""

from __future__ import annotations

import random
from collections.abc import Sequence
from math import exp

import msgspec

from sim.presets import Deployment


def attainable_flops(peak_flops: float, bandwidth: float, intensity: float) -> float:
    """The roofline: min(peak, arithmetic intensity (FLOP/byte) x memory bandwidth)."""
    return min(peak_flops, intensity * bandwidth)


class Efficiency(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Fractions of peak FLOP/s and of peak memory bandwidth that kernels actually reach."""

    compute: float = 0.6
    memory: float = 0.85


DEFAULT_EFFICIENCY = Efficiency()


class CostModel:
    """Step time = overhead + max(compute time, memory time) [+ TP all-reduce], times noise.

    Tensor parallelism splits FLOPs and bytes evenly over `tp` GPUs and adds two ring
    all-reduces per layer (after attention and after the MLP), each costing the interconnect
    latency plus 2 (tp - 1) / tp x tokens x hidden x dtype bytes over the interconnect
    bandwidth. They are not overlapped with compute, as in vLLM's default execution.
    """

    def __init__(
        self,
        deployment: Deployment,
        efficiency: Efficiency = DEFAULT_EFFICIENCY,
        step_overhead_s: float = 0.0015,
        noise_sigma: float = 0.0,
        seed: int = 0,
    ) -> None:
        if noise_sigma < 0:
            raise ValueError(f"noise_sigma must be >= 0, got {noise_sigma}")
        eff = efficiency
        self.deployment = deployment
        self.efficiency = eff
        self.step_overhead_s = step_overhead_s
        self.noise_sigma = noise_sigma
        self._rng = random.Random(seed)
        self._gauss = self._rng.gauss
        m, g, tp = deployment.model, deployment.gpu, deployment.tp
        # Precomputed per-unit costs keep step_time to a few multiplications.
        self._flops_per_token = 2.0 * m.params
        self._attn_flops_per_pair = 4.0 * m.layers * m.heads * m.head_dim
        self._kv_bytes = float(deployment.kv_bytes_per_token)
        self._weight_bytes = deployment.weight_bytes
        self._flop_rate = g.peak_flops * tp * eff.compute
        self._byte_rate = g.mem_bandwidth * tp * eff.memory
        if tp > 1:
            per_token = 2.0 * (tp - 1) / tp * m.hidden_size * deployment.dtype_bytes
            self._ar_fixed_s = 2 * m.layers * g.interconnect_latency_s
            self._ar_per_token_s = 2 * m.layers * per_token / g.interconnect_bandwidth
        else:
            self._ar_fixed_s = 0.0
            self._ar_per_token_s = 0.0

    def step_time(
        self, decode_contexts: Sequence[int], prefill_chunks: Sequence[tuple[int, int]]
    ) -> float:
        """Duration of one step: one decode token per context, plus (new, context_before) chunks."""
        prefill_tokens = 0
        prefill_context = 0
        pairs = 0.0
        for new, before in prefill_chunks:
            prefill_tokens += new
            prefill_context += before
            pairs += new * (before + new * 0.5)
        return self.sample_step_time(
            len(decode_contexts), sum(decode_contexts), prefill_tokens, prefill_context, pairs
        )

    def sample_step_time(
        self,
        decode_tokens: int,
        decode_context_sum: int,
        prefill_tokens: int,
        prefill_context_sum: int,
        prefill_attention_pairs: float,
    ) -> float:
        """`step_time` from batch totals (as `time_from_totals` takes them), noise included.

        Every call draws the next noise sample, so a caller must make one call per step.
        """
        t = self.time_from_totals(
            decode_tokens, decode_context_sum, prefill_tokens, prefill_context_sum,
            prefill_attention_pairs,
        )  # fmt: skip
        if self.noise_sigma > 0.0:
            t *= exp(self._gauss(0.0, self.noise_sigma))
        return t

    def time_from_totals(
        self,
        decode_tokens: int,
        decode_context_sum: float,
        prefill_tokens: int,
        prefill_context_sum: float,
        prefill_attention_pairs: float,
    ) -> float:
        """Noise-free step time from batch totals.

        `prefill_attention_pairs` is the sum over chunks of new x (context_before + new / 2).
        """
        tokens = decode_tokens + prefill_tokens
        if tokens == 0:
            return 0.0
        flops = self._flops_per_token * tokens + self._attn_flops_per_pair * (
            decode_context_sum + prefill_attention_pairs
        )
        nbytes = self._weight_bytes + self._kv_bytes * (
            decode_context_sum + prefill_context_sum + tokens
        )
        compute_s = flops / self._flop_rate
        memory_s = nbytes / self._byte_rate
        return (
            self.step_overhead_s
            + (compute_s if compute_s > memory_s else memory_s)
            + self._ar_fixed_s
            + self._ar_per_token_s * tokens
        )

    def predict_prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Noise-free time of a step holding only this prefill, unchunked."""
        pairs = new_tokens * (cached_tokens + new_tokens * 0.5)
        return self.time_from_totals(0, 0, new_tokens, cached_tokens, pairs)

    def predict_decode_step_s(self, batch: int, mean_context: float) -> float:
        """Noise-free time of a pure decode step of `batch` requests of `mean_context` tokens."""
        return self.time_from_totals(batch, batch * mean_context, 0, 0, 0.0)
