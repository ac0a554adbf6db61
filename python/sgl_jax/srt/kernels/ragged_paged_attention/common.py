"""Pieces shared by the Pallas ragged paged attention kernels (TPU and GPU).

Work decomposition (both kernels): the flat query axis [T] is cut into aligned blocks of ``block_q`` rows.
One program owns one query block, so output blocks never overlap; a block may hold rows of several
sequences (many decode rows, or the end of one extend sequence and the start of the next), and the
program visits those sequences in order, each over its own KV pages. A row belongs to exactly one
sequence, so the online-softmax state of the block is shared and every sequence updates only its rows.

The wrapper-side metadata (`q_block_metadata`) and the per-sequence plan (`seq_plan`) are plain scalar
arithmetic, usable inside kernels as well as in XLA. The mask and the softmax update are the contract of
`ref.ragged_paged_attention` (causal at each sequence's offset, sliding window, soft-cap, segment mask).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

MASK_VALUE = -1e30
INT_MAX = jnp.iinfo(jnp.int32).max


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of one kernel launch.

    block_q: query rows (tokens) per program; a multiple of 8 on TPU, a power of two >= 16 on GPU.
    block_kv: KV tokens per inner step (rounded to whole pages: max(1, block_kv // page_size) pages).
    """

    block_q: int
    block_kv: int

    def pages_per_block(self, page_size: int) -> int:
        return max(1, self.block_kv // page_size)


# Tile sizes of the ragged kernels (extend, prefill and mixed batches; decode batches run the flash-decoding kernels,
# `tpu_decode` and `gpu_decode`) per device generation. The TPU entries are sized to VMEM (double-buffered KV
# block of all KV heads, query/output blocks, the scaled queries and float32 accumulators stay under 16 MiB at
# head_dim 128 and 8 KV heads); they have not been tuned on hardware yet. "default" is the safe choice for unknown
# devices. The GPU entries are shrunk to fit shared memory by `gpu.fit_blocks`.
TPU_BLOCK_TABLE = {"v6e": BlockSizes(128, 512), "v5e": BlockSizes(128, 256), "default": BlockSizes(64, 256)}
GPU_BLOCK_TABLE = {"h100": BlockSizes(64, 64), "default": BlockSizes(32, 32)}


def device_generation(device: Optional[jax.Device] = None) -> str:
    """Key of the block tables for a device: "v6e", "v5e", "h100" or "default".

    Read from ``device.device_kind`` (e.g. "TPU v6 lite", "NVIDIA H100 80GB HBM3").
    """
    device = device or jax.devices()[0]
    kind = device.device_kind.lower()
    if "v6" in kind:
        return "v6e"
    if "v5 lite" in kind or "v5e" in kind:
        return "v5e"
    if "h100" in kind or "h200" in kind or "h800" in kind:
        return "h100"
    return "default"


def block_sizes(table: dict, generation: str, override: Optional[BlockSizes]) -> BlockSizes:
    """The tile sizes for a launch: ``override`` if given, else the table's entry (falling back to default)."""
    if override is not None:
        return override
    return table.get(generation, table["default"])


# NO_TREE: tree bits of a query row that is not a draft-tree slot (the causal mask alone); MAX_TREE_SLOTS: draft-tree
# slots per sequence, one bit each in an int32 (speculative/draft_tree.py)
from sgl_jax.srt.speculative.draft_tree import MAX_TREE_SLOTS, NO_TREE  # noqa: E402


class QBlockMeta(NamedTuple):
    """Per query block b (int32[num_q_blocks] each): the first and last sequence with rows in the block
    (first > last for an empty block), and the smallest segment start of its rows (a lower bound on where
    the block's item segments begin; 0 when any row is an ordinary one)."""

    first_seq: jax.Array
    last_seq: jax.Array
    seg_lo: jax.Array


def q_block_metadata(cu_q_lens: jax.Array, num_seqs: jax.Array, segment_starts: jax.Array,
                     t_padded: int, block_q: int) -> QBlockMeta:
    """Which sequences each aligned query block touches (computed in XLA before the kernel launch).

    Args:
        cu_q_lens: int32[S + 1]; num_seqs: int32 scalar; segment_starts: int32[t_padded].
        t_padded: T rounded up to a multiple of block_q.
    """
    S = cu_q_lens.shape[0] - 1
    nqb = t_padded // block_q
    total = cu_q_lens[num_seqs]
    ends_eff = jnp.where(jnp.arange(S) < num_seqs, cu_q_lens[1:], INT_MAX)  # monotonic

    def seq_of(row):
        return jnp.searchsorted(ends_eff, row, side="right").astype(jnp.int32)

    starts = jnp.arange(nqb, dtype=jnp.int32) * block_q
    last_row = jnp.minimum(starts + block_q, total) - 1
    empty = starts >= total
    first = jnp.where(empty, 1, seq_of(starts))
    last = jnp.where(empty, 0, seq_of(last_row))
    rows = jnp.arange(t_padded, dtype=jnp.int32)
    seg = jnp.where(rows < total, segment_starts, INT_MAX).reshape(nqb, block_q)
    seg_lo = jnp.where(empty, 0, seg.min(axis=1))
    return QBlockMeta(first, last, seg_lo)


class LaunchInputs(NamedTuple):
    """What both kernels receive: ``scalars`` = (cu_q_lens, kv_lens, flattened page table, prefix_lens,
    first_seq, last_seq, seg_lo), all int32; ``q`` [t_pad, H * D] (rows padded to whole query blocks);
    ``seg`` int32[t_pad, 1] segment starts; ``tree`` int32[t_pad, 1] tree bits (`tree_visible`); ``t_pad`` rows."""

    scalars: tuple
    q: jax.Array
    seg: jax.Array
    tree: jax.Array
    t_pad: int


def prepare_launch(q, kv_lens, page_indices, cu_q_lens, num_seqs, prefix_lens, segment_starts, block_q: int,
                   num_kv_heads: int, tree_bits=None) -> LaunchInputs:
    """Check shapes, fill the optional segment and tree inputs, pad the query rows and compute
    `q_block_metadata`.

    Raises:
        ValueError: when num_heads (q.shape[1]) is not a multiple of num_kv_heads.
    """
    T, H, D = q.shape
    if H % num_kv_heads:
        raise ValueError(f"num_heads {H} is not a multiple of num_kv_heads {num_kv_heads}")
    S = page_indices.shape[0]
    t_pad = -(-T // block_q) * block_q
    num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(())
    prefix_lens = jnp.zeros((S,), jnp.int32) if prefix_lens is None else prefix_lens.astype(jnp.int32)
    segment_starts = jnp.zeros((T,), jnp.int32) if segment_starts is None else segment_starts.astype(jnp.int32)
    seg = jnp.pad(segment_starts, (0, t_pad - T))
    tree = jnp.full((T,), NO_TREE, jnp.int32) if tree_bits is None else tree_bits.astype(jnp.int32)
    tree = jnp.pad(tree, (0, t_pad - T), constant_values=NO_TREE)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    meta = q_block_metadata(cu_q_lens, num_seqs, seg, t_pad, block_q)
    scalars = (cu_q_lens, kv_lens.astype(jnp.int32), page_indices.astype(jnp.int32).reshape(-1), prefix_lens,
               meta.first_seq, meta.last_seq, meta.seg_lo)
    return LaunchInputs(scalars, jnp.pad(q.reshape(T, H * D), ((0, t_pad - T), (0, 0))), seg.reshape(t_pad, 1),
                        tree.reshape(t_pad, 1), t_pad)


class SeqPlan(NamedTuple):
    """What one sequence does inside one query block (all int32 scalars).

    r0, r1: its rows [r0, r1) in the flat query axis; q0: its first row; pos0: KV position of row q0;
    kv_len: its KV length; prefix_len: its shared-prefix length (segment mask);
    kb_lo, n_a, b_lo, n: the KV blocks it visits, ``kb_lo + i`` for i < n_a, then ``b_lo + i - n_a`` for
    i < n (the shared prefix, then the block's own segments; blocks in between are fully masked).
    """

    r0: jax.Array
    r1: jax.Array
    q0: jax.Array
    pos0: jax.Array
    kv_len: jax.Array
    prefix_len: jax.Array
    kb_lo: jax.Array
    n_a: jax.Array
    b_lo: jax.Array
    n: jax.Array

    def kv_block(self, i):
        return jnp.where(i < self.n_a, self.kb_lo + i, self.b_lo + i - self.n_a)


def _div(a, b: int):
    """a // b for non-negative int32 a (truncating division: lowers on Mosaic without the sign op)."""
    return jax.lax.div(jnp.asarray(a, jnp.int32), jnp.int32(b))


def seq_plan(q0, q1, kv_len, prefix_len, block_start, block_q: int, seg_lo, block_kv: int,
             sliding_window: Optional[int]) -> SeqPlan:
    """Plan one sequence's work in a query block from scalars (see `SeqPlan`).

    Args:
        q0, q1: cu_q_lens[s], cu_q_lens[s + 1]; kv_len: kv_lens[s]; prefix_len: prefix_lens[s];
        block_start: first row of the block; seg_lo: the block's QBlockMeta.seg_lo; block_kv: tokens per
        KV block (whole pages).
    """
    r0 = jnp.maximum(q0, block_start)
    r1 = jnp.minimum(q1, block_start + block_q)
    pos0 = kv_len - (q1 - q0)
    first_pos = pos0 + r0 - q0
    hi = jnp.minimum(kv_len, pos0 + r1 - q0)  # one past the last row's position
    lo = jnp.maximum(first_pos - sliding_window + 1, 0) if sliding_window is not None else jnp.int32(0)
    kb_lo = _div(lo, block_kv)
    kb_hi = jnp.maximum(_div(hi + block_kv - 1, block_kv), kb_lo)
    a_hi = jnp.clip(_div(jnp.minimum(prefix_len, hi) + block_kv - 1, block_kv), kb_lo, kb_hi)
    b_lo = jnp.clip(_div(seg_lo, block_kv), a_hi, kb_hi)
    n_a = a_hi - kb_lo
    n = jnp.where(r1 > r0, n_a + kb_hi - b_lo, 0)
    return SeqPlan(r0, r1, q0, pos0, kv_len, prefix_len, kb_lo, n_a, b_lo, n)


def tree_visible(tree_bits: jax.Array, rel: jax.Array) -> jax.Array:
    """bool: whether a query row with `tree_bits` sees the key `rel` positions after its sequence's first query
    (broadcasting int32 arrays). A draft-tree row (speculative verify: its sequence's queries are the tree's
    slots, at most MAX_TREE_SLOTS) sees the keys before the tree and the slots whose bits are set (its ancestors
    and itself); a row with NO_TREE sees what the causal mask lets it."""
    bit = jnp.right_shift(tree_bits, jnp.clip(rel, 0, MAX_TREE_SLOTS - 1)) & 1
    return (tree_bits == NO_TREE) | (rel < 0) | (bit == 1)


def block_mask(plan: SeqPlan, rows: jax.Array, seg_start: jax.Array, kpos: jax.Array,
               sliding_window: Optional[int], tree_bits: Optional[jax.Array] = None) -> jax.Array:
    """bool[R, bk]: which (row, key) pairs of a KV block this sequence computes.

    rows: int32[R, 1] flat query row of each score row; seg_start, tree_bits: int32[R, 1] their segment starts
    and tree bits (`tree_visible`; None: no tree rows in the launch); kpos: int32[1, bk] KV positions of the
    block. Rows of other sequences are all False.
    """
    qpos = plan.pos0 + rows - plan.q0
    ok = (rows >= plan.r0) & (rows < plan.r1) & (kpos <= qpos) & (kpos < plan.kv_len)
    if sliding_window is not None:
        ok &= kpos > qpos - sliding_window
    ok &= (kpos < plan.prefix_len) | (kpos >= seg_start)
    if tree_bits is not None:
        ok &= tree_visible(tree_bits, kpos - plan.pos0)
    return ok


def softmax_update(m, l, acc, scores, mask, v, soft_cap: Optional[float]):
    """One online-softmax step (FlashAttention, Dao et al. 2022) that leaves masked-out rows unchanged.

    m, l: float32[R, 1]; acc: float32[R, D]; scores: float32[R, bk] (already scaled); mask: bool[R, bk];
    v: [bk, D]. Returns the new (m, l, acc).
    """
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(mask, scores, MASK_VALUE)
    m_new = jnp.maximum(m, scores.max(axis=1, keepdims=True))
    p = jnp.where(mask, jnp.exp(scores - m_new), 0.0)
    corr = jnp.exp(m - m_new)
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=_dot_precision(v.dtype),
                             preferred_element_type=jnp.float32)
    return m_new, l * corr + p.sum(axis=1, keepdims=True), acc * corr + pv


def _dot_precision(dtype):
    """HIGHEST for float32 operands, else the default. Pallas' Triton lowering runs a DEFAULT-precision float32
    dot in TF32 (10-bit mantissa inputs: errors near 1e-3); HIGHEST makes it IEEE float32.
    bfloat16/float16 operands are exact in either."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def widen(x, dtype):
    """K or V read from an fp8 KV cache (--kv-cache-dtype fp8_e4m3 / fp8_e5m2), converted to the queries' dtype
    `dtype` for the dots (exact: every float8_e4m3fn / float8_e5m2 value is a bfloat16 and float32 value); any other
    dtype unchanged. The per-KV-head scales are applied outside the kernels (layers/attention.py)."""
    if jnp.dtype(x.dtype) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)):
        return x.astype(dtype)
    return x


def qk_scores(q, k):
    """float32[R, bk] = q [R, D] @ k[bk, D]^T (float32 operands multiplied in full float32)."""
    return jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_dot_precision(q.dtype),
                               preferred_element_type=jnp.float32)


def finish(l, acc):
    """acc / l with empty rows (l == 0) giving 0."""
    return acc / jnp.where(l > 0, l, 1.0)
