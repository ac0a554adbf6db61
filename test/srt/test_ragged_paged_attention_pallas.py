"""The Pallas ragged paged attention kernels (TPU and GPU) in interpret mode against the pure-JAX reference.

Random ragged batches come from hypothesis (batch kind, page size, head dim, GQA ratio, sliding window,
soft-cap, segment mask, dtype); explicit examples make sure every value the kernels promise to support is
run on every CI run. Both kernels are also lowered for their real targets (Mosaic TPU, Triton) through
jax.export, which needs no device: a kernel that only works in the interpreter fails there.

Tolerances (max |kernel - reference| over the output): float32 2e-5 + 2e-5 * |ref|; bfloat16 2e-2 + 2e-2
* |ref| (both sides round P to bfloat16 before P @ V and the output to bfloat16, in different orders).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter  # races_found
from jax.experimental.pallas import tpu as pltpu

from sgl_jax.srt.kernels.ragged_paged_attention import ragged_paged_attention, resolve_attention_backend
from sgl_jax.srt.kernels.ragged_paged_attention.common import BlockSizes, q_block_metadata
from sgl_jax.srt.kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu
from sgl_jax.srt.kernels.ragged_paged_attention.ref import ragged_paged_attention as reference
from sgl_jax.srt.kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu

# The TPU kernel runs in Pallas' TPU interpreter, which simulates its DMAs and semaphores: a copy lands only
# when it is waited on, VMEM starts as NaN (reading a buffer before its copy completes shows), and reads
# and writes racing with an in-flight DMA are detected.
TPU_INTERPRET = pltpu.InterpretParams(detect_races=True, dma_execution_mode="on_wait", uninitialized_memory="nan")
KERNELS = {
    # small tiles keep the interpreter fast and put several sequences and KV blocks in each program
    "tpu": functools.partial(ragged_paged_attention_tpu, interpret=TPU_INTERPRET, blocks=BlockSizes(8, 32)),
    "gpu": functools.partial(ragged_paged_attention_gpu, interpret=True, blocks=BlockSizes(16, 32)),
}
TOL = {"float32": 2e-5, "bfloat16": 2e-2}
S_PAD, T_PAD = 5, 48  # fixed padded shapes: fewer distinct programs to compile


def make_batch(seed, kind, page_size, head_dim, group, num_kv_heads, dtype, segments):
    """A random ragged batch: (args, kwargs) for ragged_paged_attention; pages scattered over the cache."""
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
    return args, kwargs, int(cu[n])


def check(kernel, seed, kind, page_size, head_dim, group, dtype, sliding_window, soft_cap, segments,
          num_kv_heads=1):
    args, kwargs, rows = make_batch(seed, kind, page_size, head_dim, group, num_kv_heads, dtype, segments)
    kwargs.update(sliding_window=sliding_window, soft_cap=soft_cap)
    out = np.asarray(KERNELS[kernel](*args, **kwargs).astype(jnp.float32))
    if kernel == "tpu":
        assert not tpu_interpreter.races.races_found, "the TPU interpreter found a data race"
    # the reference in float32 on the same (possibly bfloat16-rounded) inputs
    ref_args = tuple(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args)
    ref = np.asarray(reference(*ref_args, **kwargs))
    tol = TOL[dtype]
    err = np.abs(out - ref)
    assert np.all(err <= tol + tol * np.abs(ref)), (
        f"{kernel} max error {err.max():.3g} (tolerance {tol}) at {np.unravel_index(err.argmax(), err.shape)}")
    assert np.all(out[rows:] == 0), "padding rows must be zero"


# 6 drawn examples + the 6 explicit ones per kernel (every case costs a compile and an interpreted run, ~3-4 s)
@pytest.mark.parametrize("kernel", sorted(KERNELS))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(["decode", "extend", "mixed"]),
    page_size=st.sampled_from([1, 16, 64, 128]),
    head_dim=st.sampled_from([64, 128]),
    group=st.sampled_from([1, 4, 8]),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    sliding_window=st.one_of(st.none(), st.integers(1, 96)),
    soft_cap=st.one_of(st.none(), st.just(20.0)),
    segments=st.booleans(),
)
# every supported value at least once, whatever hypothesis draws
@example(seed=1, kind="decode", page_size=1, head_dim=64, group=1, dtype="float32", sliding_window=None,
         soft_cap=None, segments=False)
@example(seed=2, kind="extend", page_size=16, head_dim=128, group=4, dtype="bfloat16", sliding_window=None,
         soft_cap=None, segments=True)
@example(seed=3, kind="mixed", page_size=64, head_dim=64, group=8, dtype="float32", sliding_window=40,
         soft_cap=20.0, segments=False)
@example(seed=4, kind="mixed", page_size=128, head_dim=128, group=4, dtype="float32", sliding_window=None,
         soft_cap=None, segments=True)
@example(seed=5, kind="decode", page_size=16, head_dim=128, group=8, dtype="bfloat16", sliding_window=17,
         soft_cap=20.0, segments=False)
@example(seed=6, kind="extend", page_size=1, head_dim=64, group=4, dtype="float32", sliding_window=8,
         soft_cap=None, segments=True)
def test_kernel_matches_reference(kernel, seed, kind, page_size, head_dim, group, dtype, sliding_window, soft_cap,
                                  segments):
    check(kernel, seed, kind, page_size, head_dim, group, dtype, sliding_window, soft_cap,
          segments and kind != "decode")  # the decode path has no segment mask (decode rows have none)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_several_kv_heads_and_default_tiles(kernel):
    """Two KV heads (head slicing of the cache rows) and the table's default tile sizes."""
    fn = {"tpu": functools.partial(ragged_paged_attention_tpu, interpret=True),
          "gpu": functools.partial(ragged_paged_attention_gpu, interpret=True)}[kernel]
    args, kwargs, rows = make_batch(7, "mixed", 16, 64, 3, 2, "float32", False)
    out = np.asarray(fn(*args, **kwargs))
    ref = np.asarray(reference(*args, **kwargs))
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_every_sequence_slot_in_use(kernel):
    """num_seqs == S (a full batch bucket): no read past the metadata arrays (the TPU interpreter raises on
    out-of-bounds reads), same result as the reference."""
    args, kwargs, _ = make_batch(12, "mixed", 16, 64, 4, 1, "float32", False)
    q, kp, vp, kl, pi, cu, n = args
    S = int(n)
    args = (q, kp, vp, kl[:S], pi[:S], cu[:S + 1], n)
    out = np.asarray(KERNELS[kernel](*args, **kwargs))
    np.testing.assert_allclose(out, np.asarray(reference(*args, **kwargs)), atol=2e-5, rtol=2e-5)


def test_q_block_metadata_skips_empty_sequences_and_padding():
    cu = jnp.asarray([0, 3, 3, 20, 20, 20], jnp.int32)  # sequence 1 empty; 2 sequences of padding
    seg = jnp.concatenate([jnp.zeros(3, jnp.int32), jnp.full(17, 9, jnp.int32), jnp.zeros(12, jnp.int32)])
    meta = q_block_metadata(cu, jnp.int32(3), seg, 32, 8)
    assert meta.first_seq.tolist() == [0, 2, 2, 1]
    assert meta.last_seq.tolist() == [2, 2, 2, 0]  # block 3 (rows 24..31) is padding: first > last
    assert meta.seg_lo.tolist() == [0, 9, 9, 0]


def test_backend_selection():
    assert resolve_attention_backend("auto", "cpu") == "native"
    assert resolve_attention_backend("auto", "tpu") == "pallas"
    assert resolve_attention_backend("auto", "gpu") == "pallas"
    assert resolve_attention_backend("pallas", "cpu") == "pallas"
    assert resolve_attention_backend("native", "tpu") == "native"
    with pytest.raises(ValueError, match="--attention-backend"):
        resolve_attention_backend("flash", "cpu")
    # the dispatching function on CPU: pallas runs the TPU kernel in the interpreter, same result
    args, kwargs, _ = make_batch(11, "mixed", 16, 64, 4, 1, "float32", False)
    native = ragged_paged_attention(*args, **kwargs, backend="native")
    pallas = ragged_paged_attention(*args, **kwargs, backend="pallas")
    np.testing.assert_allclose(np.asarray(pallas), np.asarray(native), atol=2e-5, rtol=2e-5)


LOWERING_CASES = [
    # T, H, KVH, D, page_size, dtype, decode_only, extra
    (256, 32, 8, 128, 16, "bfloat16", False, {}),
    (64, 32, 8, 128, 16, "bfloat16", True, {}),
    (128, 16, 8, 128, 128, "float32", False, {"sliding_window": 128, "soft_cap": 30.0}),
    (64, 9, 3, 64, 1, "float32", False, {}),
]


@pytest.mark.parametrize("target", ["tpu", "cuda"])
@pytest.mark.parametrize("case", LOWERING_CASES, ids=lambda c: f"T{c[0]}-H{c[1]}-KVH{c[2]}-D{c[3]}-ps{c[4]}-{c[5]}")
def test_kernels_lower_for_their_devices(target, case):
    """The kernels lower to Mosaic TPU / Triton without a device (jax.export), segment mask included."""
    T, H, KVH, D, ps, dtype, decode_only, extra = case
    S, P = 8, 32
    dt = jnp.dtype(dtype)
    fn = ragged_paged_attention_tpu if target == "tpu" else ragged_paged_attention_gpu
    f = functools.partial(fn, sm_scale=D ** -0.5, decode_only=decode_only, **extra)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    kv = jax.ShapeDtypeStruct((64, ps, KVH, D), dt)
    checks = [] if target == "tpu" else [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    exported = jax.export.export(jax.jit(lambda *a: f(*a[:7], prefix_lens=a[7], segment_starts=a[8])),
                                 platforms=[target], disabled_checks=checks)(
        jax.ShapeDtypeStruct((T, H, D), dt), kv, kv, i32(S), i32(S, P), i32(S + 1), i32(), i32(S), i32(T))
    text = exported.mlir_module()
    assert ("tpu_custom_call" in text) if target == "tpu" else ("__gpu$xla.gpu.triton" in text)
