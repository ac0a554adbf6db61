"""The CPU decode attention kernel (C++ through JAX's FFI, `kernels/ragged_paged_attention/cpu.py`) against the
pure-JAX path it replaces (`ref`, itself checked against numpy in test_ragged_paged_attention.py).

The kernel must be built (setup.py builds it at install): a missing kernel fails here, it never skips.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax.srt.kernels.ragged_paged_attention import cpu, ragged_paged_attention, ref

pytestmark = pytest.mark.timeout(300)


def paged_batch(rng, kv_lens, page_size, KVH, D, S_pad, dtype, garbage_tail=True):
    """A cache holding each sequence's keys on shuffled pages, and its page table; table entries past a
    sequence's pages hold out-of-range page numbers (they must never be read)."""
    pages_per_seq = max(-(-max(kv_lens) // page_size), 1) + 1
    num_pages = 1 + sum(-(-k // page_size) for k in kv_lens)
    k_pages = rng.standard_normal((num_pages, page_size, KVH, D)).astype(np.float32)
    v_pages = rng.standard_normal((num_pages, page_size, KVH, D)).astype(np.float32)
    free = list(rng.permutation(np.arange(1, num_pages)))
    fill = 10 ** 8 if garbage_tail else 0
    page_indices = np.full((S_pad, pages_per_seq), fill, np.int32)
    for s, L in enumerate(kv_lens):
        for p in range(-(-L // page_size)):
            page_indices[s, p] = free.pop()
    kl = np.ones(S_pad, np.int32)
    kl[:len(kv_lens)] = kv_lens
    return (jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype), jnp.asarray(kl), jnp.asarray(page_indices))


def both(q, k, v, kl, pi, num_seqs, **kw):
    """(kernel, pure JAX) outputs of the same decode call, as float32 numpy arrays."""
    got = jax.jit(lambda *a: cpu.decode_attention(*a, **kw))(q, k, v, kl, pi, jnp.int32(num_seqs))
    want = jax.jit(lambda *a: ref.ragged_paged_attention(*a, decode_only=True, **kw))(
        q, k, v, kl, pi, jnp.zeros(pi.shape[0] + 1, jnp.int32), jnp.int32(num_seqs))
    assert got.dtype == q.dtype and got.shape == q.shape
    return np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))


def test_kernel_is_built_and_loads():
    assert cpu.library_path() is not None, "the CPU decode kernel was not built: reinstall with `pip install -e .`"
    assert cpu.enabled()


CASES = [  # name, heads (H, KVH, D), page_size, kv_lens, S_pad, T
    ("gqa3-d64-page1", (9, 3, 64), 1, [1, 2, 37, 300, 1500], 8, 8),
    ("gqa3-d64-page16", (9, 3, 64), 16, [1, 15, 16, 17, 700], 6, 6),
    ("mha-d128-page4", (4, 4, 128), 4, [5, 129, 260], 4, 4),
    ("gqa8-d256-page16", (16, 2, 256), 16, [33, 1000], 2, 2),
    ("odd-head-dim-80", (6, 2, 80), 8, [7, 90, 333], 3, 3),  # not a compiled-in head size: the generic loop
    ("fewer-rows-than-seqs", (9, 3, 64), 16, [40, 50, 60, 70], 6, 3),  # T < S: rows past T dropped
    ("more-rows-than-seqs", (9, 3, 64), 16, [40, 50], 4, 9),  # padding rows stay zero
    ("one-long-sequence", (9, 3, 64), 16, [6000], 1, 1),  # one sequence: its context split across threads
]


@pytest.mark.parametrize("name,heads,page_size,kv_lens,S_pad,T", CASES, ids=[c[0] for c in CASES])
def test_matches_pure_jax(name, heads, page_size, kv_lens, S_pad, T):
    H, KVH, D = heads
    rng = np.random.default_rng(len(name))
    k, v, kl, pi = paged_batch(rng, kv_lens, page_size, KVH, D, S_pad, jnp.float32)
    q = jnp.asarray(rng.standard_normal((T, H, D)).astype(np.float32))
    got, want = both(q, k, v, kl, pi, len(kv_lens), sm_scale=D ** -0.5)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    assert np.all(got[min(len(kv_lens), T):] == 0)


@pytest.mark.parametrize("window,soft_cap", [(64, None), (None, 30.0), (200, 50.0), (1, None)])
def test_sliding_window_and_soft_cap(window, soft_cap):
    rng = np.random.default_rng(7)
    kv_lens = [1, 63, 64, 65, 500, 3000]
    k, v, kl, pi = paged_batch(rng, kv_lens, 16, 1, 64, 8, jnp.float32)
    q = jnp.asarray(3 * rng.standard_normal((8, 4, 64)).astype(np.float32))  # large scores: the cap bites
    got, want = both(q, k, v, kl, pi, len(kv_lens), sm_scale=0.125, sliding_window=window, soft_cap=soft_cap)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("q_dtype,kv_dtype", [("bfloat16", "bfloat16"), ("float32", "bfloat16"),
                                              ("bfloat16", "float32")])
def test_bfloat16(q_dtype, kv_dtype):
    rng = np.random.default_rng(3)
    k, v, kl, pi = paged_batch(rng, [10, 400, 1200], 16, 3, 64, 4, kv_dtype)
    q = jnp.asarray(rng.standard_normal((4, 9, 64)).astype(np.float32), q_dtype)
    got, want = both(q, k, v, kl, pi, 3, sm_scale=0.125)
    # ref converts blocks to q's dtype before its float32 softmax; the kernel reads them as float32: the same
    # values when either side is float32, and within bfloat16's rounding when q is bfloat16.
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def test_native_backend_runs_it_for_decode_only():
    """The model's call (backend "native") compiles to the kernel's custom call for decode batches, and to the
    pure-JAX path for extend batches or where SGL_JAX_CPU_DECODE_KERNEL=0."""
    rng = np.random.default_rng(0)
    k, v, kl, pi = paged_batch(rng, [20, 30], 16, 3, 64, 2, jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, 9, 64)).astype(np.float32))
    args = (q, k, v, kl, pi, jnp.asarray([0, 1, 2], jnp.int32), jnp.int32(2))

    def hlo(decode_only):
        f = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.125, decode_only=decode_only, backend="native"))
        return f.lower(*args).as_text()

    assert cpu.TARGET in hlo(True)
    assert cpu.TARGET not in hlo(False)
    assert_switch_turns_it_off("SGL_JAX_CPU_DECODE_KERNEL", "_cpu_decode_kernel")


def assert_switch_turns_it_off(variable: str, chooser: str):
    """In a fresh process (the switch is read from the environment), `backend.<chooser>` says False with
    ``<variable>=0`` and True with ``<variable>=1``."""
    code = ("import jax.numpy as jnp; from sgl_jax.srt.kernels.ragged_paged_attention import backend; "
            f"print(backend.{chooser}(jnp.float32, jnp.float32))")
    for switch, expect in (("0", "False"), ("1", "True")):
        env = dict(os.environ, JAX_PLATFORMS="cpu", **{variable: switch})
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert r.stdout.strip().splitlines()[-1] == expect, r.stderr[-2000:]


def test_a_sequence_gets_the_same_bits_in_any_batch():
    """Batch invariance: a sequence's output does not depend on what it is batched with (the context splits
    follow its own length only), which the KV cache tests' identical-output checks rely on."""
    rng = np.random.default_rng(11)
    kv_lens = [3000, 700, 1500, 40]
    k, v, kl, pi = paged_batch(rng, kv_lens, 16, 3, 64, 4, jnp.float32)
    q = jnp.asarray(rng.standard_normal((4, 9, 64)).astype(np.float32))
    f = jax.jit(lambda *a: cpu.decode_attention(*a, sm_scale=0.125))
    together = np.asarray(f(q, k, v, kl, pi, jnp.int32(4)))
    for s in range(4):
        alone = np.asarray(f(q[s:s + 1], k, v, kl[s:s + 1], pi[s:s + 1], jnp.int32(1)))
        np.testing.assert_array_equal(alone[0], together[s])


@pytest.mark.parametrize("page_size", [1, 16])
def test_bfloat16_kv_write_is_the_scatter_in_place(page_size):
    """A bfloat16 cache's K/V write (`ref.write_kv_to_pages`) runs the kernel's in-place row copy: the rows the
    scatter would write land in their slots (a slot outside the pages writes nothing, as the scatter's
    mode="drop"), and the compiled write of a donated cache keeps its buffer and has no float32 copy of it (XLA's
    own bfloat16 scatter on CPU converted the whole cache to float32 and back, every step)."""
    rng = np.random.default_rng(3)
    N, KVH, D, T = 64, 2, 16, 5
    k0 = rng.standard_normal((N, page_size, KVH, D)).astype(np.float32)
    v0 = rng.standard_normal((N, page_size, KVH, D)).astype(np.float32)
    k = rng.standard_normal((T, KVH, D)).astype(np.float32)
    v = rng.standard_normal((T, KVH, D)).astype(np.float32)
    loc = np.array([7, 0, N * page_size - 1, N * page_size + 3, 3 * page_size + 1], np.int32)  # one outside
    assert cpu.writes_kv(jnp.bfloat16) and not cpu.writes_kv(jnp.float32)
    write = jax.jit(ref.write_kv_to_pages, donate_argnums=(0, 1))
    kp, vp = (jnp.asarray(x, jnp.bfloat16) for x in (k0, v0))
    txt = write.lower(kp, vp, jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16), loc).compile().as_text()
    assert f"f32[{N},{page_size}" not in txt and "custom-call" in txt
    pointer = kp.unsafe_buffer_pointer()
    kp, vp = write(kp, vp, jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16), jnp.asarray(loc))
    assert kp.unsafe_buffer_pointer() == pointer
    want_k, want_v = (np.array(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in (k0, v0))
    for t, slot in enumerate(loc):
        if slot < N * page_size:
            want_k[slot // page_size, slot % page_size] = np.asarray(jnp.asarray(k[t], jnp.bfloat16), np.float32)
            want_v[slot // page_size, slot % page_size] = np.asarray(jnp.asarray(v[t], jnp.bfloat16), np.float32)
    np.testing.assert_array_equal(np.asarray(kp.astype(jnp.float32)), want_k)
    np.testing.assert_array_equal(np.asarray(vp.astype(jnp.float32)), want_v)
