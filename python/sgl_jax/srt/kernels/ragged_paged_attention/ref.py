"""Ragged paged attention in pure JAX (the CPU path and the reference for kernels).

One call serves a mixed batch of extend (prefill) and decode sequences whose tokens are concatenated in
``q``; each sequence reads its K/V through its row of a page table. The algorithm is the one a Pallas
kernel runs (online softmax over KV blocks, as in FlashAttention, Dao et al. 2022), written with
`lax.fori_loop`s whose trip counts are dynamic: the work follows the real lengths, not padded ones, so
one compiled program serves every batch of the same padded (T, S) shape.

- decode batches (every sequence has one query token): vectorized over sequences, loop over KV blocks.
- extend / mixed batches: loop over sequences, then over query blocks, then over the KV blocks up to the
  causal bound of each query block (no work on fully masked blocks). A sequence's first q_len % 256 rows
  go in blocks of 32 queries x 128 keys, the rest in blocks of 256 x 512: on CPU the large blocks' matmuls
  run about twice as fast (one layer of a 2,000-token prefill of SmolLM2: 93-131 ms -> 47-52 ms), and
  short sequences keep small blocks.
- shared prefix (cascade attention, as in FlashInfer's cascade inference and Hydragen, Juravsky et al.
  2024): when every sequence of an extend batch starts with the same cached pages, all query rows attend
  to those keys together in large blocks (one matmul per block for the whole batch instead of one per
  sequence); the per-sequence loop then continues from that online-softmax state over the rest.
- extend blocks whose mask keeps every entry (below the causal diagonal, inside the prefix) skip the
  masking pass over their scores.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from sgl_jax.srt.kernels.ragged_paged_attention.common import NO_TREE, tree_visible

MASK_VALUE = -1e30
DECODE_KV_BLOCK = 256  # tokens of KV per decode iteration
EXTEND_Q_BLOCK = 32  # query tokens per extend iteration
EXTEND_KV_BLOCK = 128  # tokens of KV per extend iteration
LONG_Q_BLOCK = 256  # query tokens per extend iteration for a sequence's rows past its first q_len % 256
LONG_KV_BLOCK = 512  # tokens of KV per iteration of those
SHARED_Q_BLOCK = 128  # query rows per shared-prefix iteration
SHARED_KV_BLOCK = 1024  # tokens of shared-prefix KV per shared-prefix iteration


def write_kv_to_pages(
    k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, loc: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Scatter new tokens' K/V into their cache slots.

    Args:
        k_pages, v_pages: [num_pages, page_size, num_kv_heads, head_dim] cache of one layer (donated by the
            caller's jit, so the update is in place).
        k, v: [T, num_kv_heads, head_dim] new keys/values.
        loc: int32[T] flat slot per token (page * page_size + offset); padding tokens use slot 0, a
            reserved page that is never read.
    Returns:
        The updated (k_pages, v_pages). The scatter indexes the 4-D cache by (page, offset): scattering into
        a reshaped (flattened) view made XLA on CPU copy the whole cache every step (measured: 350 ms
        for 30 layers of a 16k-token cache), while this form updates the donated buffer in place. A bfloat16
        cache on CPU is written by the C++ kernel (`cpu.write_kv`): XLA's CPU backend runs a bfloat16 scatter
        in float32, converting the whole cache each step.
    """
    if jax.default_backend() == "cpu":
        from sgl_jax.srt.kernels.ragged_paged_attention import cpu

        if cpu.writes_kv(k_pages.dtype):
            return cpu.write_kv(k_pages, v_pages, k, v, loc)
    ps = k_pages.shape[1]
    page, offset = loc // ps, loc % ps
    k_pages = k_pages.at[page, offset].set(to_cache_dtype(k, k_pages.dtype))
    v_pages = v_pages.at[page, offset].set(to_cache_dtype(v, v_pages.dtype))
    return k_pages, v_pages


def to_cache_dtype(x: jax.Array, dtype) -> jax.Array:
    """x in the KV cache's storage dtype. An fp8 cache (--kv-cache-dtype fp8_e4m3 / fp8_e5m2, scale 1 as SGLang
    uses without checkpoint scales) saturates at the format's largest finite value (448 / 57344) instead of
    overflowing to NaN (float8_e4m3fn has no infinity); a value's relative rounding error is 2**-4 (e4m3) or
    2**-3 (e5m2)."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating):
        big = float(jnp.finfo(dtype).max)
        return jnp.clip(x.astype(jnp.float32), -big, big).astype(dtype)
    return x.astype(dtype)


def _scores(q, k, sm_scale, soft_cap):
    """q [..., Q, KVH, G, D] x k [..., C, KVH, D] -> float32 [..., KVH, G, Q, C]."""
    s = jnp.einsum("...qkgd,...ckd->...kgqc", q, k, preferred_element_type=jnp.float32) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    return s


def _online_softmax_step(carry, s, v):
    """One FlashAttention update. s: [..., KVH, G, Q, C] masked scores; v: [..., C, KVH, D]."""
    m, l, acc = carry
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    corr = jnp.exp(m - m_new)
    pv = jnp.einsum("...kgqc,...ckd->...kgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv


def _matmul_step(carry, x, kblk, vblk, mask, soft_cap):
    """One FlashAttention update in matmul-friendly layouts (the extend paths).

    carry: (m, l [KVH, R], acc [KVH, R, D]) float32; x: [KVH, R, D] queries already scaled by sm_scale;
    kblk, vblk: [bk, KVH, D]; mask: bool broadcastable to [KVH, R, bk].
    """
    m, l, acc = carry
    sc = jnp.matmul(x, kblk.transpose(1, 2, 0).astype(x.dtype), preferred_element_type=jnp.float32)
    if soft_cap is not None:
        sc = soft_cap * jnp.tanh(sc / soft_cap)
    sc = jnp.where(mask, sc, MASK_VALUE)
    m_new = jnp.maximum(m, sc.max(-1))
    p = jnp.exp(sc - m_new[..., None])
    corr = jnp.exp(m - m_new)
    vt = vblk.transpose(1, 0, 2)
    pv = jnp.matmul(p.astype(vt.dtype), vt, preferred_element_type=jnp.float32)
    return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv


def _step_skipping_full_masks(carry, x, kblk, vblk, mask, soft_cap, row_repeats: int = 1):
    """`_matmul_step`, without the masking pass over the [KVH, R, bk] scores when `mask` keeps every entry
    (most blocks of a long prefix or prompt): on CPU that pass is a read and write of the whole score tensor,
    about 7% of the shared-prefix loop of an item batch (1,920 rows over 1,984 keys: 72 -> 67 ms a layer).
    `mask` [r, bk] is tiled `row_repeats` times along its rows (one copy per head of a KV group) only when
    it is applied."""
    return jax.lax.cond(jnp.all(mask), lambda c: _matmul_step(c, x, kblk, vblk, True, soft_cap),
                        lambda c: _matmul_step(c, x, kblk, vblk, jnp.tile(mask, (row_repeats, 1)), soft_cap),
                        carry)


def _queries_for_matmul(qblk, sm_scale):
    """[bq, KVH, G, D] -> [KVH, G * bq, D] scaled by sm_scale (row g * bq + r is query r, head group g)."""
    bq, KVH, G, D = qblk.shape
    return (qblk.transpose(1, 2, 0, 3) * sm_scale).reshape(KVH, G * bq, D)


def _finish(l, acc):
    return acc / jnp.where(l > 0, l, 1.0)[..., None]


def _pages_per_block(block_tokens: int, page_size: int) -> int:
    return max(1, block_tokens // page_size)


def _decode_attention(q, k_pages, v_pages, kv_lens, page_indices, num_seqs, sm_scale, sliding_window, soft_cap):
    T, H, D = q.shape
    S, P = page_indices.shape
    _, ps, KVH, _ = k_pages.shape
    G = H // KVH
    ppb = _pages_per_block(DECODE_KV_BLOCK, ps)
    bk = ppb * ps
    live = jnp.arange(S) < num_seqs
    kv_len = jnp.where(live, kv_lens, 0)
    rows = jnp.minimum(jnp.arange(S), T - 1)
    qs = q[rows].reshape(S, 1, KVH, G, D)
    qpos = kv_len - 1
    lo = jnp.maximum(qpos - sliding_window + 1, 0) if sliding_window is not None else jnp.zeros_like(qpos)
    kb_lo = jnp.min(jnp.where(live, lo, jnp.iinfo(jnp.int32).max)) // bk
    kb_hi = (jnp.max(kv_len) + bk - 1) // bk
    kb_lo = jnp.minimum(kb_lo, kb_hi)

    def body(kb, carry):
        cols = jnp.minimum(kb * ppb + jnp.arange(ppb), P - 1)
        pages = page_indices[:, cols]  # [S, ppb]
        kblk = k_pages[pages].reshape(S, bk, KVH, D).astype(q.dtype)
        vblk = v_pages[pages].reshape(S, bk, KVH, D).astype(q.dtype)
        kpos = kb * bk + jnp.arange(bk)
        mask = (kpos[None, :] < kv_len[:, None]) & (kpos[None, :] >= lo[:, None])  # [S, bk]
        s = _scores(qs, kblk, sm_scale, soft_cap)  # [S, KVH, G, 1, bk]
        s = jnp.where(mask[:, None, None, None, :], s, MASK_VALUE)
        return _online_softmax_step(carry, s, vblk)

    init = (
        jnp.full((S, KVH, G, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((S, KVH, G, 1), jnp.float32),
        jnp.zeros((S, KVH, G, 1, D), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(kb_lo, kb_hi, body, init)
    o = _finish(l, acc).reshape(S, H, D).astype(q.dtype)
    out = jnp.zeros_like(q)
    dest = jnp.where(live, jnp.arange(S), T)  # one query row per sequence, in order
    return out.at[dest].set(o, mode="drop")


def _token_positions(cu_q_lens, kv_lens, T):
    """int32[T] KV position of every query row (rows past the last sequence get garbage, never used)."""
    S = kv_lens.shape[0]
    t = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], t, side="right"), S - 1)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    return (kv_lens - q_lens)[seq] + t - cu_q_lens[seq]


def _shared_prefix_state(q, k_pages, v_pages, page_row, shared_len, num_rows, qpos, sm_scale, sliding_window,
                         soft_cap, pad):
    """Online-softmax state of the first `num_rows` query rows over the keys [0, shared_len) of `page_row`.

    Large blocks in the layouts a CPU matmul wants ([KVH, G*bq, D] x [KVH, D, bk]): on CPU the score
    tensor's memory traffic, not FLOPs, bounds this loop, and a 2048-key block needs few online-softmax
    rescales. Returns (m, l, acc) of shapes [KVH, G, T + pad], [KVH, G, T + pad], [KVH, G, T + pad, D] in
    float32; rows that were not computed hold the empty state (m = MASK_VALUE, l = 0, acc = 0).
    """
    T, H, D = q.shape
    P = page_row.shape[0]
    _, ps, KVH, _ = k_pages.shape
    G = H // KVH
    bq = SHARED_Q_BLOCK
    ppb = _pages_per_block(SHARED_KV_BLOCK, ps)
    bk = ppb * ps
    n = T + pad
    rows_total = ((T + pad + bq - 1) // bq) * bq
    q_padded = jnp.concatenate([q, jnp.zeros((rows_total - T, H, D), q.dtype)])
    if sliding_window is not None:
        qpos_padded = jnp.concatenate([qpos, jnp.zeros((rows_total - T,), jnp.int32)])
    kb_hi = (shared_len + bk - 1) // bk

    def q_body(qb, state):
        qblk = jax.lax.dynamic_slice_in_dim(q_padded, qb * bq, bq).reshape(bq, KVH, G, D)
        x = _queries_for_matmul(qblk, sm_scale)
        if sliding_window is not None:
            lo = jax.lax.dynamic_slice_in_dim(qpos_padded, qb * bq, bq) - sliding_window + 1
            kb_lo = jnp.minimum(jnp.maximum(jnp.min(lo), 0) // bk, kb_hi)
            lo = jnp.tile(lo, G)  # row g * bq + r of x
        else:
            lo, kb_lo = None, 0

        def kv_body(kb, carry):
            cols = jnp.minimum(kb * ppb + jnp.arange(ppb), P - 1)
            pages = page_row[cols]
            kblk = k_pages[pages].reshape(bk, KVH, D).astype(q.dtype)
            vblk = v_pages[pages].reshape(bk, KVH, D).astype(q.dtype)
            kpos = kb * bk + jnp.arange(bk)
            mask = kpos[None, :] < shared_len
            if lo is not None:
                mask = mask & (kpos[None, :] >= lo[:, None])
            return _step_skipping_full_masks(carry, x, kblk, vblk, mask, soft_cap)

        init = (
            jnp.full((KVH, G * bq), MASK_VALUE, jnp.float32),
            jnp.zeros((KVH, G * bq), jnp.float32),
            jnp.zeros((KVH, G * bq, D), jnp.float32),
        )
        m, l, acc = jax.lax.fori_loop(kb_lo, kb_hi, kv_body, init)
        blk = (m.reshape(KVH, G, bq), l.reshape(KVH, G, bq), acc.reshape(KVH, G, bq, D))
        return tuple(jax.lax.dynamic_update_slice_in_dim(x, b, qb * bq, axis=2) for x, b in zip(state, blk))

    state = (
        jnp.full((KVH, G, rows_total), MASK_VALUE, jnp.float32),
        jnp.zeros((KVH, G, rows_total), jnp.float32),
        jnp.zeros((KVH, G, rows_total, D), jnp.float32),
    )
    n_qb = jnp.where(shared_len > 0, (num_rows + bq - 1) // bq, 0)
    state = jax.lax.fori_loop(0, n_qb, q_body, state)
    return tuple(x[:, :, :n] for x in state)


def _block_attention(q_padded, seg_padded, tree_padded, k_pages, v_pages, page_row, shared, q_start, q_len, kv_len,
                     prefix_len, r0, bq, bk, out, sm_scale, sliding_window, soft_cap, shared_len):
    """Attention of rows [r0, r0 + bq) of one sequence (rows >= q_len are skipped) over its keys from
    `shared_len` on, continuing from the shared-prefix state; writes them into `out` [T, H, D]."""
    T, H, D = out.shape
    P = page_row.shape[0]
    _, ps, KVH, _ = k_pages.shape
    G = H // KVH
    ppb = _pages_per_block(bk, ps)
    bk = ppb * ps
    row = r0 + jnp.arange(bq)
    valid = row < q_len
    qblk = jax.lax.dynamic_slice_in_dim(q_padded, q_start + r0, bq).reshape(bq, KVH, G, D)
    x = _queries_for_matmul(qblk, sm_scale)
    qpos = kv_len - q_len + row
    last_pos = kv_len - q_len + jnp.minimum(r0 + bq, q_len) - 1
    kv_hi = jnp.minimum(kv_len, last_pos + 1)
    lo = jnp.maximum(qpos - sliding_window + 1, 0) if sliding_window is not None else jnp.zeros_like(qpos)
    seg_start = jax.lax.dynamic_slice_in_dim(seg_padded, q_start + r0, bq)
    tree = None if tree_padded is None else jax.lax.dynamic_slice_in_dim(tree_padded, q_start + r0, bq)
    # keys before shared_len were visited by _shared_prefix_state; continue from its state
    kb_lo = jnp.maximum(lo[0], shared_len) // bk
    kb_hi = jnp.maximum((kv_hi + bk - 1) // bk, kb_lo)
    # Visible keys of the block: [0, prefix_len) and [min segment start, kv_hi) -- two block ranges, so the
    # blocks between the shared prefix and the block's own segments are skipped.
    a_hi = jnp.clip((jnp.minimum(prefix_len, kv_hi) + bk - 1) // bk, kb_lo, kb_hi)
    seg_lo = jnp.min(jnp.where(valid, seg_start, jnp.iinfo(jnp.int32).max))
    b_lo = jnp.clip(seg_lo // bk, a_hi, kb_hi)
    n_a = a_hi - kb_lo

    def kv_body(i, carry):
        kb = jnp.where(i < n_a, kb_lo + i, b_lo + i - n_a)
        cols = jnp.minimum(kb * ppb + jnp.arange(ppb), P - 1)
        pages = page_row[cols]
        kblk = k_pages[pages].reshape(bk, KVH, D).astype(q_padded.dtype)
        vblk = v_pages[pages].reshape(bk, KVH, D).astype(q_padded.dtype)
        kpos = kb * bk + jnp.arange(bk)
        mask = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < kv_len) & (kpos[None, :] >= lo[:, None])
        mask &= (kpos[None, :] < prefix_len) | (kpos[None, :] >= seg_start[:, None])
        mask &= kpos[None, :] >= shared_len
        if tree is not None:
            mask &= tree_visible(tree[:, None], kpos[None, :] - (kv_len - q_len))
        return _step_skipping_full_masks(carry, x, kblk, vblk, mask, soft_cap, row_repeats=G)

    m0, l0, acc0 = (jax.lax.dynamic_slice_in_dim(a, q_start + r0, bq, axis=2) for a in shared)
    init = (m0.reshape(KVH, G * bq), l0.reshape(KVH, G * bq), acc0.reshape(KVH, G * bq, D))
    _, l, acc = jax.lax.fori_loop(0, n_a + kb_hi - b_lo, kv_body, init)
    o = _finish(l, acc).reshape(KVH, G, bq, D).transpose(2, 0, 1, 3).reshape(bq, H, D).astype(out.dtype)
    dest = jnp.where(valid, q_start + row, T)
    return out.at[dest].set(o, mode="drop")


def _per_sequence_attention(q_padded, seg_padded, tree_padded, k_pages, v_pages, kv_lens, page_indices, cu_q_lens,
                            num_seqs, shared, out, sm_scale, sliding_window, soft_cap, prefix_lens, shared_len):
    """Loop over sequences; each one's first q_len % LONG_Q_BLOCK rows in small blocks, the rest (the rows
    that see the most keys) in large ones, whose matmuls run several times faster on CPU."""
    blk = functools.partial(_block_attention, q_padded, seg_padded, tree_padded, k_pages, v_pages, sm_scale=sm_scale,
                            sliding_window=sliding_window, soft_cap=soft_cap, shared_len=shared_len)

    def seq_body(s, out):
        q_start = cu_q_lens[s]
        q_len = cu_q_lens[s + 1] - q_start
        seq = dict(page_row=page_indices[s], shared=shared, q_start=q_start, q_len=q_len, kv_len=kv_lens[s],
                   prefix_len=prefix_lens[s])
        n_small_rows = q_len % LONG_Q_BLOCK
        out = jax.lax.fori_loop(
            0, (n_small_rows + EXTEND_Q_BLOCK - 1) // EXTEND_Q_BLOCK,
            lambda i, o: blk(r0=i * EXTEND_Q_BLOCK, bq=EXTEND_Q_BLOCK, bk=EXTEND_KV_BLOCK, out=o, **seq), out)
        return jax.lax.fori_loop(
            0, q_len // LONG_Q_BLOCK,
            lambda i, o: blk(r0=n_small_rows + i * LONG_Q_BLOCK, bq=LONG_Q_BLOCK, bk=LONG_KV_BLOCK, out=o, **seq),
            out)

    return jax.lax.fori_loop(0, num_seqs, seq_body, out)


def _extend_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale,
                      sliding_window, soft_cap, prefix_lens, segment_starts, shared_len, tree_bits):
    T = q.shape[0]
    pad = max(LONG_Q_BLOCK, EXTEND_Q_BLOCK)
    q_padded = jnp.concatenate([q, jnp.zeros((pad,) + q.shape[1:], q.dtype)])
    seg_padded = jnp.concatenate([segment_starts, jnp.zeros((pad,), jnp.int32)])
    tree_padded = None  # (no tree rows: the mask term is left out of the program)
    if tree_bits is not None:
        tree_padded = jnp.concatenate([tree_bits, jnp.full((pad,), NO_TREE, jnp.int32)])
    qpos_all = _token_positions(cu_q_lens, kv_lens, T) if sliding_window is not None else None
    shared = _shared_prefix_state(q, k_pages, v_pages, page_indices[0], shared_len, cu_q_lens[num_seqs],
                                  qpos_all, sm_scale, sliding_window, soft_cap, pad)
    return _per_sequence_attention(q_padded, seg_padded, tree_padded, k_pages, v_pages, kv_lens, page_indices,
                                   cu_q_lens, num_seqs, shared, jnp.zeros_like(q), sm_scale, sliding_window,
                                   soft_cap, prefix_lens, shared_len)


@functools.partial(jax.named_call, name="ragged_paged_attention")
def ragged_paged_attention(
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
    shared_prefix_len: Optional[jax.Array] = None,
    tree_bits: Optional[jax.Array] = None,
) -> jax.Array:
    """Causal attention of a ragged batch of sequences over a paged KV cache.

    Args:
        q: [T, num_heads, head_dim] queries of all sequences, concatenated in sequence order; rows past
            ``cu_q_lens[num_seqs]`` are padding.
        k_pages, v_pages: [num_pages, page_size, num_kv_heads, head_dim]; already hold this step's K/V. Any
            float dtype (the cache's storage dtype, --kv-cache-dtype): blocks read are converted to q.dtype.
        kv_lens: int32[S] tokens of KV per sequence, this step's tokens included.
        page_indices: int32[S, pages_per_seq] page table; entries past a sequence's pages are ignored.
        cu_q_lens: int32[S + 1] cumulative query lengths (cu_q_lens[0] = 0).
        num_seqs: int32 scalar, sequences in use (<= S); the rest is padding.
        sm_scale: softmax scale, usually head_dim ** -0.5.
        sliding_window: if set, a query at position p sees keys at positions > p - sliding_window.
        soft_cap: if set, scores become soft_cap * tanh(scores / soft_cap) (Gemma 2).
        decode_only: promise that every sequence has exactly one query token, which is row s of q for
            sequence s; enables the vectorized decode path (which ignores the segment mask).
        prefix_lens: int32[S] shared-prefix length of each sequence for the segment mask (multi-item
            scoring); None or 0: no segments.
        segment_starts: int32[T] per query token, the KV position where its own segment starts (tokens of
            the shared prefix and of ordinary sequences: 0). Segment ids are contiguous runs, so a token
            of segment k sees the shared prefix [0, prefix_len) and its own segment [segment_start, itself]
            only; blocks between the two ranges are never visited.
        shared_prefix_len: int32 scalar, a promise that every sequence's first ``shared_prefix_len`` KV
            positions are the same pages as sequence 0's (a multiple of the page size), that no query sits
            before it (kv_lens - q_lens >= shared_prefix_len), and that it is <= prefix_lens of any
            sequence with segments. Those keys are then attended by all query rows at once (cascade
            attention). None or 0: off. Ignored by the decode path.
        tree_bits: int32[T] per query token, the draft-tree mask of speculative verification (common.tree_visible):
            a sequence whose queries are the slots of a draft tree (at most common.MAX_TREE_SLOTS) sets bit j of
            slot i when slot j is i's ancestor or i itself, and slot i then sees the keys before the tree and those
            slots only; common.NO_TREE (-1) for every other token. None: no tree rows. Ignored by the decode path.
    Returns:
        [T, num_heads, head_dim] in q.dtype; padding rows are zero. Query i of sequence s sits at KV
        position kv_lens[s] - q_len[s] + i and attends to keys at positions <= it (rotary positions are the
        caller's business). Softmax runs in float32.
    """
    num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(())
    if q.shape[1] % k_pages.shape[2]:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {k_pages.shape[2]}")
    if decode_only:
        return _decode_attention(q, k_pages, v_pages, kv_lens, page_indices, num_seqs, sm_scale,
                                 sliding_window, soft_cap)
    if prefix_lens is None:
        prefix_lens = jnp.zeros(page_indices.shape[0], jnp.int32)
    if segment_starts is None:
        segment_starts = jnp.zeros(q.shape[0], jnp.int32)
    shared_len = jnp.asarray(0 if shared_prefix_len is None else shared_prefix_len, jnp.int32).reshape(())
    return _extend_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale,
                             sliding_window, soft_cap, prefix_lens, segment_starts, shared_len, tree_bits)
