"""Compile SmolLM2's extend program (T = 256, 4 sequences) with a variant of the CPU extend attention patched in, and
print its trace and XLA seconds, its composition (bench_buckets.program_composition) and an all-padding step's time:

    JAX_COMPILATION_CACHE_DIR=$(mktemp -d) JAX_PLATFORMS=cpu python attention_variants_probe.py default|noshared|nocond

default: as committed; noshared: the shared-prefix (cascade) state replaced by the empty state; nocond: every key
block masked (no lax.cond between the masked and unmasked step). A probe for an investigation (run from the
repository root), not part of the package; the variants are not correct for every batch.
"""
import sys, time
sys.path.insert(0, "test/srt"); sys.path.insert(0, "test")
import jax, jax.numpy as jnp
from test_model_parity import RunnerHarness
from sgl_jax.srt.forward_batch import ForwardMode
from sgl_jax.bench_buckets import program_composition
import sgl_jax.srt.kernels.ragged_paged_attention.ref as ref
variant = sys.argv[1]
if variant == "noshared":
    orig = ref._shared_prefix_state
    def empty(q, k_pages, v_pages, page_row, shared_len, num_rows, qpos, sm_scale, sliding_window, soft_cap, pad):
        T, H, D = q.shape; KVH = k_pages.shape[2]; G = H // KVH; n = T + pad
        return (jnp.full((KVH, G, n), ref.MASK_VALUE, jnp.float32), jnp.zeros((KVH, G, n), jnp.float32), jnp.zeros((KVH, G, n, D), jnp.float32))
    ref._shared_prefix_state = empty
if variant == "nocond":
    ref._step_skipping_full_masks = lambda carry, x, kblk, vblk, mask, soft_cap, row_repeats=1: ref._matmul_step(
        carry, x, kblk, vblk, jnp.tile(mask, (row_repeats, 1)), soft_cap)
h = RunnerHarness(None, token_paddings=(256,))
t = time.time(); lw = h.runner._lower_step(ForwardMode.EXTEND, 256, 4)(); tr = time.time() - t
t = time.time(); c = lw.compile(); xla = time.time() - t
batch = h.runner.dummy_batch(ForwardMode.EXTEND, 256, 4)
import statistics
h.runner.device_seconds_per_step(batch, 1)
step = statistics.median(h.runner.device_seconds_per_step(batch, 2) for _ in range(3))
print(f"step {1e3*step:.1f} ms")
print(variant, f"trace {tr:.2f} xla {xla:.1f}", program_composition(c.as_text()))
