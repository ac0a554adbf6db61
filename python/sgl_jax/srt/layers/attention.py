"""Attention over the paged KV cache for one layer: write this step's K/V, then ragged paged attention."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from sgl_jax.srt.distributed.sharding import HEADS, KV_CACHE, RANK_ROWS
from sgl_jax.srt.kernels.ragged_paged_attention import ragged_paged_attention, write_kv_to_pages
from sgl_jax.srt.forward_batch import ForwardBatch, ForwardMode

LayerKV = Tuple[jax.Array, jax.Array]  # (k_pages, v_pages), each [num_pages, page_size, num_kv_heads, head_dim]


def attention_compute_dtype(model_dtype, kv_dtype, backend: str):
    """The dtype attention computes in: the model's, except that the native (pure-JAX; CPU, or forced with
    --attention-backend on TPU/GPU) backend computes in float32 when the KV cache is stored in float32 under a
    bfloat16 model (``--dtype bfloat16 --kv-cache-dtype float32``). XLA's CPU backend runs bfloat16 linear
    layers about twice as fast as float32 on CPUs with AVX512-BF16, but bfloat16 attention (its gathers,
    casts and softmax) slower than float32:
    2,000-token query, 500 x 20-token items, SmolLM2, /v1/score prefill_extend: 18.5 items/s with bfloat16
    weights and float32 attention, 12.8 all bfloat16, 15.2 all float32. The Pallas kernels keep the model's
    dtype. Output rows are cast back to the model's dtype."""
    if backend == "native" and jnp.dtype(kv_dtype) == jnp.float32:
        return jnp.dtype(jnp.float32)
    return jnp.dtype(model_dtype)


def _per_kv_head(x: jax.Array, scale: jax.Array) -> jax.Array:
    """x [T, H, D] (H = KVH * G query heads, or KVH) times scale [KVH] of each head's KV head, in float32."""
    t, h, d = x.shape
    kvh = scale.shape[0]
    return (x.astype(jnp.float32).reshape(t, kvh, h // kvh, d) * scale[None, :, None, None]).reshape(t, h, d)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def _write_and_attend(q, k, v, k_pages, v_pages, fb: ForwardBatch, kv_scales=None, *, sm_scale: float,
                      sliding_window: Optional[int], soft_cap: Optional[float]):
    """One device's part of `paged_attention`: write the step's K/V into the pages, then attend.

    With `kv_scales` (k_scale, v_scale: float32 [KVH]), the pages hold k / k_scale and v / v_scale per KV head,
    and the scales are put back outside the kernel: q times k_scale gives q . k (scores, soft cap and softmax
    unchanged), and the output times v_scale gives sum p v. Any attention backend serves scaled pages so.

    A jit of its own, nested in the model's step: every layer with the same shapes and settings reuses one
    trace and one lowering instead of tracing the attention once per layer (start-up tracing of a 30-layer
    model fell from ~2 s to ~0.5 s per bucket); XLA inlines the call, so the compiled step is unchanged."""
    out_dtype = q.dtype
    if kv_scales is not None:
        k_scale, v_scale = kv_scales
        k, v, q = _per_kv_head(k, 1.0 / k_scale), _per_kv_head(v, 1.0 / v_scale), _per_kv_head(q, k_scale)
    k_pages, v_pages = write_kv_to_pages(k_pages, v_pages, k, v, fb.out_cache_loc)
    q = q.astype(attention_compute_dtype(out_dtype, k_pages.dtype, fb.attention_backend))
    out = ragged_paged_attention(
        q, k_pages, v_pages, fb.kv_lens, fb.page_indices, fb.cu_q_lens, jnp.reshape(fb.num_seqs, ()),
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        decode_only=fb.forward_mode == ForwardMode.DECODE, prefix_lens=fb.prefix_lens,
        segment_starts=fb.segment_starts, shared_prefix_len=jnp.reshape(fb.shared_prefix_len, ()),
        tree_bits=fb.tree_bits, backend=fb.attention_backend,
    )
    if kv_scales is not None:
        out = _per_kv_head(out, kv_scales[1])
    return out.astype(out_dtype), k_pages, v_pages


def paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv: LayerKV,
    fb: ForwardBatch,
    *,
    sm_scale: float,
    sliding_window: Optional[int] = None,
    soft_cap: Optional[float] = None,
    mesh: Optional[Mesh] = None,
    kv_scales: Optional[Tuple[jax.Array, jax.Array]] = None,
) -> Tuple[jax.Array, LayerKV]:
    """One layer's attention for a batch.

    Args:
        q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (rotary already applied).
        kv: this layer's cache pages.
        fb: the step's ForwardBatch (slots to write, page table, lengths, and which attention backend runs). A
            sliding-window layer of a model with a separate SWA pool uses its SWA slots and page table.
        sliding_window: the layer's window (a query sees the last ``sliding_window`` positions), None: full.
        mesh: the device mesh. Heads are sharded over its ``tensor`` axis (the KV cache too, see
            distributed/sharding.py) and data-parallel ranks over its ``data`` axis: each device writes and
            attends over its own heads of its own rank's tokens, KV pages and metadata (``fb`` holds the ranks'
            arrays stacked, ``num_seqs`` and ``shared_prefix_len`` one value per rank) inside ``jax.shard_map``,
            so the kernel never sees a sharded array. None: no mesh (a plain single-device call).
        kv_scales: (k_scale, v_scale) float32 [num_kv_heads] of an fp8 KV cache (per head; a per-tensor scale
            repeated), from the checkpoint's ``self_attn.k_scale`` / ``v_scale`` (1 without them): the cache holds
            K / k_scale and V / v_scale (`_write_and_attend`). None: unscaled.
    Returns:
        ([T, num_heads, head_dim] attention output, updated kv).
    """

    if sliding_window is not None and fb.swa_page_indices is not None:  # this layer's KV is in the SWA pool
        fb = dataclasses.replace(fb, out_cache_loc=fb.swa_out_cache_loc, page_indices=fb.swa_page_indices)
    local = functools.partial(_write_and_attend, sm_scale=sm_scale, sliding_window=sliding_window,
                              soft_cap=soft_cap)

    if mesh is None:
        out, k_pages, v_pages = local(q, k, v, kv[0], kv[1], fb, kv_scales)
    else:
        specs, args = (HEADS, HEADS, HEADS, KV_CACHE, KV_CACHE, RANK_ROWS), (q, k, v, kv[0], kv[1], fb)
        if kv_scales is not None:  # each device's KV heads' scales
            specs, args = specs + ((P("tensor"), P("tensor")),), args + (kv_scales,)
        out, k_pages, v_pages = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(HEADS, KV_CACHE, KV_CACHE),
                                              check_vma=False)(*args)
    return out, (k_pages, v_pages)


def move_kv_slots(kv_caches: list, src: jax.Array, dst: jax.Array, mesh: Optional[Mesh] = None) -> list:
    """Copy every layer's K/V from slot ``src[i]`` to slot ``dst[i]`` (speculative decoding: a verify step wrote the
    draft tree's slots in slot order, and the accepted path's K/V moves to the positions it ends at).

    Args:
        kv_caches: per layer (k_pages, v_pages), [dp * pages, page_size, kv_heads, head_dim] each (donated by the
            caller's jit: updated in place).
        src, dst: int32[dp * M]: rank r's moves at rows [r * M, (r + 1) * M), slots local to its KV block (as
            ``out_cache_loc``); padding moves are 0 -> 0 (the padding page). Every source is read before any
            destination is written, so a move chain may overlap.
        mesh: the device mesh (ranks over ``data``, heads over ``tensor``); None: one device.
    Returns:
        The updated caches.
    """
    def local(kv, src, dst):
        out = []
        for k_pages, v_pages in kv:
            ps = k_pages.shape[1]
            k, v = k_pages[src // ps, src % ps], v_pages[src // ps, src % ps]
            out.append(write_kv_to_pages(k_pages, v_pages, k, v, dst))
        return out

    if mesh is None:
        return local(kv_caches, src, dst)
    specs = [(KV_CACHE, KV_CACHE)] * len(kv_caches)
    return jax.shard_map(local, mesh=mesh, in_specs=(specs, RANK_ROWS, RANK_ROWS), out_specs=specs,
                         check_vma=False)(kv_caches, src, dst)
