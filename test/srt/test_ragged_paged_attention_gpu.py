"""The Pallas GPU (Triton) ragged paged attention kernel compiled and run on a GPU, against the pure-JAX reference.

Skipped where JAX has no GPU (CI, this project's CPU machines); run on a GPU with
``JAX_PLATFORMS=cuda pytest -q test/srt/test_ragged_paged_attention_gpu.py``. The same random ragged batches
as the interpreted tests (`rpa_batches`: decode, extend and mixed batches, page sizes 1..128, head dims 64 and
128, GQA groups, sliding window, soft-cap, the multi-item segment mask, float32 and bfloat16), with the
device's own tile table (`common.GPU_BLOCK_TABLE`) and with small tiles that put several sequences and KV
blocks in each program; then real models' head shapes at serving lengths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from sgl_jax.srt.kernels.ragged_paged_attention import ragged_paged_attention
from sgl_jax.srt.kernels.ragged_paged_attention.common import BlockSizes
from sgl_jax.srt.kernels.ragged_paged_attention.flash_decode import DecodeBlocks
from sgl_jax.srt.kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu

from rpa_batches import assert_matches_reference, make_batch

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (JAX backend 'gpu')")

# (ragged kernel tiles, flash-decoding kernel tiles): the tables', and small ones (several sequences and KV blocks per
# program of the ragged kernel, several context splits per sequence in the decode kernel)
TILES = {"table": (None, None), "small": (BlockSizes(16, 32), DecodeBlocks(16, 64))}


@pytest.mark.parametrize("tiles", sorted(TILES))
# no shrinking: every example compiles a kernel (seconds); the first failing one is reported as drawn
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True,
          phases=(Phase.explicit, Phase.generate))
@given(
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(["decode", "extend", "mixed"]),
    page_size=st.sampled_from([1, 16, 64, 128]),
    head_dim=st.sampled_from([64, 128]),
    group=st.sampled_from([1, 2, 4, 8]),
    num_kv_heads=st.sampled_from([1, 2]),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    sliding_window=st.one_of(st.none(), st.integers(1, 96)),
    soft_cap=st.one_of(st.none(), st.just(20.0)),
    segments=st.booleans(),
)
def test_gpu_kernel_matches_reference(tiles, seed, kind, page_size, head_dim, group, num_kv_heads, dtype,
                                      sliding_window, soft_cap, segments):
    args, kwargs, rows = make_batch(seed, kind, page_size, head_dim, group, num_kv_heads, dtype,
                                    segments and kind != "decode")
    kwargs.update(sliding_window=sliding_window, soft_cap=soft_cap)
    blocks, decode_blocks = TILES[tiles]
    out = np.asarray(ragged_paged_attention_gpu(*args, **kwargs, blocks=blocks, decode_blocks=decode_blocks)
                     .astype(jnp.float32))
    assert_matches_reference(f"gpu kernel ({tiles} tiles)", out, args, kwargs, rows, dtype)


def _model_batch(H, KVH, D, q_lens, kv_lens, page_size, dtype, seed):
    """A batch of real-model head shapes: pages shuffled over a cache that holds exactly the batch's KV."""
    rng = np.random.default_rng(seed)
    S = len(q_lens)
    pages = [-(-k // page_size) for k in kv_lens]
    P = max(pages)
    num_pages = 1 + sum(pages)
    perm = 1 + rng.permutation(sum(pages))
    page_indices = np.zeros((S, P), np.int32)
    o = 0
    for s, n in enumerate(pages):
        page_indices[s, :n] = perm[o:o + n]
        o += n
    dt = jnp.dtype(dtype)
    k = jnp.asarray(rng.standard_normal((num_pages, page_size, KVH, D)), dt)
    v = jnp.asarray(rng.standard_normal((num_pages, page_size, KVH, D)), dt)
    q = jnp.asarray(rng.standard_normal((sum(q_lens), H, D)), dt)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    args = (q, k, v, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(page_indices), jnp.asarray(cu),
            jnp.asarray(S, jnp.int32))
    return args, dict(sm_scale=D ** -0.5, decode_only=all(n == 1 for n in q_lens)), sum(q_lens)


@pytest.mark.parametrize("heads", [(16, 8, 128), (32, 8, 128)], ids=["Qwen3-0.6B", "Llama-3-8B"])
@pytest.mark.parametrize("batch", ["decode", "long-decode", "prefill", "mixed"])
def test_gpu_kernel_model_shapes(heads, batch):
    """bfloat16, page size 16, through the dispatching function (`backend="pallas"` picks the GPU kernel)."""
    H, KVH, D = heads
    q_lens, kv_lens = {
        "decode": ([1] * 32, [int(x) for x in np.linspace(100, 4000, 32)]),
        "long-decode": ([1] * 8, [8192, 8191, 5000, 2049, 1025, 1024, 17, 1]),  # split edges: 1,024 tokens
        "prefill": ([1024, 512], [1024, 1536]),
        "mixed": ([1] * 8 + [300, 77], [2000] * 8 + [300, 900]),
    }[batch]
    args, kwargs, rows = _model_batch(H, KVH, D, q_lens, kv_lens, 16, "bfloat16", seed=len(q_lens))
    out = np.asarray(ragged_paged_attention(*args, **kwargs, backend="pallas").astype(jnp.float32))
    assert_matches_reference(f"gpu kernel {heads} {batch}", out, args, kwargs, rows, "bfloat16")


@pytest.mark.parametrize("tiles", sorted(TILES))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_kernel_draft_tree_rows(tiles, page_size, dtype):
    """Speculative verify rows (issue #39): every other sequence's queries are a random draft tree's slots
    (`tree_bits`), beside ordinary extend rows, as in the interpreted kernels' test."""
    args, kwargs, rows = make_batch(21 + page_size, "extend", page_size, 64, 4, 1, dtype, False, trees=True)
    blocks, decode_blocks = TILES[tiles]
    out = np.asarray(ragged_paged_attention_gpu(*args, **kwargs, blocks=blocks, decode_blocks=decode_blocks)
                     .astype(jnp.float32))
    assert_matches_reference(f"gpu kernel draft tree ({tiles} tiles)", out, args, kwargs, rows, dtype)


@pytest.mark.parametrize("cache_dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_gpu_kernel_fp8_kv_pages(batch, cache_dtype):
    """--kv-cache-dtype fp8_e4m3 / fp8_e5m2 (issue #40): bfloat16 queries over fp8 pages of Llama-3-8B's head
    shapes, widened in the kernels (`common.widen`), against the reference on the same pages."""
    q_lens, kv_lens = {"decode": ([1] * 16, [int(x) for x in np.linspace(50, 3000, 16)]),
                       "mixed": ([1] * 4 + [300, 77], [900] * 4 + [300, 700])}[batch]
    args, kwargs, rows = _model_batch(32, 8, 128, q_lens, kv_lens, 16, "bfloat16", seed=3)
    fp8 = jnp.dtype(cache_dtype)
    args = (args[0], args[1].astype(fp8), args[2].astype(fp8)) + args[3:]
    out = np.asarray(ragged_paged_attention(*args, **kwargs, backend="pallas").astype(jnp.float32))
    assert_matches_reference(f"gpu kernel fp8 {cache_dtype} {batch}", out, args, kwargs, rows, "bfloat16")
