"""Decode attention and the bfloat16 KV write for XLA's CPU backend: C++ kernels (``csrc/paged_decode_cpu.cc``)
called through JAX's FFI.

The KV write (`write_kv`): XLA's CPU backend runs a bfloat16 scatter in float32, converting the whole cache to
float32 and back, so a step's write of T rows cost O(pool) (a decode step of a 2-layer model: 2.06 ms at an
8,192-token pool, 246 ms at 2,097,152); the kernel copies the T rows into the donated pages in place.

The native backend's decode path on CPU. It reads each sequence's K/V rows in place from the paged cache,
once, while the pure-JAX path (`ref`) first gathers them into a fresh buffer: on CPU that copy is the cost
(one layer of SmolLM2 at 64 sequences x 1,500 tokens of context: ~11-18 ms against ~30-50 ms, with ~4.5 ms
to read the bytes; `benchmark/kernels/bench_ragged_paged_attention.py`, backends native and jax).

The kernel is built at install (setuptools, `setup.py`, an optional extension: an install without a C++
compiler still works) into ``_paged_decode_cpu.ffi.<EXT_SUFFIX>`` beside this file, loaded with ctypes and
registered with ``jax.ffi.register_ffi_target`` on first use. Where it is missing, or the environment sets
``SGL_JAX_CPU_DECODE_KERNEL=0``, or the dtypes are not float32/bfloat16, `ref` runs instead: it stays the
fallback and the reference the kernel is tested against (test/srt/test_cpu_decode_kernel.py).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

TARGET = "sgl_jax_paged_decode_cpu"
WRITE_TARGET = "sgl_jax_paged_kv_write_cpu"
ENV_SWITCH = "SGL_JAX_CPU_DECODE_KERNEL"  # "0": use the pure-JAX decode path on CPU
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def library_path() -> Optional[Path]:
    """The built kernel library beside this module (``_paged_decode_cpu.ffi.*``, setup.py), or None if it was not
    built."""
    here = Path(__file__).resolve().parent
    found = sorted(here.glob("_paged_decode_cpu.ffi.*"))
    return found[0] if found else None


@functools.lru_cache(maxsize=None)
def _registered() -> bool:
    path = library_path()
    if path is None:
        logger.info("CPU decode kernel not built (no _paged_decode_cpu.ffi.*); decode attention runs in pure JAX")
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.SglJaxPagedDecode), platform="cpu")
        jax.ffi.register_ffi_target(WRITE_TARGET, jax.ffi.pycapsule(lib.SglJaxPagedKVWrite), platform="cpu")
    except (OSError, AttributeError) as e:  # a library built for another platform or jaxlib
        logger.warning("CPU decode kernel %s did not load (%s); decode attention runs in pure JAX", path, e)
        return False
    return True


def enabled() -> bool:
    """True when decode attention on CPU runs the C++ kernel: it is built and loads, and
    ``SGL_JAX_CPU_DECODE_KERNEL`` is not "0"."""
    return os.environ.get(ENV_SWITCH, "1") != "0" and _registered()


def supports(q_dtype, kv_dtype) -> bool:
    """Whether the kernel takes these dtypes (float32 or bfloat16 queries and cache; others run `ref`)."""
    return jnp.dtype(q_dtype) in _DTYPES and jnp.dtype(kv_dtype) in _DTYPES


def decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, kv_lens: jax.Array,
                     page_indices: jax.Array, num_seqs: jax.Array, *, sm_scale: float,
                     sliding_window: Optional[int] = None, soft_cap: Optional[float] = None) -> jax.Array:
    """Decode attention by the C++ kernel; the contract of `ref.ragged_paged_attention` with
    ``decode_only=True``.

    Args:
        q: [T, num_heads, head_dim] float32 or bfloat16; row s is sequence s's one query token.
        k_pages, v_pages: [num_pages, page_size, num_kv_heads, head_dim] float32 or bfloat16 (one dtype).
        kv_lens: int32[S] keys per sequence (this step's token included); page_indices: int32[S, pages_per_seq].
        num_seqs: int32 scalar, sequences in use.
        sm_scale, sliding_window, soft_cap: as `ref.ragged_paged_attention` (None: off).
    Returns:
        [T, num_heads, head_dim] in q.dtype; rows at and past min(num_seqs, T) are zero. Softmax in float32.
    Raises:
        RuntimeError: the kernel is not available (check `enabled()` first).
    """
    if not _registered():
        raise RuntimeError("the CPU decode kernel is not built; use ref.ragged_paged_attention")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, k_pages, v_pages, kv_lens.astype(jnp.int32), page_indices.astype(jnp.int32),
                jnp.asarray(num_seqs, jnp.int32).reshape(()), sm_scale=np.float32(sm_scale),
                sliding_window=np.int64(sliding_window or 0), soft_cap=np.float32(soft_cap or 0.0))


def writes_kv(kv_dtype) -> bool:
    """Whether `write_kv` takes the KV write of a cache of `kv_dtype`: bfloat16 pages (XLA's CPU backend runs a
    bfloat16 scatter in float32 over the whole cache; float32 and fp8 scatters stay in place there) with the
    kernel enabled."""
    return jnp.dtype(kv_dtype) == jnp.dtype(jnp.bfloat16) and enabled()


def write_kv(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array,
             loc: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`ref.write_kv_to_pages` by the C++ kernel: each token's K/V row copied into its slot, the pages aliased from
    argument to result, so a donated cache is updated in place (XLA's bfloat16 scatter on CPU converted the whole
    cache to float32 and back every step: ~250 ms a step at a 2M-token pool of a 2-layer model).

    Args:
        k_pages, v_pages: [num_pages, page_size, num_kv_heads, head_dim] one layer's cache (bfloat16).
        k, v: [T, num_kv_heads, head_dim] new rows in the pages' dtype; loc: int32[T] flat slots (page *
            page_size + offset); a slot outside the pages writes nothing, as the scatter's mode="drop".
    Returns:
        The updated (k_pages, v_pages).
    Raises:
        RuntimeError: the kernel is not available (check `writes_kv` first).
    """
    if not _registered():
        raise RuntimeError("the CPU KV write kernel is not built; use ref.write_kv_to_pages")
    call = jax.ffi.ffi_call(WRITE_TARGET, (jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                                           jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)),
                            input_output_aliases={0: 0, 1: 1})
    return call(k_pages, v_pages, k.astype(k_pages.dtype), v.astype(v_pages.dtype), loc.astype(jnp.int32))


def tree_attention_as_decode(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, kv_lens: jax.Array,
                             page_indices: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array, tree_bits: jax.Array,
                             *, sm_scale: float, sliding_window: Optional[int] = None,
                             soft_cap: Optional[float] = None) -> jax.Array:
    """A speculative verify step's attention (queries that are draft-tree slots, `ref.ragged_paged_attention`'s
    ``tree_bits``) by the decode kernel, at page size 1: every query token runs as a sequence of its own, whose keys
    are its sequence's keys before the tree followed by its ancestors and itself (bit k of its tree bits: the slot
    written at position ``base + k``, base = the sequence's keys before its queries), in depth order -- a page table
    of its own, which page size 1 lets any slot fill. A query without tree bits (``NO_TREE``) sees the causal
    prefix. The key positions the kernel sees are the slots' depths, so a sliding window is measured on the draft's
    real positions. Multi-item segment masks do not apply (a verify step has none).

    Args:
        q: [T, H, D]; k_pages, v_pages: [pages, 1, KVH, D]; kv_lens int32[S]; page_indices int32[S, P]; cu_q_lens
            int32[S + 1]; num_seqs int32 (scalar or [1]); tree_bits int32[T].
    Returns:
        [T, H, D] in q.dtype; padding rows (past cu_q_lens[num_seqs]) are zero.
    Raises:
        ValueError: a page size other than 1.
    """
    from sgl_jax.srt.kernels.ragged_paged_attention.common import MAX_TREE_SLOTS, NO_TREE

    if k_pages.shape[1] != 1:
        raise ValueError("tree_attention_as_decode needs page size 1")
    T, S, P = q.shape[0], kv_lens.shape[0], page_indices.shape[1]
    n = jnp.asarray(num_seqs, jnp.int32).reshape(())
    t = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens[1:], t, side="right"), 0, S - 1).astype(jnp.int32)
    real = t < cu_q_lens[n]
    j = t - cu_q_lens[seq]
    base = kv_lens[seq] - (cu_q_lens[seq + 1] - cu_q_lens[seq])
    bits = tree_bits.astype(jnp.int32)
    k = jnp.arange(MAX_TREE_SLOTS, dtype=jnp.int32)
    has = (jnp.right_shift(bits[:, None], k[None, :]) & 1) == 1  # [T, slots]
    count = jnp.sum(has, axis=1).astype(jnp.int32)
    rank = jnp.cumsum(has, axis=1) - 1  # the depth of each ancestor slot
    # anc[t, d] = the slot of query t's ancestor at depth d (d < count[t])
    anc = jnp.zeros((T, MAX_TREE_SLOTS), jnp.int32).at[t[:, None], jnp.where(has, rank, MAX_TREE_SLOTS)].set(
        jnp.broadcast_to(k, (T, MAX_TREE_SLOTS)), mode="drop")
    rows = page_indices[seq]  # [T, P]
    src = jnp.clip(base[:, None] + anc, 0, P - 1)
    dst = jnp.where(k[None, :] < count[:, None], base[:, None] + k[None, :], P)  # past the table: dropped
    rows = rows.at[t[:, None], dst].set(jnp.take_along_axis(rows, src, axis=1), mode="drop")
    lens = jnp.where(bits == NO_TREE, base + j + 1, base + count)
    lens = jnp.where(real, lens, 0).astype(jnp.int32)
    return decode_attention(q, k_pages, v_pages, lens, rows, cu_q_lens[n], sm_scale=sm_scale,
                            sliding_window=sliding_window, soft_cap=soft_cap)
