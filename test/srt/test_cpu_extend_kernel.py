"""The CPU extend attention kernel (C++ through JAX's FFI, `cpu.extend_attention`) against the pure-JAX path it
replaces on CPU (`ref`; both are checked against numpy in test_ragged_paged_attention.py, which runs each).

The kernel must be built (setup.py builds it at install): a missing kernel fails here, it never skips.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax.srt.kernels.ragged_paged_attention import cpu, ragged_paged_attention, ref
from sgl_jax.srt.kernels.ragged_paged_attention.common import NO_TREE

from test_cpu_decode_kernel import assert_switch_turns_it_off, paged_batch

pytestmark = pytest.mark.timeout(300)


def extend_batch(rng, q_lens, kv_lens, page_size, heads, dtype=jnp.float32, T_extra=3):
    """q [sum(q_lens) + T_extra, H, D], the paged cache and table (one padding sequence), cu_q_lens."""
    H, KVH, D = heads
    S_pad = len(kv_lens) + 1
    k, v, kl, pi = paged_batch(rng, kv_lens, page_size, KVH, D, S_pad, dtype)
    T = sum(q_lens) + T_extra
    q = jnp.asarray(rng.standard_normal((T, H, D)).astype(np.float32), dtype)
    cu = np.zeros(S_pad + 1, np.int32)
    cu[1:len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1:] = sum(q_lens)
    return q, k, v, kl, pi, jnp.asarray(cu)


def both(q, k, v, kl, pi, cu, num_seqs, **kw):
    """(kernel, pure JAX) outputs of the same extend call, as float32 numpy arrays."""
    args = (q, k, v, kl, pi, cu, jnp.int32(num_seqs))
    got = jax.jit(lambda *a: cpu.extend_attention(*a, **kw))(*args)
    want = jax.jit(lambda *a: ref.ragged_paged_attention(*a, **kw))(*args)
    assert got.dtype == q.dtype and got.shape == q.shape
    return np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))


def test_kernel_is_built_and_registered():
    assert cpu.library_path() is not None, "the CPU kernels were not built: reinstall with `pip install -e .`"
    assert cpu.extend_enabled()


CASES = [  # name, heads (H, KVH, D), page_size, q_lens, kv_lens
    ("smollm2-prefill", (9, 3, 64), 16, [300], [300]),
    ("smollm2-extend-and-decode-rows", (9, 3, 64), 16, [1, 70, 1, 33], [500, 170, 9, 33]),
    ("page1-many-short", (4, 4, 32), 1, [3, 5, 1, 7, 2], [3, 40, 100, 7, 260]),
    ("gqa8-d256", (16, 2, 256), 16, [40, 9], [200, 9]),
    ("odd-head-dim-20", (6, 2, 20), 8, [37, 129], [90, 129]),  # not a multiple of 8: the plain-loop columns
    ("rows-across-blocks", (2, 1, 16), 4, [65, 64, 63], [1000, 64, 400]),  # 64-row items, keys past one block
]


@pytest.mark.parametrize("name,heads,page_size,q_lens,kv_lens", CASES, ids=[c[0] for c in CASES])
def test_matches_pure_jax(name, heads, page_size, q_lens, kv_lens):
    rng = np.random.default_rng(len(name))
    q, k, v, kl, pi, cu = extend_batch(rng, q_lens, kv_lens, page_size, heads)
    got, want = both(q, k, v, kl, pi, cu, len(q_lens), sm_scale=heads[2] ** -0.5)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    assert not got[sum(q_lens):].any(), "padding rows must be zero"


@pytest.mark.parametrize("window,soft_cap", [(64, None), (None, 30.0), (200, 50.0), (1, None)])
def test_sliding_window_and_soft_cap(window, soft_cap):
    rng = np.random.default_rng(7)
    q_lens, kv_lens = [1, 63, 64, 300, 500], [1, 63, 100, 900, 500]
    q, k, v, kl, pi, cu = extend_batch(rng, q_lens, kv_lens, 16, (4, 1, 64))
    q = 3 * q  # large scores: the cap bites
    got, want = both(q, k, v, kl, pi, cu, len(q_lens), sm_scale=0.125, sliding_window=window, soft_cap=soft_cap)
    # atol 1e-5: XLA's tanh and libm's differ in their last bits, which the cap scales by up to 50
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5)


def test_segments_and_draft_trees():
    """Multi-item scoring's segment mask (a packed sequence whose items see the prefix and themselves) beside a
    draft tree's rows (each slot sees the keys before the tree, its ancestors and itself) and an ordinary
    extend."""
    rng = np.random.default_rng(5)
    prefix, items = 150, [20, 7, 33, 1, 45, 20]
    q_lens, kv_lens = [prefix + sum(items), 5, 40], [prefix + sum(items), 30, 90]
    q, k, v, kl, pi, cu = extend_batch(rng, q_lens, kv_lens, 16, (6, 2, 16))
    T = q.shape[0]
    starts = np.zeros(T, np.int32)
    pos = prefix
    for n in items:
        starts[pos:pos + n] = pos
        pos += n
    bits = np.full(T, NO_TREE, np.int32)
    bits[q_lens[0]:q_lens[0] + 5] = [1, 3, 5, 11, 19]  # a root, two children, a grandchild, a great-grandchild
    kw = dict(sm_scale=0.25, prefix_lens=jnp.asarray([prefix, 0, 0, 0], jnp.int32),
              segment_starts=jnp.asarray(starts), tree_bits=jnp.asarray(bits))
    got, want = both(q, k, v, kl, pi, cu, 3, **kw)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    plain, _ = both(q, k, v, kl, pi, cu, 3, sm_scale=0.25)
    assert not np.allclose(got[prefix:q_lens[0]], plain[prefix:q_lens[0]], atol=1e-3), "segments must matter"
    tree_rows = slice(q_lens[0] + 1, q_lens[0] + 5)
    assert not np.allclose(got[tree_rows], plain[tree_rows], atol=1e-3), "the tree must matter"


@pytest.mark.parametrize("q_dtype,kv_dtype", [("bfloat16", "bfloat16"), ("float32", "bfloat16"),
                                              ("bfloat16", "float32")])
def test_bfloat16(q_dtype, kv_dtype):
    rng = np.random.default_rng(3)
    H, KVH, D = 9, 3, 64
    q_lens, kv_lens = [10, 200, 1], [10, 400, 1200]
    k, v, kl, pi = paged_batch(rng, kv_lens, 16, KVH, D, 4, kv_dtype)
    q = jnp.asarray(rng.standard_normal((sum(q_lens) + 2, H, D)).astype(np.float32), q_dtype)
    cu = jnp.asarray([0, 10, 210, 211, 211], jnp.int32)
    got, want = both(q, k, v, kl, pi, cu, 3, sm_scale=0.125)
    # ref converts blocks to q's dtype before its float32 softmax; the kernel reads them as float32: the same
    # values when either side is float32, and within bfloat16's rounding when q is bfloat16.
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def test_a_sequence_gets_the_same_bits_in_any_batch():
    """Batch invariance: a sequence's rows do not depend on what it is batched with (work items are its own
    query blocks, key blocks at fixed positions), which the KV cache tests' identical-output checks rely on."""
    rng = np.random.default_rng(11)
    q_lens, kv_lens = [100, 1, 37, 300], [900, 700, 37, 300]
    q, k, v, kl, pi, cu = extend_batch(rng, q_lens, kv_lens, 16, (9, 3, 64), T_extra=0)
    f = jax.jit(lambda *a: cpu.extend_attention(*a, sm_scale=0.125))
    together = np.asarray(f(q, k, v, kl, pi, cu, jnp.int32(4)))
    cu = np.asarray(cu)
    for s in range(4):
        rows = slice(cu[s], cu[s + 1])
        alone = np.asarray(f(q[rows], k, v, kl[s:s + 1], pi[s:s + 1], jnp.asarray([0, q_lens[s]], jnp.int32),
                             jnp.int32(1)))
        np.testing.assert_array_equal(alone, together[rows])


def test_native_backend_runs_it_for_extend_batches():
    """The model's call (backend "native") compiles an extend batch, a draft tree's included, to one custom call
    of the kernel (and a decode batch to the decode kernel's), and to the pure-JAX loops where
    SGL_JAX_CPU_EXTEND_KERNEL=0: an extend program then holds hundreds of instructions more per layer."""
    rng = np.random.default_rng(0)
    q, k, v, kl, pi, cu = extend_batch(rng, [20, 30], [20, 40], 16, (9, 3, 64))
    args = (q, k, v, kl, pi, cu, jnp.int32(2))

    def hlo(**kw):
        f = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.125, backend="native", **kw))
        return f.lower(*args).as_text()

    assert cpu.EXTEND_TARGET in hlo() and cpu.TARGET not in hlo()
    assert cpu.EXTEND_TARGET in hlo(tree_bits=jnp.full((q.shape[0],), NO_TREE, jnp.int32))
    assert cpu.EXTEND_TARGET not in hlo(decode_only=True)
    assert_switch_turns_it_off("SGL_JAX_CPU_EXTEND_KERNEL", "_cpu_extend_kernel")
    pure = jax.jit(lambda *a: ref.ragged_paged_attention(*a, sm_scale=0.125)).lower(*args).as_text()
    kernel = hlo()
    count = lambda text: len(re.findall(r"^\s*%\S+ = ", text, re.M))  # noqa: E731
    assert count(pure) > count(kernel) + 300, (count(pure), count(kernel))


def test_a_row_gets_the_same_bits_whichever_rows_share_its_step():
    """A row's output does not depend on which other rows of its sequence are computed in the same step: a prefill
    of the whole sequence and an extend of its last rows over the cached rest (a radix-cache hit) give the same bits
    for those rows, so a cached prefix changes no output (the embeddings tests compare a text alone and batched,
    bit for bit)."""
    rng = np.random.default_rng(13)
    L = 300
    q, k, v, kl, pi, _ = extend_batch(rng, [L], [L], 16, (9, 3, 64), T_extra=0)
    kl, pi = kl[:1], pi[:1]
    f = jax.jit(lambda *a: cpu.extend_attention(*a, sm_scale=0.125))
    full = np.asarray(f(q, k, v, kl, pi, jnp.asarray([0, L], jnp.int32), jnp.int32(1)))
    for n in (1, 5, 17, 100, 299):
        tail = np.asarray(f(q[L - n:], k, v, kl, pi, jnp.asarray([0, n], jnp.int32), jnp.int32(1)))
        np.testing.assert_array_equal(tail, full[L - n:], err_msg=f"last {n} rows")
