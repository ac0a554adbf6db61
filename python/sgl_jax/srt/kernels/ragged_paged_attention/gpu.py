"""Ragged paged attention as a Pallas kernel for GPU (Triton lowering).

Grid: (query block, KV head). A program owns ``block_q`` aligned rows of the flat query axis for the
query heads of one KV head (see `common`); it walks the sequences with rows in its block and, for each,
only the KV blocks it must see (causal bound, sliding window, segment mask). K/V rows are gathered
straight from the paged cache through the page table (slot = page * page_size + offset), so any page size
works, including 1. Scores and the online softmax run in float32; the query heads of a GQA group share
each K/V block load.

Decode batches (``decode_only``) go to the flash-decoding kernel of `gpu_decode` instead, whose grid is (sequence,
KV head, context split).

On CPU the same kernels run with ``interpret=True``.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sgl_jax.srt.kernels.ragged_paged_attention.common import (
    GPU_BLOCK_TABLE, MASK_VALUE, BlockSizes, block_mask, block_sizes, device_generation, finish, prepare_launch,
    qk_scores, seq_plan, softmax_update, widen,
)
from sgl_jax.srt.kernels.ragged_paged_attention.flash_decode import DecodeBlocks
from sgl_jax.srt.kernels.ragged_paged_attention.gpu_decode import decode_attention_gpu

# Query rows (block_q x the GQA group) a program may hold, by operand width in bytes: Triton keeps the group's query
# tiles, scores and accumulators on chip, and the table's (64, 64) tiles at group 8 in float32 asked for 344,320
# bytes of shared memory where an H200 has 232,448 (reports/h200-2026-11-26-c/tests.log).
MAX_GROUP_ROWS = {2: 256, 4: 128}
MAX_BLOCK_KV_FLOAT32 = 32


def fit_blocks(bs: BlockSizes, group: int, itemsize: int) -> BlockSizes:
    """The table's tile sizes shrunk so a program's on-chip state fits: block_q (a power of two >= 16) at most
    MAX_GROUP_ROWS / group rows, block_kv at most MAX_BLOCK_KV_FLOAT32 for float32 operands."""
    limit = max(16, MAX_GROUP_ROWS[min(4, max(2, itemsize))] // group)
    block_q = max(16, min(bs.block_q, 1 << (limit.bit_length() - 1)))
    block_kv = bs.block_kv if itemsize <= 2 else min(bs.block_kv, MAX_BLOCK_KV_FLOAT32)
    return BlockSizes(block_q, block_kv)


def _kernel(cu_ref, kv_lens_ref, pt_ref, prefix_ref, first_ref, last_ref, seg_lo_ref, q_ref, seg_ref, tree_ref,
            k_ref, v_ref, o_ref, *, has_tree, sm_scale, sliding_window, soft_cap, block_q, block_kv, page_size,
            pages_per_seq, num_slots, group, head_dim):
    b = pl.program_id(0)
    h = pl.program_id(1)
    block_start = b * block_q
    first, last, seg_lo = first_ref[b], last_ref[b], seg_lo_ref[b]
    rows = block_start + jax.lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
    seg = seg_ref[pl.ds(block_start, block_q), :]
    tree = tree_ref[pl.ds(block_start, block_q), :] if has_tree else None
    cols = pl.ds(h * head_dim, head_dim)
    qs = [(q_ref[pl.ds(block_start, block_q), pl.ds((h * group + g) * head_dim, head_dim)].astype(jnp.float32)
           * sm_scale).astype(q_ref.dtype) for g in range(group)]
    koff = jax.lax.broadcasted_iota(jnp.int32, (block_kv,), 0)

    def seq_body(s, state):
        plan = seq_plan(cu_ref[s], cu_ref[s + 1], kv_lens_ref[s], prefix_ref[s], block_start, block_q, seg_lo,
                        block_kv, sliding_window)

        def kv_body(i, state):
            kb = plan.kv_block(i)
            kpos = kb * block_kv + koff
            col = jnp.minimum(jax.lax.div(kpos, jnp.int32(page_size)), pages_per_seq - 1)
            page = pt_ref[s * pages_per_seq + col]
            slot = jnp.clip(page * page_size + jax.lax.rem(kpos, jnp.int32(page_size)), 0, num_slots - 1)
            k = widen(k_ref[slot, cols], q_ref.dtype)
            v = widen(v_ref[slot, cols], q_ref.dtype)
            mask = block_mask(plan, rows, seg, kpos[None, :], sliding_window, tree)
            out = []
            for g in range(group):
                m, l, acc = state[g]
                out.append(softmax_update(m, l, acc, qk_scores(qs[g], k), mask, v, soft_cap))
            return tuple(out)

        return jax.lax.fori_loop(0, plan.n, kv_body, state)

    init = tuple((jnp.full((block_q, 1), MASK_VALUE, jnp.float32), jnp.zeros((block_q, 1), jnp.float32),
                  jnp.zeros((block_q, head_dim), jnp.float32)) for _ in range(group))
    state = jax.lax.fori_loop(first, last + 1, seq_body, init)
    for g in range(group):
        _, l, acc = state[g]
        o_ref[pl.ds(block_start, block_q), pl.ds((h * group + g) * head_dim, head_dim)] = (
            finish(l, acc).astype(o_ref.dtype))


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "decode_only",
                                             "blocks", "decode_blocks", "interpret"))
def ragged_paged_attention_gpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: Optional[int] = None,
    soft_cap: Optional[float] = None,
    decode_only: bool = False,
    prefix_lens: Optional[jax.Array] = None,
    segment_starts: Optional[jax.Array] = None,
    tree_bits: Optional[jax.Array] = None,
    blocks: Optional[BlockSizes] = None,
    decode_blocks: Optional[DecodeBlocks] = None,
    interpret: bool = False,
) -> jax.Array:
    """Pallas GPU (Triton) ragged paged attention with the contract of `ref.ragged_paged_attention`.

    Shapes and dtypes as there: q [T, H, D] with D a power of two (64, 128); k_pages, v_pages
    [num_pages, page_size, KVH, D] (bfloat16, float16 or float32); kv_lens int32[S]; page_indices
    int32[S, pages_per_seq]; cu_q_lens int32[S + 1]; num_seqs int32 scalar; prefix_lens int32[S] and
    segment_starts int32[T] for the segment mask; tree_bits int32[T] for draft-tree rows (see the reference).
    ``decode_only`` runs `gpu_decode.decode_attention_gpu` (tiles ``decode_blocks``, default its table);
    ``blocks`` overrides `common.GPU_BLOCK_TABLE` (block_q a power of two >= 16; the table's own entry is shrunk by
    `fit_blocks`); ``interpret=True`` runs in Pallas' interpreter (CPU).

    Returns [T, H, D] in q.dtype, padding rows zero.
    Raises ValueError when H is not a multiple of KVH.
    """
    if decode_only:
        return decode_attention_gpu(q, k_pages, v_pages, kv_lens, page_indices, num_seqs, sm_scale=sm_scale,
                                    sliding_window=sliding_window, soft_cap=soft_cap, blocks=decode_blocks,
                                    interpret=interpret)
    T, H, D = q.shape
    num_pages, page_size, KVH, _ = k_pages.shape
    P = page_indices.shape[1]
    bs = block_sizes(GPU_BLOCK_TABLE, "default" if interpret else device_generation(), blocks)
    if blocks is None:
        bs = fit_blocks(bs, max(1, H // KVH), max(jnp.dtype(q.dtype).itemsize, jnp.dtype(k_pages.dtype).itemsize))
    block_q, block_kv = bs.block_q, bs.block_kv
    inputs = prepare_launch(q, kv_lens, page_indices, cu_q_lens, num_seqs, prefix_lens, segment_starts, block_q,
                            KVH, tree_bits)
    t_pad = inputs.t_pad
    k2 = k_pages.reshape(num_pages * page_size, KVH * D)
    v2 = v_pages.reshape(num_pages * page_size, KVH * D)
    kernel = functools.partial(
        _kernel, has_tree=tree_bits is not None, sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap, block_q=block_q,
        block_kv=block_kv, page_size=page_size, pages_per_seq=P, num_slots=num_pages * page_size,
        group=H // KVH, head_dim=D)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        kernel,
        grid=(t_pad // block_q, KVH),
        in_specs=[any_spec] * 12,
        out_specs=any_spec,
        out_shape=jax.ShapeDtypeStruct((t_pad, H * D), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(*inputs.scalars, inputs.q, inputs.seg, inputs.tree, k2, v2)
    return out[:T].reshape(T, H, D)

