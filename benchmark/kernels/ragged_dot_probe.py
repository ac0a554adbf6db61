"""How long one grouped matmul takes on this machine: M rows spread evenly over E=128 experts against
Qwen3-30B-A3B's expert shape (hidden 2048 -> 768), by backend: XLA's ``jax.lax.ragged_dot``, the dense reference
(every row times every expert), `layers.moe.tiled_grouped_matmul` (--moe-backend tiled) and, where the package is
installed, tokamax's ``ragged_dot`` (``tokamax``: its default implementation for the platform; ``tokamax-triton``,
``tokamax-mosaic``, ``tokamax-xla``: that one). Prints one line per (backend,
rows): milliseconds (best of 3 after a compile), the useful TFLOP/s, the largest difference from ragged_dot's
result, peak RSS.

    python benchmark/kernels/ragged_dot_probe.py 128 ragged_dot
    python benchmark/kernels/ragged_dot_probe.py 64,512,4096 ragged_dot,tiled,dense,tokamax bfloat16

Raises ImportError for the tokamax rows when tokamax is not installed.
"""

from __future__ import annotations

import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def matmul(backend: str):
    """The grouped matmul (lhs [M, K], rhs [E, K, N], group_sizes [E] int32) -> [M, N] of `backend`."""
    if backend == "ragged_dot":
        return lambda x, w, sizes: jax.lax.ragged_dot(x, w, sizes)
    if backend == "tiled":
        from sgl_jax.srt.layers.moe import tiled_grouped_matmul

        return tiled_grouped_matmul
    if backend.startswith("tokamax"):  # "tokamax": its default choice; "tokamax-triton" etc.: that implementation
        import tokamax

        impl = backend.partition("-")[2] or None
        return lambda x, w, sizes: tokamax.ragged_dot(x, w, sizes, implementation=impl)
    if backend == "dense":
        def dense(x, w, sizes):
            expert = jnp.repeat(jnp.arange(w.shape[0]), sizes, total_repeat_length=x.shape[0])
            every = jnp.einsum("md,edi->mei", x, w)  # every row times every expert, then each row's own
            return jnp.take_along_axis(every, expert[:, None, None], 1)[:, 0]
        return dense
    raise ValueError(f"unknown backend {backend!r}")


def probe(rows: int, backend: str, dtype) -> str:
    experts, hidden, inter = 128, 2048, 768
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (rows, hidden), dtype)
    w = (jax.random.normal(kw, (experts, hidden, inter), jnp.float32) * 0.02).astype(dtype)
    # as even as the rows allow (fewer rows than experts: one row in each of the first `rows` experts)
    sizes = jnp.asarray([rows // experts + (e < rows % experts) for e in range(experts)], jnp.int32)
    f = jax.jit(matmul(backend))
    out = f(x, w, sizes).block_until_ready()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        f(x, w, sizes).block_until_ready()
        best = min(best, time.perf_counter() - t)
    ref = jax.jit(matmul("ragged_dot"))(x, w, sizes)
    diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
    useful = 2 * rows * hidden * inter
    return (f"{backend} rows {rows} {jnp.dtype(dtype).name}: {best * 1e3:.2f} ms, "
            f"{useful / best / 1e9:.1f} GFLOP/s useful, max |diff| vs ragged_dot {diff:.3g}, "
            f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")


def main() -> None:
    rows = [int(r) for r in sys.argv[1].split(",")]
    backends = sys.argv[2].split(",")
    dtype = jnp.dtype(sys.argv[3] if len(sys.argv) > 3 else "float32")
    print(f"device: {jax.devices()[0].device_kind}", flush=True)
    for backend in backends:
        for r in rows:
            try:
                print(probe(r, backend, dtype), flush=True)
            except Exception as e:  # one backend failing (e.g. tokamax unsupported here) must not hide the rest
                print(f"{backend} rows {r}: failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)


if __name__ == "__main__":
    main()
