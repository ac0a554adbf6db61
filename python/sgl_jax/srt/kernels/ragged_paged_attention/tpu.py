"""Ragged paged attention as a Pallas kernel for TPU (Mosaic).

Grid: one program per aligned block of ``block_q`` query rows (see `common`). A program walks the
sequences with rows in its block and, for each, the KV blocks it must see (causal bound, sliding window,
segment mask: blocks that are fully masked are never fetched). A KV block is ``pages_per_block`` whole
pages, copied from HBM with asynchronous DMAs (one per page, all KV heads at once: a page of the cache
[page_size, num_kv_heads * head_dim] is contiguous) into one of two VMEM buffers while the other is being
computed on (double buffering across the block's whole walk, sequence boundaries included). Scores and the
online softmax run in float32 on [G * block_q, head_dim] x [head_dim, block_kv] matmuls per KV head, G the
query heads per KV head (GQA).

Metadata lives in SMEM through scalar prefetch: cu_q_lens, kv_lens, the flattened page table,
prefix_lens and the per-block sequence ranges. Page ids are clamped into the cache, so garbage entries of
the page table past a sequence's pages can never make a DMA read outside it.

Decode batches (``decode_only``) go to the flash-decoding kernel of `tpu_decode` instead, whose grid is (sequence,
KV head, context split).

On CPU the same kernels run with ``interpret=True`` (the tests, and ``--attention-backend pallas`` there).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sgl_jax.srt.kernels.ragged_paged_attention.common import (
    MASK_VALUE, TPU_BLOCK_TABLE, BlockSizes, block_mask, block_sizes, device_generation, finish, prepare_launch,
    qk_scores, seq_plan, softmax_update, widen,
)
from sgl_jax.srt.kernels.ragged_paged_attention.flash_decode import DecodeBlocks
from sgl_jax.srt.kernels.ragged_paged_attention.tpu_decode import decode_attention_tpu


def _kernel(
    # scalar prefetch (SMEM)
    cu_ref, kv_lens_ref, pt_ref, prefix_ref, first_ref, last_ref, seg_lo_ref,
    # inputs
    q_ref, seg_ref, tree_ref, k_hbm, v_hbm,
    # output
    o_ref,
    # scratch
    k_buf, v_buf, sems, q_sc, m_sc, l_sc, acc_sc,
    *, has_tree, sm_scale, sliding_window, soft_cap, block_q, block_kv, page_size, pages_per_seq, num_pages,
    num_kv_heads, group, head_dim,
):
    b = pl.program_id(0)
    block_start = b * block_q
    ppb = block_kv // page_size
    first, last, seg_lo = first_ref[b], last_ref[b], seg_lo_ref[b]

    _start_block(q_ref, q_sc, m_sc, l_sc, acc_sc, sm_scale=sm_scale, num_kv_heads=num_kv_heads, group=group,
                 head_dim=head_dim)

    def plan_of(s):
        s = jnp.minimum(s, last)  # `advance` evaluates one past the last sequence: keep SMEM reads in bounds
        return seq_plan(cu_ref[s], cu_ref[s + 1], kv_lens_ref[s], prefix_ref[s], block_start, block_q, seg_lo,
                        block_kv, sliding_window)

    start_fetch, wait_fetch = _kv_fetch(pt_ref, k_hbm, v_hbm, k_buf, v_buf, sems, plan_of, ppb=ppb,
                                        page_size=page_size, pages_per_seq=pages_per_seq, num_pages=num_pages)

    def advance(s, i):
        """The next (sequence, step) after (s, i) that has work; s > last when there is none."""
        def cond(c):
            return (c[0] <= last) & (c[1] >= plan_of(c[0]).n)

        return jax.lax.while_loop(cond, lambda c: (c[0] + 1, jnp.int32(0)), (s, i + 1))

    rows = block_start + jax.lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
    rows = jnp.concatenate([rows] * group, axis=0)  # score row g * block_q + r is query row r, head g
    seg = jnp.concatenate([seg_ref[...]] * group, axis=0)
    tree = jnp.concatenate([tree_ref[...]] * group, axis=0) if has_tree else None

    def compute(s, i, slot):
        plan = plan_of(s)
        kb = plan.kv_block(i)
        kpos = kb * block_kv + jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        mask = block_mask(plan, rows, seg, kpos, sliding_window, tree)
        for h in range(num_kv_heads):
            k = widen(k_buf[slot, :, h * head_dim:(h + 1) * head_dim], q_sc.dtype)
            v = widen(v_buf[slot, :, h * head_dim:(h + 1) * head_dim], q_sc.dtype)
            m, l, acc = softmax_update(m_sc[h], l_sc[h], acc_sc[h], qk_scores(q_sc[h], k), mask, v, soft_cap)
            m_sc[h], l_sc[h], acc_sc[h] = m, l, acc

    s0, i0 = advance(first, jnp.int32(-1))

    @pl.when(s0 <= last)
    def _():
        start_fetch(s0, i0, 0)

    def body(c):
        s, i, slot = c
        s_next, i_next = advance(s, i)

        @pl.when(s_next <= last)
        def _():
            start_fetch(s_next, i_next, 1 - slot)

        wait_fetch(slot)
        compute(s, i, slot)
        return s_next, i_next, 1 - slot

    jax.lax.while_loop(lambda c: c[0] <= last, body, (s0, i0, jnp.int32(0)))
    _finish_block(o_ref, l_sc, acc_sc, block_q=block_q, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim)


def _kv_fetch(pt_ref, k_hbm, v_hbm, k_buf, v_buf, sems, plan_of, *, ppb, page_size, pages_per_seq, num_pages):
    """The double-buffered KV copies: (start_fetch(s, i, slot), wait_fetch(slot)). start_fetch starts the DMAs of
    sequence s's step-i KV block (`ppb` pages, from its page table row in pt_ref) from HBM into buffer `slot` of
    k_buf / v_buf [2, block_kv, KVH * D]; wait_fetch waits for the copies into `slot`."""
    def page_copies(s, kb, j, slot):
        col = jnp.minimum(kb * ppb + j, pages_per_seq - 1)
        page = jnp.clip(pt_ref[s * pages_per_seq + col], 0, num_pages - 1)
        dst = pl.ds(j * page_size, page_size)
        return (pltpu.make_async_copy(k_hbm.at[page], k_buf.at[slot, dst], sems.at[0, slot]),
                pltpu.make_async_copy(v_hbm.at[page], v_buf.at[slot, dst], sems.at[1, slot]))

    def start_fetch(s, i, slot):
        kb = plan_of(s).kv_block(i)

        @pl.loop(0, ppb)
        def _(j):
            for c in page_copies(s, kb, j, slot):
                c.start()

    def wait_fetch(slot):
        @pl.loop(0, ppb)
        def _(j):
            for c in page_copies(0, 0, j, slot):  # same sizes and semaphores as the copies started
                c.wait()

    return start_fetch, wait_fetch


def _start_block(q_ref, q_sc, m_sc, l_sc, acc_sc, *, sm_scale, num_kv_heads, group, head_dim):
    """Reset the online-softmax state (m = MASK_VALUE, l = acc = 0) and stage the query block per KV head: q_sc[h]
    is [group * block_q, head_dim], the group's query heads stacked, scaled by `sm_scale` once."""
    m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
    for h in range(num_kv_heads):
        q = jnp.concatenate(
            [q_ref[:, (h * group + g) * head_dim:(h * group + g + 1) * head_dim] for g in range(group)], axis=0)
        q_sc[h] = (q.astype(jnp.float32) * sm_scale).astype(q_sc.dtype)


def _finish_block(o_ref, l_sc, acc_sc, *, block_q, num_kv_heads, group, head_dim):
    """Normalise each KV head's accumulator and write its query heads' rows back to o_ref [block_q, H * D]."""
    for h in range(num_kv_heads):
        o = finish(l_sc[h], acc_sc[h])
        for g in range(group):
            col = (h * group + g) * head_dim
            o_ref[:, col:col + head_dim] = o[g * block_q:(g + 1) * block_q].astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "decode_only",
                                             "blocks", "decode_blocks", "interpret"))
def ragged_paged_attention_tpu(
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
    interpret=False,
) -> jax.Array:
    """Pallas TPU ragged paged attention with the contract of `ref.ragged_paged_attention`.

    Shapes and dtypes as there: q [T, H, D]; k_pages, v_pages [num_pages, page_size, KVH, D] (bfloat16 or
    float32, or float8_e4m3fn / float8_e5m2: copied to VMEM in one byte per value and widened to q's dtype there,
    `common.widen`); kv_lens int32[S]; page_indices int32[S, pages_per_seq]; cu_q_lens int32[S + 1]; num_seqs
    int32 scalar; prefix_lens int32[S] and segment_starts int32[T] for the segment mask; tree_bits int32[T] for
    draft-tree rows (see the reference). ``decode_only`` runs `tpu_decode.decode_attention_tpu` (tiles
    ``decode_blocks``, default its table); the cascade hint ``shared_prefix_len`` of the reference is not needed
    here. ``blocks`` overrides the tile table
    (`common.TPU_BLOCK_TABLE`); ``interpret=True`` runs the kernel in Pallas' interpreter (CPU), and a
    ``pltpu.InterpretParams`` in its TPU interpreter (simulated DMAs and semaphores, race detection).

    Returns [T, H, D] in q.dtype, padding rows zero.
    Raises ValueError when H is not a multiple of KVH.
    """
    if decode_only:
        return decode_attention_tpu(q, k_pages, v_pages, kv_lens, page_indices, num_seqs, sm_scale=sm_scale,
                                    sliding_window=sliding_window, soft_cap=soft_cap, blocks=decode_blocks,
                                    interpret=interpret)
    T, H, D = q.shape
    num_pages, page_size, KVH, _ = k_pages.shape
    P = page_indices.shape[1]
    G = H // KVH
    bs = block_sizes(TPU_BLOCK_TABLE, "default" if interpret else device_generation(), blocks)
    block_q = bs.block_q
    block_kv = bs.pages_per_block(page_size) * page_size
    inputs = prepare_launch(q, kv_lens, page_indices, cu_q_lens, num_seqs, prefix_lens, segment_starts, block_q,
                            KVH, tree_bits)
    t_pad = inputs.t_pad
    k2 = k_pages.reshape(num_pages, page_size, KVH * D)
    v2 = v_pages.reshape(num_pages, page_size, KVH * D)

    kernel = functools.partial(
        _kernel, has_tree=tree_bits is not None, sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap, block_q=block_q,
        block_kv=block_kv, page_size=page_size, pages_per_seq=P, num_pages=num_pages, num_kv_heads=KVH,
        group=G, head_dim=D)
    nqb = t_pad // block_q
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=7,
        grid=(nqb,),
        in_specs=[
            pl.BlockSpec((block_q, H * D), lambda b, *_: (b, 0)),
            pl.BlockSpec((block_q, 1), lambda b, *_: (b, 0)),
            pl.BlockSpec((block_q, 1), lambda b, *_: (b, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec((block_q, H * D), lambda b, *_: (b, 0)),
        scratch_shapes=[
            pltpu.VMEM((2, block_kv, KVH * D), k_pages.dtype),
            pltpu.VMEM((2, block_kv, KVH * D), v_pages.dtype),
            pltpu.SemaphoreType.DMA((2, 2)),
            pltpu.VMEM((KVH, G * block_q, D), q.dtype),
            pltpu.VMEM((KVH, G * block_q, 1), jnp.float32),
            pltpu.VMEM((KVH, G * block_q, 1), jnp.float32),
            pltpu.VMEM((KVH, G * block_q, D), jnp.float32),
        ],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((t_pad, H * D), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=64 * 1024 * 1024),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(*inputs.scalars, inputs.q, inputs.seg, inputs.tree, k2, v2)
    return out[:T].reshape(T, H, D)

