"""The simulated engine: continuous batching on a paged KV cache, timed by a roofline model."""
