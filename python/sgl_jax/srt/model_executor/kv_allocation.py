"""The paged KV pool's device buffers: allocated and zeroed on a background thread while start-up goes on.

Zeroing the pool is a memset of every byte of it (4.2 GiB, 1.4-1.7 s, for SmolLM2's default pool on a 2-core
CPU alone, ~4 s beside a restart's other work). The allocation programs are compiled on the caller's thread (so that
compile counts stay where warm-up reads them) and run on a thread of their own: weights, warm-up's tracing and the
loading of executables go on meanwhile, lowered against the buffers' abstract shapes (`abstract`).

On one CPU device, a buffer of at least FRESH_MIN_BYTES is not memset: a custom call (kernels/ragged_paged_attention/
cpu.fresh_buffer) gives its whole pages back to the kernel (madvise MADV_DONTNEED), after which anonymous private
memory reads as zero and is zero-filled page by page as serving first writes it. So the pool is zero as `jnp.zeros`
makes it, in milliseconds (`fresh_pages_ok` says when; ``SGL_JAX_KV_ZERO_FILL=1`` memsets every buffer).
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from sgl_jax.srt.kernels.ragged_paged_attention import cpu as cpu_kernels

Shape = Tuple[int, ...]
ZERO_FILL_ENV = "SGL_JAX_KV_ZERO_FILL"  # "1": memset every KV buffer (no pages given back)
# smaller buffers are memset (little to save there); the pool's bulk is in large ones (SmolLM2: 60 of 75 MB)
FRESH_MIN_BYTES = 64 << 20


def fresh_pages_ok(shape: Shape, dtype, sharding, environ=os.environ) -> bool:
    """Whether a KV buffer of `shape` x `dtype` under `sharding` comes from `cpu.fresh_buffer` (zeroed by giving its
    pages back instead of a memset): one CPU device on Linux, at least FRESH_MIN_BYTES, the custom call built, and
    not ``SGL_JAX_KV_ZERO_FILL=1`` in `environ`."""
    devices = list(sharding.device_set)
    if len(devices) != 1 or devices[0].platform != "cpu" or sys.platform != "linux":
        return False
    if math.prod(shape) * jnp.dtype(dtype).itemsize < FRESH_MIN_BYTES:
        return False
    return environ.get(ZERO_FILL_ENV) != "1" and cpu_kernels.fresh_buffer_available()


class KVAllocation:
    """(K, V) buffers of one shape per layer, zeroed, sharded by `sharding`.

    Args:
        shapes: per layer, the shape of its K buffer (its V buffer has the same):
            [dp * (pages + 1), page_size, kv_heads, head_dim] (every rank's block holds its padding page 0).
        dtype: the cache's dtype.
        sharding: the buffers' ``jax.sharding.NamedSharding`` (KV_CACHE on the runner's mesh).

    One compiled program per distinct shape, compiled here and kept: a later `allocate` (resume_memory_occupation)
    compiles nothing. ``fresh_shapes``: the shapes allocated as fresh zero pages (`fresh_pages_ok`), the others are
    memset.
    """

    def __init__(self, shapes: Sequence[Shape], dtype, sharding):
        self.shapes, self.dtype, self.sharding = list(shapes), jnp.dtype(dtype), sharding
        self._programs: Dict[Shape, object] = {}
        self.fresh_shapes = set()
        for shape in self.shapes:
            if shape in self._programs:
                continue
            if fresh_pages_ok(shape, self.dtype, sharding):
                self.fresh_shapes.add(shape)
                make = lambda s=shape: cpu_kernels.fresh_buffer(s, self.dtype)  # noqa: E731
            else:
                make = lambda s=shape: jnp.zeros(s, self.dtype)  # noqa: E731
            self._programs[shape] = jax.jit(make, out_shardings=sharding).lower().compile()
        self._pending: Optional[concurrent.futures.Future] = None
        self.seconds = 0.0  # wall seconds the last allocation took (on whichever thread ran it)

    @property
    def nbytes(self) -> int:
        """Bytes of all the buffers, over every device of the sharding."""
        return sum(2 * self.dtype.itemsize * math.prod(s) for s in self.shapes)

    @property
    def abstract(self) -> List[Tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]]:
        """The buffers as ``jax.ShapeDtypeStruct``s with their sharding: what a program is lowered against before
        the buffers exist (it then compiles to the executable serving runs with them)."""
        return [(jax.ShapeDtypeStruct(s, self.dtype, sharding=self.sharding),) * 2 for s in self.shapes]

    def allocate(self) -> List[Tuple[jax.Array, jax.Array]]:
        """The zeroed (K, V) buffers per layer, made on this thread and ready (blocks until zeroed)."""
        t0 = time.perf_counter()
        out = [(self._programs[s](), self._programs[s]()) for s in self.shapes]
        jax.block_until_ready(out)
        self.seconds = time.perf_counter() - t0
        return out

    def start(self) -> None:
        """Begin `allocate` on a thread of its own; `result` waits for it."""
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-alloc")
        self._pending = pool.submit(self.allocate)
        pool.shutdown(wait=False)  # (the thread ends with its one task)

    @property
    def pending(self) -> bool:
        """Whether a `start`ed allocation has not been collected by `result` yet."""
        return self._pending is not None

    def result(self) -> Tuple[List[Tuple[jax.Array, jax.Array]], float]:
        """(the buffers of the `start`ed allocation, seconds this call waited for them). Raises what the
        allocation raised (e.g. XLA's out-of-memory error)."""
        t0 = time.perf_counter()
        try:
            return self._pending.result(), time.perf_counter() - t0
        finally:
            self._pending = None

