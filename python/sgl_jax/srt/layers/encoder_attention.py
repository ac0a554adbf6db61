"""Bidirectional attention of encoder models (BERT, XLM-RoBERTa) over one step's tokens, without a KV cache.

An encoder sees its whole sequence at once, so every sequence of a step is computed in that step (the scheduler
never splits one: score_request.pack_seqs packs inputs to at most the largest compiled prefill and encoder servers
run without chunked prefill). A token attends to the tokens of its own sequence and, in a packed sequence, of its
own segment (`ForwardBatch.segment_starts`, the packed-scoring mask's segments), in both directions.

Computed over the whole step with a mask, a step of T tokens costs T^2 scores per head, while its segments need
only the sum of their squares (a 512-token step of 13 sentences: 512^2 against ~18k). So attention reads the
step's tokens in rows (`plan_rows`, on the host, when the model runner builds the step): the segments placed
first-fit-decreasing, none split, into n rows of R token slots, n R at least ROW_SLACK T (up to ~1.5 T for long
rows: a step nearly full of segments usually still goes into rows as short as its longest segment allows, where
T / R rows would have no room left to place them whole). Each layer gathers its queries, keys and values into the slots
(`ForwardBatch.encoder_slots`), computes attention per row (n R^2 scores rather than T^2) and gathers each
token's result back from its slot (`encoder_back`); everything else runs on the step's tokens in their own
order. A step bucket has a few static layouts (`row_layouts`); the plan takes the first (the shortest rows) that
holds every segment, else the whole-step masked form, which gathers nothing; every attention holds all of them
as branches of one `jax.lax.switch`, so no step compiles anything. The results are the same in every form (the
same keys per query; sums in another order): the layout only saves work.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.srt.forward_batch import ForwardBatch

# row lengths tried, shortest first; a step bucket uses those under its own length that save scores
ROW_SIZES = (64, 128, 256, 384, 512, 768, 1024, 2048)
ROW_SLACK = 1.125  # row slots per step token (`row_layouts`)
_MASKED = -1e30
QUERY_BLOCK = 128  # queries per block of a long row's scores (`_attend`)


def row_layouts(t_pad: int) -> Tuple[Tuple[int, int], ...]:
    """The row layouts (R, n) of a step of `t_pad` tokens, shortest rows first: n rows of R slots, n R the
    least multiple of R of at least ROW_SLACK t_pad, for every R of ROW_SIZES under t_pad whose rows hold
    fewer scores than the whole step (n R^2 < t_pad^2)."""
    out = []
    for r in ROW_SIZES:
        n = math.ceil(t_pad * ROW_SLACK / r)
        if r < t_pad and n * r * r < t_pad * t_pad:
            out.append((r, n))
    return tuple(out)


def slot_count(t_pad: int) -> int:
    """The length of a step's `encoder_slots`: the most slots of its layouts (`t_pad` when it has none)."""
    return max((r * n for r, n in row_layouts(t_pad)), default=t_pad)


def step_segments(cu_q_lens: np.ndarray, num_seqs: int, segment_starts: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(first token, length) int64 arrays of the step's segments: each sequence's runs of equal
    ``segment_starts`` (a packed sequence's inputs; an ordinary sequence is one segment)."""
    total = int(cu_q_lens[num_seqs])
    if total == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    rows = np.arange(total)
    seq = np.searchsorted(np.asarray(cu_q_lens[1:num_seqs + 1]), rows, side="right")
    ids = seq * (len(segment_starts) + 1) + np.asarray(segment_starts[:total], np.int64)
    starts = np.concatenate([[0], np.flatnonzero(np.diff(ids)) + 1])
    return starts, np.diff(np.append(starts, total))


def _first_fit(order: Sequence[int], lengths: Sequence[int], r: int, n: int):
    """The segments of `order` placed first-fit into n rows of r slots: the segment indices of each row, or
    None when one does not fit."""
    free, rows = [r] * n, [[] for _ in range(n)]
    for i in order:
        row = next((j for j in range(n) if free[j] >= lengths[i]), None)
        if row is None:
            return None
        rows[row].append(i)
        free[row] -= lengths[i]
    return rows


def plan_rows(starts: Sequence[int], lengths: Sequence[int], t_pad: int) -> Tuple[int, np.ndarray, np.ndarray]:
    """Lay a step's segments out in rows (module docstring).

    Args:
        starts, lengths: each segment's first token in the step and its tokens (`step_segments`); the segments
            cover the step's first sum(lengths) tokens, the rest are padding.
        t_pad: the step's padded tokens.
    Returns:
        (branch, slots, back): branch i < len(row_layouts(t_pad)) is the layout row_layouts(t_pad)[i],
        len(row_layouts(t_pad)) the whole-step form; slots int32[slot_count(t_pad)]: the step token in each slot
        (row j of a layout of R at slots [j R, (j + 1) R)), t_pad where empty; back int32[t_pad]: each token's
        slot, 0 for padding tokens (whose attention output is zero in every form). The whole-step form: both
        the identity (slots then t_pad beyond the step's tokens).
    """
    layouts, size = row_layouts(t_pad), slot_count(t_pad)
    longest = max(lengths, default=0)
    by_length = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    slots = np.full(size, t_pad, np.int32)
    for branch, (r, n) in enumerate(layouts):
        rows = _first_fit(by_length, lengths, r, n) if longest <= r else None
        if rows is None:
            continue
        back = np.zeros(t_pad, np.int32)
        for j, members in enumerate(rows):
            at = j * r
            for i in members:
                m, s = lengths[i], starts[i]
                slots[at:at + m] = np.arange(s, s + m)
                back[s:s + m] = np.arange(at, at + m)
                at += m
        return branch, slots, back
    slots[:t_pad] = np.arange(t_pad)
    return len(layouts), slots, np.arange(t_pad, dtype=np.int32)


def with_encoder_inputs(fb: ForwardBatch) -> ForwardBatch:
    """An encoder step's host ForwardBatch with what the encoder reads in every step: ``token_type_ids`` (zeros
    where it has none) and its row layout (``encoder_branch``, ``encoder_slots``, ``encoder_back``: `plan_rows`
    of its segments)."""
    t_pad = int(np.shape(fb.input_ids)[0])
    types = fb.token_type_ids if fb.token_type_ids is not None else np.zeros(t_pad, np.int32)
    starts, lengths = step_segments(np.asarray(fb.cu_q_lens), int(fb.num_seqs), np.asarray(fb.segment_starts))
    branch, slots, back = plan_rows(starts.tolist(), lengths.tolist(), t_pad)
    return dataclasses.replace(fb, token_type_ids=types, encoder_branch=np.asarray([branch], np.int32),
                               encoder_slots=slots, encoder_back=back)


class EncoderMask(NamedTuple):
    """What encoder attention needs of a step: ids int32[T] (`segment_ids`) and its row layout (`plan_rows`):
    branch int32[], slots int32[slot_count(T)], back int32[T]; branch None: always the whole-step form."""

    ids: jax.Array
    branch: jax.Array = None
    slots: jax.Array = None
    back: jax.Array = None


def segment_ids(fb: ForwardBatch) -> jax.Array:
    """int32[T]: one id per (sequence, segment) of the step's tokens, -1 for padding rows. Tokens attend to the
    tokens of the same id only."""
    t = fb.input_ids.shape[0]
    rows = jnp.arange(t, dtype=jnp.int32)
    seq = jnp.searchsorted(fb.cu_q_lens[1:], rows, side="right").astype(jnp.int32)
    real = rows < fb.cu_q_lens[fb.num_seqs]
    return jnp.where(real, seq * (t + 1) + fb.segment_starts, -1)


def encoder_mask(fb: ForwardBatch) -> EncoderMask:
    """The step's EncoderMask: its row layout from the ForwardBatch when the model runner planned one, else the
    whole-step form."""
    ids = segment_ids(fb)
    if fb.encoder_slots is None:
        return EncoderMask(ids)
    return EncoderMask(ids, fb.encoder_branch[0], fb.encoder_slots, fb.encoder_back)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """q, k, v float32 [n, L, heads, head_dim] (q already scaled), mask bool[n, L, L] -> [n, L, heads, head_dim]:
    softmax(q k^T) v over the allowed keys; a row with none gets some finite value. The heads are moved next to
    the rows first, so that both products are one batched matmul of n x heads (on XLA's CPU backend this ran
    the attention of a 512-token step 1.3-2.5x faster than einsums over [n, L, heads, head_dim]); rows longer
    than QUERY_BLOCK go through in blocks of that many queries (`jax.lax.map`), so that no layout's scores take
    more than n x heads x QUERY_BLOCK x L floats (a branch of a `jax.lax.switch` holding a whole 768-token step's
    scores slowed every other branch ~1.8x on XLA's CPU backend, taken or not)."""
    n, length, heads, dim = q.shape
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # [n, heads, L, head_dim]
    kt = jnp.swapaxes(k, -1, -2)

    def block(qb, mb):  # qb [n, heads, B, head_dim], mb [n, B, L]
        logits = jnp.where(mb[:, None], jnp.matmul(qb, kt), _MASKED)
        p = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
        return jnp.matmul(p, v) / jnp.sum(p, axis=-1, keepdims=True)

    if length <= QUERY_BLOCK or length % QUERY_BLOCK:
        out = block(q, mask)
    else:
        nb = length // QUERY_BLOCK
        qb = jnp.moveaxis(q.reshape(n, heads, nb, QUERY_BLOCK, dim), 2, 0)
        mb = jnp.moveaxis(mask.reshape(n, nb, QUERY_BLOCK, length), 1, 0)
        out = jax.lax.map(lambda a: block(*a), (qb, mb))  # [nb, n, heads, B, head_dim]
        out = jnp.moveaxis(out, 0, 2).reshape(n, heads, length, dim)
    return jnp.swapaxes(out, 1, 2)


def _in_rows(r: int, n: int):
    """One layout's attention: q, k, v, ids gathered into n rows of r slots, attended per row, each token's
    result gathered back from its slot."""
    def attend(q, k, v, ids, slots, back):
        t, heads, dim = q.shape
        used = slots[:n * r]
        src = jnp.minimum(used, t - 1)
        sid = jnp.where(used < t, ids[src], -1).reshape(n, r)
        mask = (sid[:, :, None] == sid[:, None, :]) & (sid[:, :, None] >= 0)
        out = _attend(*(x[src].reshape(n, r, heads, dim) for x in (q, k, v)), mask)
        return out.reshape(n * r, heads, dim)[back]
    return attend


def _whole_step(q, k, v, ids, slots=None, back=None):
    """The whole-step masked form: one row of every token, in the step's order (no gathers)."""
    mask = (ids[:, None] == ids[None, :]) & (ids[:, None] >= 0)
    return _attend(q[None], k[None], v[None], mask[None])[0]


def encoder_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: EncoderMask, scale: float) -> jax.Array:
    """softmax(q k^T * scale) v within each segment.

    Args:
        q, k, v: [T, heads, head_dim], in the step's order.
        mask: the step's EncoderMask (`encoder_mask`).
        scale: the logit scale (1 / sqrt(head_dim) for BERT).
    Returns:
        [T, heads, head_dim] in q's dtype and order; padding rows are zeros. Scores and softmax in float32.
    """
    dtype = q.dtype
    q, k, v = q.astype(jnp.float32) * scale, k.astype(jnp.float32), v.astype(jnp.float32)
    layouts = row_layouts(q.shape[0])
    if mask.branch is None or not layouts:
        out = _whole_step(q, k, v, mask.ids)
    else:
        out = jax.lax.switch(mask.branch, [_in_rows(r, n) for r, n in layouts] + [_whole_step], q, k, v,
                             mask.ids, mask.slots, mask.back)
    return jnp.where((mask.ids >= 0)[:, None, None], out, 0.0).astype(dtype)
