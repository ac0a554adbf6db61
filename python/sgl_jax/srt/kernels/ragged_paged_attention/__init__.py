"""Ragged paged attention: one call for a mixed batch of extend and decode sequences over a paged KV cache.

`ragged_paged_attention` (with ``backend="native"|"pallas"``) and `write_kv_to_pages` are the contract;
`ref` is the pure-JAX implementation (the CPU path and the reference), `tpu` and `gpu` the Pallas kernels,
`backend` the choice between them.
"""

from sgl_jax.srt.kernels.ragged_paged_attention.backend import IMPLEMENTATIONS, ragged_paged_attention
from sgl_jax.srt.kernels.ragged_paged_attention.ref import write_kv_to_pages

__all__ = ["IMPLEMENTATIONS", "ragged_paged_attention", "write_kv_to_pages"]
