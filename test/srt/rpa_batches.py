"""Random ragged batches for the ragged paged attention kernels, and the check of a kernel's output against the
pure-JAX reference: shared by the interpreted kernel tests (test_ragged_paged_attention_pallas.py) and the
on-device GPU kernel tests (test_ragged_paged_attention_gpu.py).

Tolerances (max |kernel - reference| over the output): float32 2e-5 + 2e-5 * |ref|; bfloat16 2e-2 + 2e-2
* |ref| (both sides round P to bfloat16 before P @ V and the output to bfloat16, in different orders).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.srt.kernels.ragged_paged_attention.common import NO_TREE
from sgl_jax.srt.kernels.ragged_paged_attention.ref import ragged_paged_attention as reference
from sgl_jax.srt.speculative.draft_tree import tree_bits, tree_mask

TOL = {"float32": 2e-5, "bfloat16": 2e-2}
S_PAD, T_PAD = 5, 48  # fixed padded shapes: fewer distinct programs to compile


tree_bits_of = tree_bits  # (the production packing, speculative/draft_tree.py)


def make_batch(seed, kind, page_size, head_dim, group, num_kv_heads, dtype, segments, trees=False):
    """A random ragged batch: (args, kwargs) for ragged_paged_attention; pages scattered over the cache. With
    `trees`, every other sequence's queries are the slots of a random draft tree (speculative verify rows)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, S_PAD))  # 1 .. S_PAD - 1 sequences; the rest is padding
    q_lens, kv_lens = [], []
    for i in range(n):
        decode = kind == "decode" or (kind == "mixed" and i % 2 == 0)
        q_len = 1 if decode else int(rng.integers(1, 24))
        q_lens.append(q_len)
        kv_lens.append(q_len + int(rng.integers(0, 160)))
    if kind != "decode":
        while sum(q_lens) > T_PAD:
            q_lens[q_lens.index(max(q_lens))] //= 2
        kv_lens = [max(k, q) for k, q in zip(kv_lens, q_lens)]
    pages_per_seq = -(-max(kv_lens) // page_size) + 1
    num_pages = 1 + sum(-(-k // page_size) for k in kv_lens) + 2
    H, D = num_kv_heads * group, head_dim
    k_pages = rng.standard_normal((num_pages, page_size, num_kv_heads, D)).astype(np.float32)
    v_pages = rng.standard_normal((num_pages, page_size, num_kv_heads, D)).astype(np.float32)
    free = list(rng.permutation(np.arange(1, num_pages)))
    # garbage past each sequence's pages (the contract says those entries are ignored)
    page_indices = rng.integers(-5, 10**6, (S_PAD, pages_per_seq)).astype(np.int32)
    for s, L in enumerate(kv_lens):
        for p in range(-(-L // page_size)):
            page_indices[s, p] = free.pop()
    cu = np.zeros(S_PAD + 1, np.int32)
    cu[1:n + 1] = np.cumsum(q_lens)
    cu[n + 1:] = T_PAD if kind != "decode" else S_PAD
    kl = np.zeros(S_PAD, np.int32)
    kl[:n] = kv_lens
    T = T_PAD if kind != "decode" else S_PAD
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    prefix_lens = np.zeros(S_PAD, np.int32)
    seg = np.zeros(T, np.int32)
    if segments:  # sequence 0 becomes a packed multi-item sequence: a prefix, then items of 2..9 tokens
        L, q_len = kv_lens[0], q_lens[0]
        prefix = int(rng.integers(1, L)) if L > 1 else 0
        prefix_lens[0] = prefix
        starts, pos = [], prefix
        while pos < L:
            starts.append(pos)
            pos += int(rng.integers(2, 10))
        for i in range(q_len):
            qpos = L - q_len + i
            seg[i] = 0 if qpos < prefix else max(s for s in starts if s <= qpos)
    dt = jnp.dtype(dtype)
    args = (jnp.asarray(q, dt), jnp.asarray(k_pages, dt), jnp.asarray(v_pages, dt), jnp.asarray(kl),
            jnp.asarray(page_indices), jnp.asarray(cu), jnp.asarray(n, jnp.int32))
    kwargs = dict(sm_scale=D ** -0.5, decode_only=kind == "decode")
    if segments:
        kwargs.update(prefix_lens=jnp.asarray(prefix_lens), segment_starts=jnp.asarray(seg))
    if trees:
        bits = np.full(T, NO_TREE, np.int32)
        for s in range(0, n, 2):
            q_len = q_lens[s]
            parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, q_len)])
            bits[cu[s]:cu[s + 1]] = tree_bits_of(parents)
        kwargs.update(tree_bits=jnp.asarray(bits))
    return args, kwargs, int(cu[n])


def assert_matches_reference(name, out, args, kwargs, rows, dtype):
    """Assert a kernel's output `out` (float32 numpy [T, H, D]) is within TOL[dtype] of the float32 reference
    on the same (possibly bfloat16-rounded) inputs, and its padding rows (from `rows` on) are zero.

    Raises:
        AssertionError: naming `name`, the largest error and where it is.
    """
    ref_args = tuple(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args)
    with jax.default_matmul_precision("highest"):  # XLA on a GPU computes DEFAULT float32 dots in TF32
        ref = np.asarray(reference(*ref_args, **kwargs))
    tol = TOL[dtype]
    err = np.abs(out - ref)
    assert np.all(np.isfinite(out[:rows])), f"{name} produced non-finite values"
    assert np.all(err <= tol + tol * np.abs(ref)), (
        f"{name} max error {err.max():.3g} (tolerance {tol}) at {np.unravel_index(err.argmax(), err.shape)}")
    assert np.all(out[rows:] == 0), "padding rows must be zero"
