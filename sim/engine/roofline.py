"""Roofline cost model: how long one engine step takes on a deployment."""

from __future__ import annotations

import random
from collections.abc import Sequence
from math import cos, exp, log, pi, sin, sqrt

import msgspec

from sim.engine.presets import Deployment


def attainable_flops(peak_flops: float, bandwidth: float, intensity: float) -> float:
    """The roofline: min(peak, arithmetic intensity (FLOP/byte) x memory bandwidth)."""
    return min(peak_flops, intensity * bandwidth)


class Efficiency(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Fractions of peak FLOP/s and of peak memory bandwidth that kernels actually reach."""

    compute: float = 0.6
    memory: float = 0.85


DEFAULT_EFFICIENCY = Efficiency()


class _Noise(random.Random):
    """The step-time noise source: `gauss` draws one at a time, `factors` many at once."""

    gauss_next: float | None  # random.Random's spare deviate: its gauss makes them in pairs

    def factors(self, count: int, sigma: float) -> list[float]:
        """`exp(self.gauss(0.0, sigma))` `count` times: Random.gauss's arithmetic inlined, so
        the draws and the generator's state after them are the same."""
        out: list[float] = []
        append = out.append
        spare = self.gauss_next
        if spare is not None and count > 0:
            self.gauss_next = None
            append(exp(spare * sigma))
            count -= 1
        uniform = self.random
        two_pi = 2.0 * pi
        while count > 0:
            x2pi = uniform() * two_pi
            g2rad = sqrt(-2.0 * log(1.0 - uniform()))
            append(exp(cos(x2pi) * g2rad * sigma))
            if count == 1:
                self.gauss_next = sin(x2pi) * g2rad
                break
            append(exp(sin(x2pi) * g2rad * sigma))
            count -= 2
        return out


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
        self._rng = _Noise(seed)
        self._gauss = self._rng.gauss
        # Noise factors drawn ahead and handed back unused (`noise_factors`, `unread`), the
        # next one last: they are the next steps' draws, so they are used before new ones.
        self._unread: list[float] = []
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
            t *= self._unread.pop() if self._unread else exp(self._gauss(0.0, self.noise_sigma))
        return t

    def noise_factors(self, count: int) -> list[float]:
        """The noise factors of the next `count` steps, in order, as `sample_step_time` would
        apply them (1.0 without noise); `unread` hands back those not used after all."""
        if self.noise_sigma <= 0.0:
            return [1.0] * count
        unread = self._unread
        taken = min(count, len(unread))
        out = unread[len(unread) - taken :]
        out.reverse()
        del unread[len(unread) - taken :]
        if taken < count:
            out += self._rng.factors(count - taken, self.noise_sigma)
        return out

    def unread(self, factors: list[float]) -> None:
        """Hand back the tail of `noise_factors`' answer: the next steps use them first."""
        if self.noise_sigma > 0.0:
            self._unread += reversed(factors)

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

    def decode_step_ends(
        self, size: int, context: int, start: float, factors: list[float]
    ) -> list[float]:
        """When consecutive pure decode steps end, the first beginning at `start`: step k (from
        0) decodes `size` requests whose contexts sum to `context + k * size`, with noise factor
        `factors[k]` (from `noise_factors`), as many steps as factors.

        The arithmetic is `time_from_totals`' for such a step, operation for operation, so the
        times are the ones `sample_step_time` gives step by step.
        """
        token_flops = self._flops_per_token * size
        pair_flops, flop_rate = self._attn_flops_per_pair, self._flop_rate
        weight_bytes, kv_bytes, byte_rate = self._weight_bytes, self._kv_bytes, self._byte_rate
        overhead, ar_fixed = self.step_overhead_s, self._ar_fixed_s
        ar_tokens = self._ar_per_token_s * size
        ends: list[float] = []
        append = ends.append
        end = start
        last = context + (len(factors) - 1) * size
        if all(
            (weight_bytes + kv_bytes * (c + size)) / byte_rate
            > (token_flops + pair_flops * c) / flop_rate * (1.0 + 1e-9)
            for c in (context, last)
        ):
            # Memory-bound at both ends by far more than rounding, so at every step between
            # (both times are linear in the context): the compute time never wins.
            for factor in factors:
                memory_s = (weight_bytes + kv_bytes * (context + size)) / byte_rate
                end += (overhead + memory_s + ar_fixed + ar_tokens) * factor
                append(end)
                context += size
            return ends
        for factor in factors:
            compute_s = (token_flops + pair_flops * context) / flop_rate
            memory_s = (weight_bytes + kv_bytes * (context + size)) / byte_rate
            t = overhead + (compute_s if compute_s > memory_s else memory_s) + ar_fixed + ar_tokens
            end += t * factor
            append(end)
            context += size
        return ends

    def predict_prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Noise-free time of a step holding only this prefill, unchunked."""
        pairs = new_tokens * (cached_tokens + new_tokens * 0.5)
        return self.time_from_totals(0, 0, new_tokens, cached_tokens, pairs)

    def predict_decode_step_s(self, batch: int, mean_context: float) -> float:
        """Noise-free time of a pure decode step of `batch` requests of `mean_context` tokens."""
        return self.time_from_totals(batch, batch * mean_context, 0, 0, 0.0)
