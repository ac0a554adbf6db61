"""How long one grouped matmul takes on this machine: ``jax.lax.ragged_dot`` of M rows spread evenly over E=128
experts against Qwen3-30B-A3B's expert shape (hidden 2048 -> 768), beside the dense reference (every row times
every expert) and `layers.moe.tiled_grouped_matmul` (--moe-backend tiled). Prints one line per run: backend, rows,
milliseconds (best of 3 after a compile), peak RSS.

    python benchmark/kernels/ragged_dot_probe.py 128 ragged_dot
    python benchmark/kernels/ragged_dot_probe.py 128 tiled
    python benchmark/kernels/ragged_dot_probe.py 128 dense
"""

from __future__ import annotations

import resource
import sys
import time

import jax
import jax.numpy as jnp


def main() -> None:
    rows, backend = int(sys.argv[1]), sys.argv[2]
    experts, hidden, inter = 128, 2048, 768
    x = jnp.ones((rows, hidden), jnp.float32)
    w = jnp.ones((experts, hidden, inter), jnp.float32) * 0.01
    # as even as the rows allow (fewer rows than experts: one row in each of the first `rows` experts)
    sizes = jnp.asarray([rows // experts + (e < rows % experts) for e in range(experts)], jnp.int32)
    if backend == "ragged_dot":
        f = jax.jit(lambda x, w, sizes: jax.lax.ragged_dot(x, w, sizes))
    elif backend == "tiled":
        from sgl_jax.srt.layers.moe import tiled_grouped_matmul

        f = jax.jit(tiled_grouped_matmul)
    else:
        f = jax.jit(lambda x, w, sizes: jnp.einsum("md,edi->mei", x, w).sum(1))
    f(x, w, sizes).block_until_ready()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        f(x, w, sizes).block_until_ready()
        best = min(best, time.perf_counter() - t)
    useful = 2 * rows * hidden * inter / 1e9
    print(f"{backend} rows {rows}: {best * 1e3:.0f} ms ({useful:.2f} GFLOP of useful work), "
          f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")


if __name__ == "__main__":
    main()
