"""Encoder attention's row layouts (layers/encoder_attention.py): `plan_rows` gives every real token of a step one
row slot, each segment whole and in order inside one row, and each token its way back (the shortest rows that
take them in the fixed cases, a nearly full step's included); attention in the rows equals the whole-step masked
form and a float64 per-segment reference, for steps of many short segments, of a few long ones, of one longer
than every row (the whole-step form) and of padding only."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from sgl_jax.srt.layers.encoder_attention import (EncoderMask, encoder_attention, plan_rows, row_layouts,
                                                  slot_count, step_segments)

HEADS, DIM = 3, 8


def make_step(lengths, t_pad):
    """(segment starts, ids int32[t_pad]: the segment index per row, -1 for padding) of segments laid back to
    back."""
    starts = np.cumsum([0] + list(lengths[:-1])).astype(int)
    ids = np.full(t_pad, -1, np.int32)
    for i, (s, n) in enumerate(zip(starts, lengths)):
        ids[s:s + n] = i
    return starts, ids


def reference(q, k, v, ids):
    """float64 softmax(q k^T / sqrt(DIM)) v within each segment; zeros for padding rows."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    out = np.zeros_like(q)
    for s in set(ids.tolist()) - {-1}:
        rows = np.flatnonzero(ids == s)
        logits = np.einsum("qhd,khd->hqk", q[rows], k[rows]) / np.sqrt(DIM)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        out[rows] = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v[rows])
    return out


def check_plan(lengths, t_pad):
    starts, ids = make_step(lengths, t_pad)
    branch, slots, back = plan_rows(starts.tolist(), list(lengths), t_pad)
    layouts = row_layouts(t_pad)
    assert slots.shape == (slot_count(t_pad),) and back.shape == (t_pad,)
    assert slots.dtype == back.dtype == np.int32
    if branch == len(layouts):
        assert (back == np.arange(t_pad)).all() and (slots[:t_pad] == np.arange(t_pad)).all()
        return branch
    real = np.flatnonzero(ids >= 0)
    assert sorted(slots[slots < t_pad].tolist()) == real.tolist()  # every real token in one slot
    assert (slots[back[real]] == real).all()  # and each finds its own way back
    r, n = layouts[branch]
    assert slots.shape[0] >= r * n and (slots[r * n:] == t_pad).all()
    for s, m in zip(starts, lengths):  # a segment stays whole in one row, in order
        at = int(back[s])
        assert at // r == (at + m - 1) // r and (slots[at:at + m] == np.arange(s, s + m)).all()
    return branch


@pytest.mark.parametrize("seed", range(6))
def test_plan_rows_places_every_token_once_and_keeps_segments_whole(seed):
    rng = np.random.default_rng(seed)
    branches = set()
    for t_pad in (64, 256, 512, 1024):
        for hi in (8, 60, 200, 500):
            lengths = []
            while True:
                m = int(rng.integers(1, hi + 1))
                if sum(lengths) + m > t_pad:
                    break
                lengths.append(m)
            if lengths:
                branches.add((t_pad, check_plan(lengths, t_pad)))
    assert len({b for _, b in branches}) >= 3  # several layouts, and the whole-step form, were exercised


def test_step_segments_split_sequences_at_their_packed_segments():
    cu = np.array([0, 5, 9, 9], np.int32)  # 2 sequences (the third slot unused), 2 padding rows
    seg = np.array([0, 0, 2, 2, 2, 0, 1, 1, 1, 0, 0], np.int32)  # the first packs 2 inputs, the second 2
    starts, lengths = step_segments(cu, 2, seg)
    assert starts.tolist() == [0, 2, 5, 6] and lengths.tolist() == [2, 3, 1, 3]
    assert [x.tolist() for x in step_segments(cu, 0, seg)] == [[], []]


@pytest.mark.parametrize("t_pad,lengths,expected", [
    (512, [37, 12, 60, 5, 1, 44, 59, 23, 31, 58, 17, 40, 3, 50], 64),  # many short segments: rows of 64
    (512, [62] * 8 + [10], 64),  # nearly full: the ninth row of 64 (8 rows of 64, or 4 of 128, leave no room)
    (768, [335, 290, 80], 384),  # a few long ones: rows of 384
    (512, [480, 20], None),  # longer than every row length under 512: the whole-step form
    (256, [], 64),  # padding only
])
def test_rows_equal_the_whole_step_form_and_the_reference(t_pad, lengths, expected):
    starts, ids = make_step(lengths, t_pad)
    branch, slots, back = plan_rows(starts.tolist(), lengths, t_pad)
    layouts = row_layouts(t_pad)
    assert branch == ([r for r, _ in layouts].index(expected) if expected else len(layouts)), (branch, layouts)
    rng = np.random.default_rng(len(lengths))
    q, k, v = (rng.standard_normal((t_pad, HEADS, DIM)).astype(np.float32) for _ in range(3))
    attend = jax.jit(lambda q, k, v, *mask: encoder_attention(q, k, v, EncoderMask(*mask), DIM ** -0.5))
    rows = np.asarray(attend(q, k, v, jnp.asarray(ids), jnp.int32(branch), slots, back))
    whole = np.asarray(jax.jit(lambda q, k, v, ids: encoder_attention(q, k, v, EncoderMask(ids), DIM ** -0.5))(
        q, k, v, jnp.asarray(ids)))
    ref = reference(q, k, v, ids)
    assert np.abs(rows - ref).max() <= 1e-5 and np.abs(whole - ref).max() <= 1e-5
    assert (rows[ids < 0] == 0).all() and (whole[ids < 0] == 0).all()
