"""Decode attention, extend attention and the bfloat16 KV write for XLA's CPU backend: C++ kernels
(``csrc/paged_decode_cpu.cc``, ``csrc/paged_extend_cpu.cc``) called through JAX's FFI.

Extend attention (`extend_attention`): the pure-JAX extend path is ~2,000 HLO instructions of nested loops, once
per layer in a model's program (68% of an SmolLM2 extend program's named instructions); XLA's CPU backend took
~15 s to compile such a program and 6-7.5 s to load it from the persistent cache. The kernel is one custom call
per layer and runs register-tiled matmuls with an online softmax (reports/buckets-cpu-*.md).

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
EXTEND_TARGET = "sgl_jax_paged_extend_cpu"
FRESH_TARGET = "sgl_jax_fresh_buffer_cpu"
ENV_SWITCH = "SGL_JAX_CPU_DECODE_KERNEL"  # "0": use the pure-JAX decode path on CPU
EXTEND_ENV_SWITCH = "SGL_JAX_CPU_EXTEND_KERNEL"  # "0": use the pure-JAX extend path on CPU
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def library_path() -> Optional[Path]:
    """The built kernel library beside this module (``_paged_decode_cpu.ffi.*``, setup.py), or None if it was not
    built."""
    here = Path(__file__).resolve().parent
    found = sorted(here.glob("_paged_decode_cpu.ffi.*"))
    return found[0] if found else None


@functools.lru_cache(maxsize=None)
def _registered() -> frozenset:
    """The FFI targets this process registered from the kernel library, once (empty when it is not built or does
    not load: the callers then run pure JAX)."""
    path = library_path()
    if path is None:
        logger.info("CPU decode kernel not built (no _paged_decode_cpu.ffi.*); decode attention runs in pure JAX")
        return frozenset()
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.SglJaxPagedDecode), platform="cpu")
        jax.ffi.register_ffi_target(WRITE_TARGET, jax.ffi.pycapsule(lib.SglJaxPagedKVWrite), platform="cpu")
        jax.ffi.register_ffi_target(EXTEND_TARGET, jax.ffi.pycapsule(lib.SglJaxPagedExtend), platform="cpu")
        targets = {TARGET, WRITE_TARGET, EXTEND_TARGET}
        if hasattr(lib, "SglJaxFreshBuffer"):  # (a library built before it had one: the pool is zero-filled)
            jax.ffi.register_ffi_target(FRESH_TARGET, jax.ffi.pycapsule(lib.SglJaxFreshBuffer), platform="cpu")
            targets.add(FRESH_TARGET)
    except (OSError, AttributeError) as e:  # a library built for another platform or jaxlib
        logger.warning("CPU decode kernel %s did not load (%s); decode attention runs in pure JAX", path, e)
        return frozenset()
    return frozenset(targets)


def fresh_buffer_available() -> bool:
    """True when `fresh_buffer` can run: the kernel library is built with ``csrc/fresh_buffer_cpu.cc`` and loads."""
    return FRESH_TARGET in _registered()


def fresh_buffer(shape, dtype, zero: bool = True) -> jax.Array:
    """Inside a jitted function on a CPU device: a zeroed `shape` x `dtype` buffer whose whole pages are not written
    but given back to the kernel (``csrc/fresh_buffer_cpu.cc``: madvise MADV_DONTNEED, so they read as zero and are
    zero-filled on first touch; the partial pages at its ends are memset). `zero` False leaves the buffer as the
    allocator handed it out, old bytes and all (tests only). Requires `fresh_buffer_available`."""
    return jax.ffi.ffi_call(FRESH_TARGET, jax.ShapeDtypeStruct(tuple(shape), dtype))(zero=bool(zero))


def enabled() -> bool:
    """True when decode attention on CPU runs the C++ kernel: it is built and loads, and
    ``SGL_JAX_CPU_DECODE_KERNEL`` is not "0"."""
    return os.environ.get(ENV_SWITCH, "1") != "0" and bool(_registered())


def extend_enabled() -> bool:
    """True when extend (prefill and mixed) attention on CPU runs the C++ kernel (`extend_attention`): the library
    is built and loads, and neither ``SGL_JAX_CPU_EXTEND_KERNEL`` nor ``SGL_JAX_CPU_DECODE_KERNEL`` is "0"."""
    return os.environ.get(EXTEND_ENV_SWITCH, "1") != "0" and enabled()


def supports(q_dtype, kv_dtype) -> bool:
    """Whether the kernel takes these dtypes (float32 or bfloat16 queries and cache; others run `ref`)."""
    return jnp.dtype(q_dtype) in _DTYPES and jnp.dtype(kv_dtype) in _DTYPES


@functools.partial(jax.named_call, name="ragged_paged_attention")  # op_name, as ref's
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


@functools.partial(jax.named_call, name="ragged_paged_attention")  # op_name, as ref's
def extend_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, kv_lens: jax.Array,
                     page_indices: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array, *, sm_scale: float,
                     sliding_window: Optional[int] = None, soft_cap: Optional[float] = None,
                     prefix_lens: Optional[jax.Array] = None, segment_starts: Optional[jax.Array] = None,
                     tree_bits: Optional[jax.Array] = None) -> jax.Array:
    """Extend (prefill, mixed, speculative verify) attention by the C++ kernel (``csrc/paged_extend_cpu.cc``); the
    contract of `ref.ragged_paged_attention` without ``decode_only``.

    One custom call per layer instead of ref's ~2,000 HLO instructions of loops: a model's extend program
    shrinks to about a third, and so do its compile time and its load time from the persistent cache
    (reports/buckets-cpu-*.md). ``shared_prefix_len`` is not taken: it is a promise that lets ref reorder its
    work, and the kernel reads each sequence's keys through its own page row either way.

    Args:
        q: [T, num_heads, head_dim] float32 or bfloat16, the sequences' query tokens concatenated.
        k_pages, v_pages: [num_pages, page_size, num_kv_heads, head_dim] float32 or bfloat16 (one dtype).
        kv_lens: int32[S]; page_indices: int32[S, pages_per_seq]; cu_q_lens: int32[S + 1]; num_seqs: int32
            scalar or [1].
        sm_scale, sliding_window, soft_cap: as `ref.ragged_paged_attention` (None: off).
        prefix_lens: int32[S], segment_starts: int32[T] (multi-item scoring's segment mask; None: no segments);
        tree_bits: int32[T] draft-tree bits (common.tree_visible; None: no tree rows).
    Returns:
        [T, num_heads, head_dim] in q.dtype; rows of no sequence are zero. Softmax in float32.
    Raises:
        RuntimeError: the kernel is not available (check `extend_enabled()` first).
    """
    from sgl_jax.srt.kernels.ragged_paged_attention.common import MAX_TREE_SLOTS, NO_TREE

    if not _registered():
        raise RuntimeError("the CPU extend kernel is not built; use ref.ragged_paged_attention")
    T, S = q.shape[0], page_indices.shape[0]
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    prefix_lens = jnp.zeros((S,), jnp.int32) if prefix_lens is None else i32(prefix_lens)
    segment_starts = jnp.zeros((T,), jnp.int32) if segment_starts is None else i32(segment_starts)
    tree_bits = jnp.full((T,), NO_TREE, jnp.int32) if tree_bits is None else i32(tree_bits)
    call = jax.ffi.ffi_call(EXTEND_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, k_pages, v_pages, i32(kv_lens), i32(page_indices), i32(cu_q_lens), i32(num_seqs).reshape(()),
                prefix_lens, segment_starts, tree_bits, sm_scale=np.float32(sm_scale),
                sliding_window=np.int64(sliding_window or 0), soft_cap=np.float32(soft_cap or 0.0),
                max_tree_slots=np.int64(MAX_TREE_SLOTS))


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
