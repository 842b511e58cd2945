"""The simulated fabric: NICs and links shared max-min fairly, and NIXL-style KV pulls."""
