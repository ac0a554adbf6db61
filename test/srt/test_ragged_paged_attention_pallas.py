"""The Pallas ragged paged attention kernels (TPU and GPU) in interpret mode against the pure-JAX reference.

Random ragged batches come from hypothesis (batch kind, page size, head dim, GQA ratio, sliding window,
soft-cap, segment mask, dtype); explicit examples make sure every value the kernels promise to support is
run on every CI run. Both kernels are also lowered for their real targets (Mosaic TPU, Triton) through
jax.export, which needs no device: a kernel that only works in the interpreter fails there. The batches and
the tolerances are `rpa_batches`'; test_ragged_paged_attention_gpu.py runs the GPU kernel compiled, on a GPU.
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

from sgl_jax.srt.kernels.ragged_paged_attention import ragged_paged_attention
from sgl_jax.srt.server_args import resolve_attention_backend
from sgl_jax.srt.kernels.ragged_paged_attention.common import BlockSizes, q_block_metadata
from sgl_jax.srt.kernels.ragged_paged_attention.flash_decode import DecodeBlocks
from sgl_jax.srt.kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu
from sgl_jax.srt.kernels.ragged_paged_attention.ref import ragged_paged_attention as reference
from sgl_jax.srt.kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu

from rpa_batches import assert_matches_reference, make_batch

# The TPU kernel runs in Pallas' TPU interpreter, which simulates its DMAs and semaphores: a copy lands only
# when it is waited on, VMEM starts as NaN (reading a buffer before its copy completes shows), and reads
# and writes racing with an in-flight DMA are detected.
TPU_INTERPRET = pltpu.InterpretParams(detect_races=True, dma_execution_mode="on_wait", uninitialized_memory="nan")
KERNELS = {
    # small tiles keep the interpreter fast and put several sequences and KV blocks in each program
    "tpu": functools.partial(ragged_paged_attention_tpu, interpret=TPU_INTERPRET, blocks=BlockSizes(8, 32),
                             decode_blocks=DecodeBlocks(32, 64)),
    # decode batches run the flash-decoding kernels (tpu_decode, gpu_decode): splits of 64 tokens give 1-3 programs
    # per sequence
    "gpu": functools.partial(ragged_paged_attention_gpu, interpret=True, blocks=BlockSizes(16, 32),
                             decode_blocks=DecodeBlocks(16, 64)),
}
def check(kernel, seed, kind, page_size, head_dim, group, dtype, sliding_window, soft_cap, segments,
          num_kv_heads=1):
    args, kwargs, rows = make_batch(seed, kind, page_size, head_dim, group, num_kv_heads, dtype, segments)
    kwargs.update(sliding_window=sliding_window, soft_cap=soft_cap)
    out = np.asarray(KERNELS[kernel](*args, **kwargs).astype(jnp.float32))
    if kernel == "tpu":
        assert not tpu_interpreter.races.races_found, "the TPU interpreter found a data race"
    assert_matches_reference(kernel, out, args, kwargs, rows, dtype)


# 4 drawn examples + the 6 explicit ones per kernel (every case costs a compile and an interpreted run, ~3-4 s)
@pytest.mark.parametrize("kernel", sorted(KERNELS))
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
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
@pytest.mark.parametrize("page_size, dtype", [(1, "float32"), (16, "bfloat16")])
def test_draft_tree_rows_match_reference(kernel, page_size, dtype):
    """Speculative verify rows: every other sequence's queries are a random draft tree's slots (tree_bits), next
    to ordinary extend rows; the reference's tree mask is checked against a dense one in
    test_ragged_paged_attention.py."""
    args, kwargs, rows = make_batch(21 + page_size, "extend", page_size, 64, 4, 1, dtype, False, trees=True)
    out = np.asarray(KERNELS[kernel](*args, **kwargs).astype(jnp.float32))
    if kernel == "tpu":
        assert not tpu_interpreter.races.races_found, "the TPU interpreter found a data race"
    assert_matches_reference(kernel, out, args, kwargs, rows, dtype)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("kind, cache_dtype", [("mixed", "float8_e4m3fn"), ("decode", "float8_e4m3fn"),
                                               ("extend", "float8_e5m2")])
def test_fp8_kv_pages_match_reference(kernel, kind, cache_dtype):
    """--kv-cache-dtype fp8_e4m3 / fp8_e5m2 with the pallas backend: bfloat16 queries over pages stored in one byte
    per value (two KV heads, so each head's columns are sliced from the fp8 rows); the kernels widen what they read
    to bfloat16 (`common.widen`), as the reference converts the pages, and match it to bfloat16's tolerance. The
    decode batch runs the flash-decoding kernels."""
    args, kwargs, rows = make_batch(31, kind, 16, 64, 4, 2, "bfloat16", False)
    fp8 = jnp.dtype(cache_dtype)
    args = (args[0], args[1].astype(fp8), args[2].astype(fp8)) + args[3:]
    out = np.asarray(KERNELS[kernel](*args, **kwargs).astype(jnp.float32))
    if kernel == "tpu":
        assert not tpu_interpreter.races.races_found, "the TPU interpreter found a data race"
    assert_matches_reference(kernel, out, args, kwargs, rows, "bfloat16")


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
    assert resolve_attention_backend("auto", "gpu") == "pallas"  # passed its test on an H200, faster in both phases
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
    # fp8 KV caches (--kv-cache-dtype fp8_e4m3 / fp8_e5m2) under bfloat16 queries
    (256, 32, 8, 128, 16, "bfloat16", False, {"kv_dtype": "float8_e4m3fn"}),
    (64, 32, 8, 128, 16, "bfloat16", True, {"kv_dtype": "float8_e5m2"}),
]


@pytest.mark.parametrize("target", ["tpu", "cuda"])
@pytest.mark.parametrize("case", LOWERING_CASES, ids=lambda c: f"T{c[0]}-H{c[1]}-KVH{c[2]}-D{c[3]}-ps{c[4]}-{c[5]}"
                         + (f"-kv-{c[7]['kv_dtype']}" if "kv_dtype" in c[7] else ""))
def test_kernels_lower_for_their_devices(target, case):
    """The kernels lower to Mosaic TPU / Triton without a device (jax.export), segment and tree masks included."""
    T, H, KVH, D, ps, dtype, decode_only, extra = case
    extra = dict(extra)
    S, P = 8, 32
    dt = jnp.dtype(dtype)
    kv_dt = jnp.dtype(extra.pop("kv_dtype", dtype))
    fn = ragged_paged_attention_tpu if target == "tpu" else ragged_paged_attention_gpu
    f = functools.partial(fn, sm_scale=D ** -0.5, decode_only=decode_only, **extra)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    kv = jax.ShapeDtypeStruct((64, ps, KVH, D), kv_dt)
    checks = [] if target == "tpu" else [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    exported = jax.export.export(
        jax.jit(lambda *a: f(*a[:7], prefix_lens=a[7], segment_starts=a[8], tree_bits=a[9])),
        platforms=[target], disabled_checks=checks)(
        jax.ShapeDtypeStruct((T, H, D), dt), kv, kv, i32(S), i32(S, P), i32(S + 1), i32(), i32(S), i32(T), i32(T))
    text = exported.mlir_module()
    assert ("tpu_custom_call" in text) if target == "tpu" else ("__gpu$xla.gpu.triton" in text)


def test_gpu_kernel_float32_dots_ask_for_ieee_precision():
    """Pallas' Triton lowering (jax/_src/pallas/triton/lowering.py) runs a DEFAULT-precision float32 dot in TF32
    (10-bit mantissas: errors near 1e-3, fifty times the float32 tolerance), a HIGHEST one in IEEE float32:
    every dot of the float32 kernel asks for HIGHEST, the bfloat16 kernel's for none (bfloat16 products are
    exact either way)."""
    import re

    def dot_precisions(dtype, decode_only):
        T, H, KVH, D, S, P = 64, 8, 2, 64, 4, 8
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
        kv = jax.ShapeDtypeStruct((64, 16, KVH, D), dtype)
        f = functools.partial(ragged_paged_attention_gpu, sm_scale=D ** -0.5, decode_only=decode_only,
                              interpret=True)
        text = str(jax.make_jaxpr(f)(jax.ShapeDtypeStruct((T, H, D), dtype), kv, kv, i32(S), i32(S, P), i32(S + 1),
                                     i32()))
        return text.count("dot_general["), re.findall(r"precision=\(Precision\.(\w+), Precision\.(\w+)\)", text)

    for decode_only in (False, True):  # the ragged kernel and the flash-decoding kernel
        n, precisions = dot_precisions(jnp.float32, decode_only)
        assert n >= 2 and precisions == [("HIGHEST", "HIGHEST")] * n
        n, precisions = dot_precisions(jnp.bfloat16, decode_only)
        assert n >= 2 and precisions == []
