"""Pallas GPU kernels (Triton backend); each op has a pure-jnp reference in `jmixedkv` (import modules directly)."""
