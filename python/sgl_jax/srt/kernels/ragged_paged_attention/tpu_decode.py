"""Flash-decoding as a Pallas kernel for TPU (Mosaic): the decode batches of `tpu.ragged_paged_attention_tpu`.

Grid: (sequence, KV head, context split), every axis parallel (each program writes its own partial state); see
`flash_decode` for the decomposition and the layouts. A program's R query rows (the GQA group's heads, zero-padded to
a multiple of 8 sublanes) arrive in VMEM through their BlockSpec. Its split of the context is walked in KV blocks of
``pages_per_block`` whole pages: each page's [page_size, head_dim] slice of its KV head is copied from HBM with an
asynchronous DMA into one of two VMEM buffers while the other is computed on (double buffering). Blocks outside the
split, the sequence's length or the sliding window are never fetched. Scores ([R, D] x [D, block_kv]) and the online
softmax run in float32 on the MXU/VPU; the partial states are merged by `flash_decode.combine` in XLA.

Page ids are clamped into the cache, so garbage entries of the page table past a sequence's pages can never make a
DMA read outside it. On CPU the same kernel runs with ``interpret=True`` (or Pallas' TPU interpreter).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sgl_jax.srt.kernels.ragged_paged_attention.common import (
    MASK_VALUE, device_generation, qk_scores, softmax_update, widen,
)
from sgl_jax.srt.kernels.ragged_paged_attention.flash_decode import (
    DecodeBlocks, combine, decode_queries, live_kv_lens, num_splits, query_rows,
)

# Tile sizes per TPU generation (KV tokens per block, per program). Sized to VMEM (two buffers of K and V blocks of
# one KV head: 4 x 512 x 128 x 2 bytes = 512 KiB in bfloat16); not yet measured on a TPU.
TPU_DECODE_TABLE = {
    "v6e": DecodeBlocks(512, 2048),
    "v5e": DecodeBlocks(512, 2048),
    "default": DecodeBlocks(256, 1024),
}
MIN_ROWS = 8  # one sublane tile of float32


def decode_blocks(generation: str, page_size: int, override: Optional[DecodeBlocks] = None) -> DecodeBlocks:
    """The tile sizes of a launch, block_kv rounded to whole pages and split_tokens to whole blocks: `override` if
    given, else TPU_DECODE_TABLE's entry for the generation (`common.device_generation`)."""
    bs = override or TPU_DECODE_TABLE.get(generation, TPU_DECODE_TABLE["default"])
    block_kv = max(1, bs.block_kv // page_size) * page_size
    return DecodeBlocks(block_kv, -(-bs.split_tokens // block_kv) * block_kv)


def _kernel(kv_lens_ref, pt_ref, q_ref, k_hbm, v_hbm, m_ref, l_ref, acc_ref, k_buf, v_buf, sems, m_sc, l_sc,
            acc_sc, *, block_kv, split_tokens, page_size, pages_per_seq, num_pages, sliding_window, soft_cap):
    s, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ppb = block_kv // page_size
    kv_len = kv_lens_ref[s]
    start = j * split_tokens
    end = jnp.minimum(kv_len, start + split_tokens)
    lo = start if sliding_window is None else jnp.maximum(start, kv_len - sliding_window)
    kb0 = jax.lax.div(lo, jnp.int32(block_kv))
    kb1 = jnp.where(end > lo, jax.lax.div(end + block_kv - 1, jnp.int32(block_kv)), kb0)

    def page_copies(kb, jj, slot):
        col = jnp.minimum(kb * ppb + jj, pages_per_seq - 1)
        page = jnp.clip(pt_ref[s * pages_per_seq + col], 0, num_pages - 1)
        dst = pl.ds(jj * page_size, page_size)
        return (pltpu.make_async_copy(k_hbm.at[page, :, h], k_buf.at[slot, dst], sems.at[0, slot]),
                pltpu.make_async_copy(v_hbm.at[page, :, h], v_buf.at[slot, dst], sems.at[1, slot]))

    def start_fetch(kb, slot):
        @pl.loop(0, ppb)
        def _(jj):
            for c in page_copies(kb, jj, slot):
                c.start()

    def wait_fetch(slot):
        @pl.loop(0, ppb)
        def _(jj):
            for c in page_copies(kb0, jj, slot):  # same sizes and semaphores as the copies started
                c.wait()

    m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
    rows = q_ref.shape[0]

    @pl.when(kb0 < kb1)
    def _():
        start_fetch(kb0, 0)

    @pl.loop(kb0, kb1)
    def _(kb):
        slot = jax.lax.rem(kb - kb0, 2)

        @pl.when(kb + 1 < kb1)
        def _():
            start_fetch(kb + 1, 1 - slot)

        wait_fetch(slot)
        kpos = kb * block_kv + jax.lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)
        mask = (kpos >= lo) & (kpos < end)
        q = q_ref[...]
        m, l, acc = softmax_update(m_sc[...], l_sc[...], acc_sc[...], qk_scores(q, widen(k_buf[slot], q.dtype)), mask,
                                   widen(v_buf[slot], q.dtype), soft_cap)
        m_sc[...], l_sc[...], acc_sc[...] = m, l, acc

    m_ref[...] = m_sc[...]
    l_ref[...] = l_sc[...]
    acc_ref[...] = acc_sc[...]


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "blocks", "interpret"))
def decode_attention_tpu(
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
    interpret=False,
) -> jax.Array:
    """Decode attention by the flash-decoding Pallas TPU kernel; the contract of `ref.ragged_paged_attention` with
    ``decode_only=True``.

    Args:
        q: [T, H, D] bfloat16 or float32, row s is sequence s's query token.
        k_pages, v_pages: [num_pages, page_size, KVH, D]; kv_lens: int32[S] keys per sequence (this step's
            included); page_indices: int32[S, pages_per_seq]; num_seqs: int32 scalar, sequences in use.
        sm_scale, sliding_window, soft_cap: as the reference (None: off).
        blocks: tile sizes instead of TPU_DECODE_TABLE's (rounded by `decode_blocks`); interpret: True or a
            ``pltpu.InterpretParams`` to run in Pallas' interpreter (CPU).
    Returns:
        [T, H, D] in q.dtype; rows at and past min(num_seqs, T) zero. Scores and softmax in float32.
    Raises:
        ValueError: H is not a multiple of KVH.
    """
    T, H, D = q.shape
    num_pages, page_size, KVH, _ = k_pages.shape
    S, P = page_indices.shape
    if H % KVH:
        raise ValueError(f"num_heads {H} is not a multiple of num_kv_heads {KVH}")
    bs = decode_blocks("default" if interpret else device_generation(), page_size, blocks)
    rows = query_rows(H // KVH, MIN_ROWS)
    splits = num_splits(P, page_size, bs.split_tokens)
    n = S * KVH * splits
    kernel = functools.partial(
        _kernel, block_kv=bs.block_kv, split_tokens=bs.split_tokens, page_size=page_size, pages_per_seq=P,
        num_pages=num_pages, sliding_window=sliding_window, soft_cap=soft_cap)

    def prog(s, h, j, *_):
        return (s * KVH + h) * splits + j, 0, 0

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(S, KVH, splits),
        in_specs=[
            pl.BlockSpec((None, rows, D), lambda s, h, j, *_: (s * KVH + h, 0, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=[pl.BlockSpec((None, rows, 1), prog), pl.BlockSpec((None, rows, 1), prog),
                   pl.BlockSpec((None, rows, D), prog)],
        scratch_shapes=[
            pltpu.VMEM((2, bs.block_kv, D), k_pages.dtype),
            pltpu.VMEM((2, bs.block_kv, D), v_pages.dtype),
            pltpu.SemaphoreType.DMA((2, 2)),
            pltpu.VMEM((rows, 1), jnp.float32),
            pltpu.VMEM((rows, 1), jnp.float32),
            pltpu.VMEM((rows, D), jnp.float32),
        ],
    )
    m, l, acc = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((n, rows, 1), jnp.float32), jax.ShapeDtypeStruct((n, rows, 1), jnp.float32),
                   jax.ShapeDtypeStruct((n, rows, D), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=interpret,
        name="flash_decode_tpu",
    )(live_kv_lens(kv_lens, num_seqs), page_indices.astype(jnp.int32).reshape(-1),
      decode_queries(q, S, KVH, rows, sm_scale).reshape(S * KVH, rows, D), k_pages, v_pages)
    return combine(m.reshape(n * rows, 1), l.reshape(n * rows, 1), acc.reshape(n * rows, D), q, num_seqs, S, KVH,
                   splits)
