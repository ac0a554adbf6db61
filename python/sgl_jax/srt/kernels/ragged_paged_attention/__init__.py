"""Ragged paged attention: one call for a mixed batch of extend and decode sequences over a paged KV cache.

`ragged_paged_attention` and `write_kv_to_pages` are the contract; `ref` is the pure-JAX implementation
used on CPU and as the reference for Pallas kernels.
"""

from sgl_jax.srt.kernels.ragged_paged_attention.ref import ragged_paged_attention, write_kv_to_pages

__all__ = ["ragged_paged_attention", "write_kv_to_pages"]
