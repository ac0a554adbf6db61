"""Our Pallas TPU ragged paged attention kernel against the one JAX ships
(`jax.experimental.pallas.ops.tpu.ragged_paged_attention`), both run in Pallas' interpreter on CPU.

Why: JAX's kernel is an independent implementation of the same operation (a mixed batch of prefill and decode
sequences over a paged KV cache, causal at each sequence's offset, GQA, sliding window, logit soft-cap), so it is
a second oracle besides our pure-JAX reference: a bug shared by `tpu.py` and `ref.py` (a mask off by one, a wrong
head mapping) would not show against the reference but does against JAX's kernel. Every case checks three things
on the same random batch of `rpa_batches.make_batch`: ours against the reference (`assert_matches_reference`,
padding rows included), JAX's against the reference, and the two kernels against each other, within the
tolerances of `rpa_batches` (float32 2e-5, bfloat16 2e-2, plus as much relative to the reference).

How JAX's kernel is called (its contract, read from kernel.py of jax 0.10.2):
- one fused cache ``kv_pages`` [num_pages, page_size, 2 * KVH, D]: K and V interleaved on the head axis (K of KV
  head h at 2h, V at 2h + 1); our separate k_pages / v_pages are stacked into it (`fused_kv_pages`). Query head
  i reads KV head i // (H / KVH) in both kernels.
- ``num_seqs`` is int32[1] (ours: a scalar); kv_lens, page_indices, cu_q_lens are the same arrays as ours.
- off TPU both tile sizes must be given (``num_kv_pages_per_block``, ``num_queries_per_block``): its tuned-table
  lookup raises NotImplementedError on anything but TPU v4 or later. We give it 8 query rows and 32 KV tokens per
  block (a whole page at page size 128), the tiles ours gets here, so both walk several blocks per sequence.
- it has no ``interpret`` argument; it runs under ``pltpu.force_tpu_interpret_mode(True)``, i.e. Pallas' HLO
  interpreter. Pallas' TPU interpreter (``pltpu.InterpretParams``, which the other Pallas tests use for ours) cannot
  run it in this JAX: reading its reshaped VMEM ref fails ("'ReshapeTransform' object has no attribute
  'indices'"), with or without race detection. So its DMAs are not checked for races here.
- in the HLO interpreter its masked stores (``pltpu.store(ref.at[i], val, mask=...)``) fail to discharge
  ("'TypedInt' object has no attribute 'shape'", a JAX bug). While it is traced, the kernel module's ``pltpu`` is a
  proxy whose ``store`` writes ``where(mask, val, ref[...])`` (the same values); nothing else of it is changed.
  The jitted entry point is bypassed (``__wrapped__``) so that JAX's jit cache never holds the patched trace.
- its output rows past ``cu_q_lens[num_seqs]`` are left as they are (stale scratch, or NaN), where ours writes
  zeros: the kernels are compared on the real rows only.

Not compared, because JAX's kernel does not have it (so not parametrized; nothing is skipped): the segment mask
of multi-item scoring (prefix_lens / segment_starts), head_dim 64 (its l/m scratch is 128 lanes wide and its
broadcast needs head_dim % 128 == 0), KV head counts whose fused 2 * KVH heads do not tile (e.g. KVH = 3: its
get_min_heads_per_blk raises). Its fp8 / int8 caches with k_scale / v_scale and its ``mask_value`` have no
counterpart in ours. Decode batches run our flash-decoding kernel (`tpu_decode`, ``decode_only``) and JAX's
ordinary ragged kernel. (Page size 1 runs in JAX's kernel too, 32 unrolled page DMAs a block; it is left out
only to keep this module short.)

Cases (8 query heads over 2 KV heads, head_dim 128): decode, extend and mixed batches; page sizes 16 and 128;
float32 and bfloat16; a sliding window, and a sliding window with a soft-cap. 2.5-8 s each on a 2-core CPU (four
of the six cases first written: the suite's time is short).
"""

from __future__ import annotations

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as jax_rpa

from sgl_jax.srt.kernels.ragged_paged_attention.common import BlockSizes
from sgl_jax.srt.kernels.ragged_paged_attention.flash_decode import DecodeBlocks
from sgl_jax.srt.kernels.ragged_paged_attention.ref import ragged_paged_attention as reference
from sgl_jax.srt.kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu

from rpa_batches import TOL, assert_matches_reference, make_batch

HEAD_DIM, GROUP, NUM_KV_HEADS = 128, 4, 2  # 8 query heads over 2 KV heads
BLOCK_Q, BLOCK_KV = 8, 32  # query rows and KV tokens per block, both kernels (KV rounded up to whole pages)

CASES = [
    # seed, kind, page_size, dtype, sliding_window, soft_cap
    (21, "decode", 16, "float32", None, None),
    (22, "extend", 128, "bfloat16", None, None),
    (24, "mixed", 128, "float32", 40, None),
    (26, "decode", 128, "bfloat16", 17, 20.0),
]


def fused_kv_pages(k_pages, v_pages):
    """[num_pages, page_size, KVH, D] K and V -> JAX's [num_pages, page_size, 2 * KVH, D], K of head h at 2h, V at
    2h + 1."""
    num_pages, page_size, kvh, d = k_pages.shape
    return jnp.stack([k_pages, v_pages], axis=3).reshape(num_pages, page_size, 2 * kvh, d)


class _PltpuWithPlainMaskedStore:
    """`jax.experimental.pallas.tpu` with ``store(ref, val, mask=m)`` written as ``ref[...] = where(m, val,
    ref[...])``: the same result, without the masked swap the HLO interpreter cannot discharge."""

    def __getattr__(self, name):
        return getattr(pltpu, name)

    @staticmethod
    def store(ref, val, *, mask=None):
        ref[...] = val if mask is None else jnp.where(mask, val, ref[...])


def run_jax_kernel(args, kwargs):
    """JAX's kernel on a `make_batch` batch, in Pallas' HLO interpreter; float32 numpy [T, H, D]."""
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs = args
    page_size, pages_per_seq = k_pages.shape[1], page_indices.shape[1]
    with mock.patch.object(jax_rpa, "pltpu", _PltpuWithPlainMaskedStore()), pltpu.force_tpu_interpret_mode(True):
        out = jax_rpa.ragged_paged_attention.__wrapped__(
            q, fused_kv_pages(k_pages, v_pages), kv_lens, page_indices, cu_q_lens, num_seqs.reshape(1),
            sm_scale=kwargs["sm_scale"], sliding_window=kwargs["sliding_window"], soft_cap=kwargs["soft_cap"],
            num_kv_pages_per_block=min(pages_per_seq, max(1, BLOCK_KV // page_size)),
            num_queries_per_block=BLOCK_Q)
    return np.asarray(out.astype(jnp.float32))


def assert_close(name, out, expected, ref, dtype):
    """|out - expected| <= TOL[dtype] * (1 + |ref|) everywhere, out finite (all [rows, H, D] float32 numpy)."""
    tol = TOL[dtype]
    err = np.abs(out - expected)
    assert np.all(np.isfinite(out)), f"{name}: non-finite values"
    assert np.all(err <= tol + tol * np.abs(ref)), (
        f"{name}: max error {err.max():.3g} (tolerance {tol}) at {np.unravel_index(err.argmax(), err.shape)}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1]}-ps{c[2]}-{c[3]}-sw{c[4]}-cap{c[5]}")
def test_matches_jax_kernel(case):
    seed, kind, page_size, dtype, sliding_window, soft_cap = case
    args, kwargs, rows = make_batch(seed, kind, page_size, HEAD_DIM, GROUP, NUM_KV_HEADS, dtype, False)
    kwargs.update(sliding_window=sliding_window, soft_cap=soft_cap)

    ours = np.asarray(ragged_paged_attention_tpu(
        *args, **kwargs, interpret=True, blocks=BlockSizes(BLOCK_Q, BLOCK_KV),
        decode_blocks=DecodeBlocks(BLOCK_KV, 2 * BLOCK_KV)).astype(jnp.float32))
    assert_matches_reference("ours", ours, args, kwargs, rows, dtype)

    theirs = run_jax_kernel(args, kwargs)[:rows]
    ref_args = tuple(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args)
    with jax.default_matmul_precision("highest"):  # as `assert_matches_reference`
        ref = np.asarray(reference(*ref_args, **kwargs))[:rows]
    assert_close("JAX's kernel vs the reference", theirs, ref, ref, dtype)
    assert_close("JAX's kernel vs ours", theirs, ours[:rows], ref, dtype)
