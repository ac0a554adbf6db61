"""Flash-decoding as a Pallas kernel for GPU (Triton lowering): the decode batches of `gpu.ragged_paged_attention_gpu`.

Grid: (sequence, KV head, context split); see `flash_decode` for the decomposition and the layouts. A program loads
its R query rows (the GQA group's heads, zero-padded to 16: Triton's dot needs 16 rows) once, then walks its split's
KV blocks: ``block_kv`` K and V rows of its KV head gathered straight from the paged cache through the page table
(slot = page * page_size + offset, so every page size works), one [R, D] x [D, block_kv] dot for the scores and one
[R, block_kv] x [block_kv, D] dot for P @ V, the online softmax in float32. Blocks outside the split, the sequence's
length or the sliding window are never loaded. The partial states are merged by `flash_decode.combine` in XLA.

The grid (query blocks of 16 rows) x (KV heads) of the ragged kernel gave 32 programs for 64 decode sequences of
Qwen3-0.6B on 132 SMs, and each program walked 16 sequences one after the other: it ran slower than XLA's attention
(reports/ragged-paged-attention-h100-2026-11-25.md). Here 64 sequences x 8 KV heads x 2 splits of 1,024 tokens give
1,024 programs.

On CPU the same kernel runs with ``interpret=True``.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sgl_jax.srt.kernels.ragged_paged_attention.common import (
    MASK_VALUE, device_generation, qk_scores, softmax_update, widen,
)
from sgl_jax.srt.kernels.ragged_paged_attention.flash_decode import (
    DecodeBlocks, combine, decode_queries, live_kv_lens, num_splits, query_rows,
)

# Tile sizes per device generation and KV dtype width (bytes); "default" for unknown devices and the interpreter.
GPU_DECODE_TABLE = {
    "h100": {2: DecodeBlocks(64, 1024), 4: DecodeBlocks(32, 1024)},
    "default": {2: DecodeBlocks(32, 512), 4: DecodeBlocks(32, 512)},
}
MIN_ROWS = 16  # Triton's tl.dot needs at least 16 rows


def decode_blocks(generation: str, kv_dtype, override: Optional[DecodeBlocks] = None) -> DecodeBlocks:
    """The tile sizes of a decode launch: `override` if given, else GPU_DECODE_TABLE's entry for the device generation
    (`common.device_generation`) and the KV dtype's width."""
    if override is not None:
        return override
    entry = GPU_DECODE_TABLE.get(generation, GPU_DECODE_TABLE["default"])
    return entry[min(4, max(2, jnp.dtype(kv_dtype).itemsize))]


def _kernel(kv_lens_ref, pt_ref, q_ref, k_ref, v_ref, m_ref, l_ref, acc_ref, *, block_kv, split_tokens, splits,
            page_size, pages_per_seq, num_slots, num_kv_heads, rows, head_dim, sliding_window, soft_cap):
    s, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    prog = (s * num_kv_heads + h) * splits + j
    kv_len = kv_lens_ref[s]
    start = j * split_tokens
    end = jnp.minimum(kv_len, start + split_tokens)
    lo = start if sliding_window is None else jnp.maximum(start, kv_len - sliding_window)
    kb0 = jax.lax.div(lo, jnp.int32(block_kv))
    kb1 = jnp.where(end > lo, jax.lax.div(end + block_kv - 1, jnp.int32(block_kv)), kb0)
    q = q_ref[pl.ds((s * num_kv_heads + h) * rows, rows), :]
    cols = pl.ds(h * head_dim, head_dim)
    koff = jax.lax.broadcasted_iota(jnp.int32, (block_kv,), 0)

    def body(kb, state):
        kpos = kb * block_kv + koff
        col = jnp.minimum(jax.lax.div(kpos, jnp.int32(page_size)), pages_per_seq - 1)
        page = pt_ref[s * pages_per_seq + col]
        slot = jnp.clip(page * page_size + jax.lax.rem(kpos, jnp.int32(page_size)), 0, num_slots - 1)
        k = widen(k_ref[slot, cols], q.dtype)
        v = widen(v_ref[slot, cols], q.dtype)
        mask = jnp.broadcast_to(((kpos >= lo) & (kpos < end))[None, :], (rows, block_kv))
        return softmax_update(*state, qk_scores(q, k), mask, v, soft_cap)

    init = (jnp.full((rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))
    m, l, acc = jax.lax.fori_loop(kb0, kb1, body, init)
    out = pl.ds(prog * rows, rows)
    m_ref[out, :] = m
    l_ref[out, :] = l
    acc_ref[out, :] = acc


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "blocks", "interpret"))
def decode_attention_gpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: Optional[int] = None,
    soft_cap: Optional[float] = None,
    blocks: Optional[DecodeBlocks] = None,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention by the flash-decoding Pallas GPU kernel; the contract of `ref.ragged_paged_attention` with
    ``decode_only=True``.

    Args:
        q: [T, H, D] bfloat16, float16 or float32, row s is sequence s's query token; D a power of two (64, 128,
            256).
        k_pages, v_pages: [num_pages, page_size, KVH, D]; kv_lens: int32[S] keys per sequence (this step's
            included); page_indices: int32[S, pages_per_seq]; num_seqs: int32 scalar, sequences in use.
        sm_scale, sliding_window, soft_cap: as the reference (None: off).
        blocks: tile sizes instead of GPU_DECODE_TABLE's; interpret: run in Pallas' interpreter (CPU).
    Returns:
        [T, H, D] in q.dtype; rows at and past min(num_seqs, T) zero. Scores and softmax in float32 (float32 dots in
        IEEE float32, see `common.qk_scores`).
    Raises:
        ValueError: H is not a multiple of KVH.
    """
    T, H, D = q.shape
    num_pages, page_size, KVH, _ = k_pages.shape
    S, P = page_indices.shape
    if H % KVH:
        raise ValueError(f"num_heads {H} is not a multiple of num_kv_heads {KVH}")
    bs = decode_blocks("default" if interpret else device_generation(), k_pages.dtype, blocks)
    rows = query_rows(H // KVH, MIN_ROWS)
    splits = num_splits(P, page_size, bs.split_tokens)
    n = S * KVH * splits
    kernel = functools.partial(
        _kernel, block_kv=bs.block_kv, split_tokens=bs.split_tokens, splits=splits, page_size=page_size,
        pages_per_seq=P, num_slots=num_pages * page_size, num_kv_heads=KVH, rows=rows, head_dim=D,
        sliding_window=sliding_window, soft_cap=soft_cap)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    m, l, acc = pl.pallas_call(
        kernel,
        grid=(S, KVH, splits),
        in_specs=[any_spec] * 5,
        out_specs=[any_spec] * 3,
        out_shape=[jax.ShapeDtypeStruct((n * rows, 1), jnp.float32), jax.ShapeDtypeStruct((n * rows, 1), jnp.float32),
                   jax.ShapeDtypeStruct((n * rows, D), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="flash_decode_gpu",
    )(live_kv_lens(kv_lens, num_seqs), page_indices.astype(jnp.int32).reshape(-1),
      decode_queries(q, S, KVH, rows, sm_scale), k_pages.reshape(num_pages * page_size, KVH * D),
      v_pages.reshape(num_pages * page_size, KVH * D))
    return combine(m, l, acc, q, num_seqs, S, KVH, splits)
