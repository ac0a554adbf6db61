"""Ragged paged attention (the native backend) against a direct numpy implementation of its contract: on CPU
both implementations of an extend batch, the C++ kernel and the pure-JAX loops (`ref`, the native path of other
platforms and the fallback), each test run with either (the `extend_impl` fixture)."""

import zlib

import numpy as np
import pytest

import jax.numpy as jnp

from sgl_jax.srt.kernels.ragged_paged_attention import ragged_paged_attention, write_kv_to_pages
from sgl_jax.srt.kernels.ragged_paged_attention.common import NO_TREE
from sgl_jax.srt.speculative.draft_tree import tree_mask

from rpa_batches import tree_bits_of


@pytest.fixture(params=["cpu-kernel", "pure-jax"])
def extend_impl(request, monkeypatch):
    """Which implementation runs extend batches on CPU: the C++ kernel or ref's loops (read at trace time)."""
    monkeypatch.setenv("SGL_JAX_CPU_EXTEND_KERNEL", "1" if request.param == "cpu-kernel" else "0")
    return request.param


def numpy_reference(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale,
                    sliding_window=None, soft_cap=None, segment_ids=None, tree_masks=None):
    """segment_ids: optional list (per sequence) of int arrays over its KV positions: 0 = shared prefix,
    k > 0 = item k; a query of item k sees segment 0 and segment k only (a dense mask, built the slow way).
    tree_masks: optional list (per sequence) of bool[q_len, q_len] or None: query i of the sequence sees the keys
    before its queries and the queries j with mask[i, j] (a draft tree's ancestors and itself)."""
    T, H, D = q.shape
    ps, KVH = k_pages.shape[1], k_pages.shape[2]
    out = np.zeros_like(q)
    for s in range(num_seqs):
        q0, q1, L = cu_q_lens[s], cu_q_lens[s + 1], kv_lens[s]
        slots = [page_indices[s, p // ps] * ps + p % ps for p in range(L)]
        k = k_pages.reshape(-1, KVH, D)[slots]
        v = v_pages.reshape(-1, KVH, D)[slots]
        for i, t in enumerate(range(q0, q1)):
            qpos = L - (q1 - q0) + i
            for h in range(H):
                kh = h // (H // KVH)
                sc = k[:, kh] @ q[t, h] * sm_scale
                if soft_cap is not None:
                    sc = soft_cap * np.tanh(sc / soft_cap)
                pos = np.arange(L)
                ok = pos <= qpos
                if sliding_window is not None:
                    ok &= pos > qpos - sliding_window
                if segment_ids is not None and segment_ids[s] is not None:
                    seg = segment_ids[s]
                    if seg[qpos] > 0:
                        ok &= (seg == 0) | (seg == seg[qpos])
                if tree_masks is not None and tree_masks[s] is not None:
                    first = L - (q1 - q0)
                    ok &= (pos < first) | np.concatenate([np.zeros(first, bool), tree_masks[s][i]])
                sc = np.where(ok, sc, -np.inf)
                p = np.exp(sc - sc.max())
                out[t, h] = (p / p.sum()) @ v[:, kh]
    return out


def make_batch(rng, q_lens, kv_lens, page_size, H, KVH, D, S_pad, T_pad):
    pages_per_seq = max(-(-max(kv_lens) // page_size), 1) + 2
    num_pages = 1 + sum(-(-k // page_size) for k in kv_lens) + 4
    k_pages = rng.standard_normal((num_pages, page_size, KVH, D)).astype(np.float32)
    v_pages = rng.standard_normal((num_pages, page_size, KVH, D)).astype(np.float32)
    free = list(rng.permutation(np.arange(1, num_pages)))  # scattered pages, page 0 reserved
    page_indices = np.zeros((S_pad, pages_per_seq), np.int32)
    for s, L in enumerate(kv_lens):
        for p in range(-(-L // page_size)):
            page_indices[s, p] = free.pop()
    cu = np.zeros(S_pad + 1, np.int32)
    cu[1:len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1:] = sum(q_lens)
    kl = np.zeros(S_pad, np.int32)
    kl[:len(kv_lens)] = kv_lens
    q = rng.standard_normal((T_pad, H, D)).astype(np.float32)
    return q, k_pages, v_pages, kl, page_indices, cu


CASES = [
    # name, q_lens, kv_lens, decode_only
    ("decode", [1, 1, 1, 1, 1], [1, 7, 300, 33, 129], True),
    ("prefill-one-long", [300], [300], False),
    ("extend-with-prefix", [5, 40, 1], [100, 40, 260], False),
    ("mixed-short", [1, 3, 17, 2], [64, 3, 17, 90], False),
    # rows past q_len % LONG_Q_BLOCK run in large blocks: 520 = 8 small rows + 2 large blocks, after a
    # cached prefix; 300 = 44 small rows + 1 large block
    ("extend-long-blocks", [520, 3, 300], [700, 3, 300], False),
]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name,q_lens,kv_lens,decode_only", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa3"])
def test_matches_reference(page_size, name, q_lens, kv_lens, decode_only, heads, extend_impl):
    H, KVH = heads
    D = 16
    rng = np.random.default_rng([page_size, zlib.crc32(name.encode()), H])  # fixed: no hash() of strings
    S_pad = len(q_lens) + 2  # padding sequences must be ignored
    T_pad = sum(q_lens) + 5 if not decode_only else S_pad
    q, kp, vp, kl, pi, cu = make_batch(rng, q_lens, kv_lens, page_size, H, KVH, D, S_pad, T_pad)
    out = ragged_paged_attention(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(kl),
                                 jnp.asarray(pi), jnp.asarray(cu), jnp.int32(len(q_lens)), sm_scale=D ** -0.5,
                                 decode_only=decode_only)
    ref = numpy_reference(q, kp, vp, kl, pi, cu, len(q_lens), D ** -0.5)
    n = sum(q_lens)
    np.testing.assert_allclose(np.asarray(out)[:n], ref[:n], rtol=1e-5, atol=1e-5)
    assert not np.asarray(out)[n:].any(), "padding rows must be zero"


@pytest.mark.parametrize("decode_only", [True, False])
def test_sliding_window_and_soft_cap(decode_only, extend_impl):
    rng = np.random.default_rng(7)
    q_lens = [1, 1, 1] if decode_only else [20, 1, 600]  # 600: large query blocks (LONG_Q_BLOCK) too
    kv_lens = [50, 300, 9] if decode_only else [70, 300, 640]
    H, KVH, D = 4, 2, 16
    S_pad, T_pad = 4, (4 if decode_only else 630)
    q, kp, vp, kl, pi, cu = make_batch(rng, q_lens, kv_lens, 16, H, KVH, D, S_pad, T_pad)
    kwargs = dict(sm_scale=0.3, sliding_window=33, soft_cap=5.0)
    out = ragged_paged_attention(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(kl),
                                 jnp.asarray(pi), jnp.asarray(cu), jnp.int32(3), decode_only=decode_only, **kwargs)
    ref = numpy_reference(q, kp, vp, kl, pi, cu, 3, **kwargs)
    n = sum(q_lens)
    np.testing.assert_allclose(np.asarray(out)[:n], ref[:n], rtol=1e-5, atol=1e-5)


def test_write_kv_to_pages_scatters_slots():
    kp = jnp.zeros((4, 2, 1, 3))
    vp = jnp.zeros((4, 2, 1, 3))
    k = jnp.arange(9, dtype=jnp.float32).reshape(3, 1, 3) + 1
    kp2, vp2 = write_kv_to_pages(kp, vp, k, -k, jnp.asarray([3, 4, 0], jnp.int32))
    flat = np.asarray(kp2).reshape(8, 1, 3)
    np.testing.assert_array_equal(flat[3], np.asarray(k[0]))
    np.testing.assert_array_equal(flat[4], np.asarray(k[1]))
    np.testing.assert_array_equal(np.asarray(vp2).reshape(8, 1, 3)[4], -np.asarray(k[1]))
    assert not flat[[1, 2, 5, 6, 7]].any()


def test_write_kv_to_pages_updates_the_donated_cache_in_place():
    """Under jit with the cache donated (as the model runner's step does), the write reuses the cache's
    buffers: no copy of the whole cache per step (the KV-write part of the attention contract)."""
    import jax

    kp = jnp.zeros((1024, 16, 2, 64))
    vp = jnp.ones((1024, 16, 2, 64))
    ptrs = (kp.unsafe_buffer_pointer(), vp.unsafe_buffer_pointer())
    write = jax.jit(write_kv_to_pages, donate_argnums=(0, 1))
    k = jnp.full((8, 2, 64), 3.0)
    loc = jnp.arange(100, 108, dtype=jnp.int32)
    kp2, vp2 = write(kp, vp, k, -k, loc)
    assert (kp2.unsafe_buffer_pointer(), vp2.unsafe_buffer_pointer()) == ptrs
    assert kp.is_deleted() and vp.is_deleted()
    np.testing.assert_array_equal(np.asarray(kp2[6, 4:12]), 3.0)
    assert float(jnp.abs(kp2).sum()) == 8 * 2 * 64 * 3.0
    # the compiled program has no copy of a cache-sized buffer
    hlo = write.lower(jnp.zeros((1024, 16, 2, 64)), jnp.zeros((1024, 16, 2, 64)), k, -k, loc).compile().as_text()
    assert not [ln for ln in hlo.splitlines() if " copy(" in ln and "f32[1024,16,2,64]" in ln.split("copy(")[0]]


def segment_layout(prefix_len, item_lens):
    """(segment id per KV position, segment start per KV position) of a packed multi-item sequence."""
    ids, starts = [0] * prefix_len, [0] * prefix_len
    for k, n in enumerate(item_lens, start=1):
        starts += [len(ids)] * n
        ids += [k] * n
    return np.asarray(ids), np.asarray(starts, np.int32)


@pytest.mark.parametrize("page_size", [1, 16])
def test_segment_mask_matches_dense_reference(page_size, extend_impl):
    """Packed multi-item sequences (one whole, one as a later chunk that starts mid-item) next to an
    ordinary sequence: the segment-start representation equals the dense segment-id mask."""
    rng = np.random.default_rng(11 + page_size)
    H, KVH, D = 6, 2, 16
    packs = [(150, [20, 7, 33, 1, 45, 20]), (40, [9] * 30), None]
    full_lens = [p + sum(items) for p, items in packs[:2]] + [90]
    q_lens = [full_lens[0], 130, 17]  # the second pack computes only its last 130 positions (a chunk)
    S_pad, T_pad = 4, sum(q_lens) + 3
    q, kp, vp, kl, pi, cu = make_batch(rng, q_lens, full_lens, page_size, H, KVH, D, S_pad, T_pad)
    prefix_lens = np.zeros(S_pad, np.int32)
    starts = np.zeros(T_pad, np.int32)
    seg_ids = []
    for s, pack in enumerate(packs):
        if pack is None:
            seg_ids.append(None)
            continue
        ids, st = segment_layout(*pack)
        seg_ids.append(ids)
        prefix_lens[s] = pack[0]
        starts[cu[s]:cu[s + 1]] = st[full_lens[s] - q_lens[s]:]
    out = ragged_paged_attention(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(kl),
                                 jnp.asarray(pi), jnp.asarray(cu), jnp.int32(3), sm_scale=D ** -0.5,
                                 prefix_lens=jnp.asarray(prefix_lens), segment_starts=jnp.asarray(starts))
    ref = numpy_reference(q, kp, vp, kl, pi, cu, 3, D ** -0.5, segment_ids=seg_ids)
    n = sum(q_lens)
    np.testing.assert_allclose(np.asarray(out)[:n], ref[:n], rtol=1e-5, atol=1e-5)
    plain = numpy_reference(q, kp, vp, kl, pi, cu, 3, D ** -0.5)
    assert not np.allclose(ref[:q_lens[0]], plain[:q_lens[0]], atol=1e-3), "the mask must matter"


def shared_prefix_batch(rng, shared_len, own_lens, q_lens, page_size, H, KVH, D, T_pad):
    """A batch whose sequences all start with the same `shared_len` KV positions (the same pages, as a
    radix-cache hit or a scoring-cache handle gives), then `own_lens` positions of their own, of which the
    last `q_lens` are this step's queries."""
    kv_lens = [shared_len + n for n in own_lens]
    S_pad = len(q_lens) + 1
    q, kp, vp, kl, pi, cu = make_batch(rng, q_lens, kv_lens, page_size, H, KVH, D, S_pad, T_pad)
    pi[1:len(q_lens), :shared_len // page_size] = pi[0, :shared_len // page_size]
    return q, kp, vp, kl, pi, cu


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("variant", ["plain", "window-softcap"])
def test_shared_prefix_matches_reference(page_size, variant, extend_impl):
    """Cascade attention over a shared prefix longer than one shared-prefix KV block, with more query rows
    than one shared-prefix query block, gives the same output as the per-sequence path and as numpy."""
    rng = np.random.default_rng(5 + page_size)
    H, KVH, D = 6, 2, 16
    shared = 1120  # a multiple of both page sizes; > SHARED_KV_BLOCK
    q_lens = [40, 1, 33, 60, 20]
    own_lens = [40, 9, 50, 60, 20]  # sequence 1 and 2 have KV of their own before their queries
    T_pad = sum(q_lens) + 7
    q, kp, vp, kl, pi, cu = shared_prefix_batch(rng, shared, own_lens, q_lens, page_size, H, KVH, D, T_pad)
    kwargs = dict(sm_scale=D ** -0.5)
    if variant == "window-softcap":
        kwargs.update(sliding_window=70, soft_cap=4.0)
    args = [jnp.asarray(a) for a in (q, kp, vp, kl, pi, cu)] + [jnp.int32(len(q_lens))]
    out = np.asarray(ragged_paged_attention(*args, shared_prefix_len=jnp.int32(shared), **kwargs))
    plain = np.asarray(ragged_paged_attention(*args, **kwargs))
    ref = numpy_reference(q, kp, vp, kl, pi, cu, len(q_lens), **kwargs)
    n = sum(q_lens)
    np.testing.assert_allclose(out[:n], ref[:n], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[:n], plain[:n], rtol=1e-5, atol=1e-5)
    assert not out[n:].any(), "padding rows must be zero"


def test_shared_prefix_with_segments(extend_impl):
    """A packed multi-item chunk whose earlier chunk (the query, then the start of the items) is cached:
    the shared prefix covers part of the query only and the segment mask still holds."""
    rng = np.random.default_rng(3)
    H, KVH, D = 6, 2, 16
    prefix, items = 300, [20, 7, 33, 45, 20]
    full = prefix + sum(items)
    q_len = full - 256  # this step starts at position 256, inside the query
    T_pad = q_len + 3
    q, kp, vp, kl, pi, cu = make_batch(rng, [q_len], [full], 16, H, KVH, D, 2, T_pad)
    ids, st = segment_layout(prefix, items)
    starts = np.zeros(T_pad, np.int32)
    starts[:q_len] = st[256:]
    prefix_lens = np.asarray([prefix, 0], np.int32)
    args = [jnp.asarray(a) for a in (q, kp, vp, kl, pi, cu)] + [jnp.int32(1)]
    seg = dict(prefix_lens=jnp.asarray(prefix_lens), segment_starts=jnp.asarray(starts))
    out = np.asarray(ragged_paged_attention(*args, sm_scale=D ** -0.5, shared_prefix_len=jnp.int32(256), **seg))
    ref = numpy_reference(q, kp, vp, kl, pi, cu, 1, D ** -0.5, segment_ids=[ids])
    np.testing.assert_allclose(out[:q_len], ref[:q_len], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_size", [1, 16])
def test_draft_tree_mask_matches_dense_reference(page_size, extend_impl):
    """Speculative verify rows: a bushy draft tree, a chain, a full 32-slot tree (bit 31 set) and an ordinary
    40-token extend (NO_TREE rows past 32 positions) in one batch; each tree slot sees the KV before its tree and
    its ancestors only."""
    rng = np.random.default_rng(5 + page_size)
    H, KVH, D = 6, 2, 16
    bushy = np.array([-1, 0, 0, 1, 1, 2, 4])
    chain = np.array([-1, 0, 1, 2, 3])
    full = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, 32)])
    trees = [bushy, chain, full, None]
    q_lens = [7, 5, 32, 40]
    kv_lens = [57, 5, 100, 90]
    S_pad, T_pad = 5, sum(q_lens) + 3
    q, kp, vp, kl, pi, cu = make_batch(rng, q_lens, kv_lens, page_size, H, KVH, D, S_pad, T_pad)
    masks = [None if t is None else tree_mask(t) for t in trees]
    bits = np.full(T_pad, NO_TREE, np.int32)
    for s, m in enumerate(masks):
        if m is not None:
            bits[cu[s]:cu[s + 1]] = tree_bits_of(trees[s])
    assert bits[cu[2] + 31] < 0 and bits[cu[2] + 31] != NO_TREE  # slot 31: the sign bit, not all ones
    out = ragged_paged_attention(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(kl),
                                 jnp.asarray(pi), jnp.asarray(cu), jnp.int32(4), sm_scale=D ** -0.5,
                                 tree_bits=jnp.asarray(bits))
    ref = numpy_reference(q, kp, vp, kl, pi, cu, 4, D ** -0.5, tree_masks=masks)
    n = sum(q_lens)
    np.testing.assert_allclose(np.asarray(out)[:n], ref[:n], rtol=1e-5, atol=1e-5)
    plain = numpy_reference(q, kp, vp, kl, pi, cu, 4, D ** -0.5)
    assert not np.allclose(ref[:7], plain[:7], atol=1e-3), "the tree mask must matter"
    np.testing.assert_allclose(ref[7:12], plain[7:12], rtol=1e-6)  # a chain's tree mask is the causal mask
