"""The KV pool's allocation on a thread of its own (model_executor/kv_allocation.py).

Real XLA buffers on the CPU device: the buffers come back zeroed, with the shapes, dtype and sharding the abstract
ones promised; a program lowered against the abstract buffers (as warm-up lowers while the pool is being zeroed)
runs with the real ones, donated, without compiling again; a second allocation (resume_memory_occupation's)
compiles nothing; an error on the allocating thread is raised where the buffers are collected.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sgl_jax.srt.model_executor.compile_stats import compile_counts
from sgl_jax.srt.model_executor.kv_allocation import KVAllocation

SHAPES = [(3, 4, 2, 8), (3, 4, 2, 8), (5, 4, 2, 8)]  # two pools' layers: [pages + 1, page_size, kv_heads, head_dim]


def _sharding():
    return NamedSharding(Mesh(np.array(jax.devices()[:1]), ("tensor",)), P(None, None, "tensor", None))


def test_the_buffers_come_back_zeroed_as_the_abstract_ones_promised():
    alloc = KVAllocation(SHAPES, jnp.float32, _sharding())
    assert alloc.nbytes == 2 * 4 * sum(int(np.prod(s)) for s in SHAPES)
    abstract = alloc.abstract
    alloc.start()
    assert alloc.pending
    kv, waited = alloc.result()
    assert not alloc.pending and waited >= 0 and alloc.seconds > 0
    assert len(kv) == len(SHAPES) == len(abstract)
    for (k, v), (ak, av), shape in zip(kv, abstract, SHAPES):
        for x, a in ((k, ak), (v, av)):
            assert x.shape == a.shape == shape and x.dtype == a.dtype == jnp.float32
            assert x.sharding == a.sharding
            assert not np.asarray(x).any()
        assert k.unsafe_buffer_pointer() != v.unsafe_buffer_pointer()  # K and V are buffers of their own


def test_a_program_lowered_on_the_abstract_buffers_runs_on_the_real_ones():
    alloc = KVAllocation(SHAPES, jnp.float32, _sharding())
    alloc.start()
    write = jax.jit(lambda kv, x: [(k.at[1].add(x), v) for k, v in kv], donate_argnums=0)
    compiled = write.lower(alloc.abstract, jnp.ones((4, 2, 8))).compile()  # (while the pool is zeroed)
    kv, _ = alloc.result()
    x = jnp.ones((4, 2, 8))
    before = compile_counts()
    out = compiled(kv, x)
    assert (compile_counts() - before).programs == 0
    assert float(out[2][0][1].sum()) == 64.0 and float(out[2][0][0].sum()) == 0.0
    with pytest.raises(RuntimeError):  # donated: the real buffers were consumed, as serving's step consumes them
        np.asarray(kv[0][0])


def test_a_second_allocation_compiles_nothing_and_errors_reach_the_collector():
    alloc = KVAllocation(SHAPES, jnp.float32, _sharding())
    before = compile_counts()
    kv = alloc.allocate()
    assert (compile_counts() - before).programs == 0 and len(kv) == 3

    failing = KVAllocation(SHAPES[:1], jnp.float32, _sharding())
    failing._programs = {}  # a fault on the allocating thread (no program for the shape)
    failing.start()
    with pytest.raises(KeyError):
        failing.result()
    assert not failing.pending


BIG = (64 * 1024 + 1, 1, 2, 128)  # 64 MiB + a page of float32: at FRESH_MIN_BYTES, and not whole pages


def _dirty_the_heap(shape, value=7.0):
    """Allocate and free buffers of `shape` filled with `value`, so recycled memory would show through."""
    junk = [jnp.full(shape, value, jnp.float32) for _ in range(4)]
    jax.block_until_ready(junk)
    del junk


def test_a_large_buffer_is_zeroed_without_a_memset():
    """A buffer of at least FRESH_MIN_BYTES on one CPU device comes from the custom call that gives its pages back
    instead of writing them, and is zero even after buffers of its size holding other values were freed; a donated
    step writes it in place. It is allocated in a small fraction of a memset's time, measured in the same run.
    SGL_JAX_KV_ZERO_FILL=1, a small buffer, or a mesh of two devices memsets instead."""
    from sgl_jax.srt.kernels.ragged_paged_attention import cpu
    from sgl_jax.srt.model_executor import kv_allocation as ka

    assert cpu.fresh_buffer_available(), "the kernel library lacks SglJaxFreshBuffer (rebuild: setup.py build_ext)"
    sharding = _sharding()
    fresh = KVAllocation([BIG], jnp.float32, sharding)
    zeroed = KVAllocation([BIG], jnp.float32, sharding)
    zeroed.fresh_shapes, zeroed._programs = set(), {BIG: jax.jit(lambda: jnp.zeros(BIG, jnp.float32),
                                                                  out_shardings=sharding).lower().compile()}
    assert fresh.fresh_shapes == {BIG}
    for _ in range(3):
        _dirty_the_heap(BIG)
        (k, v), = fresh.allocate()
        assert not np.asarray(k).any() and not np.asarray(v).any()
        pointer = k.unsafe_buffer_pointer()
        k = jax.jit(lambda k: k.at[3].set(1.0), donate_argnums=0)(k)
        assert k.unsafe_buffer_pointer() == pointer and float(k.sum()) == 256.0
        del k, v
    fresh_s = min(_timed(fresh.allocate) for _ in range(3))
    zeroed_s = min(_timed(zeroed.allocate) for _ in range(3))
    assert fresh_s < zeroed_s / 4, (fresh_s, zeroed_s)

    assert not ka.fresh_pages_ok(BIG, jnp.float32, sharding, {ka.ZERO_FILL_ENV: "1"})
    assert not ka.fresh_pages_ok(SHAPES[0], jnp.float32, sharding, {})
    assert ka.fresh_pages_ok(BIG, jnp.float32, sharding, {})
    if len(jax.devices()) > 1:
        two = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("tensor",)), P(None, None, "tensor", None))
        assert not ka.fresh_pages_ok(BIG, jnp.float32, two, {})


@pytest.mark.parametrize("shape", [(64, 1024), (3, 1000), BIG], ids=["whole-pages", "partial-pages", "large"])
def test_recycled_memory_is_zeroed_and_the_check_sees_it_otherwise(shape):
    """Memory the allocator recycles holds the freed buffers' values: the custom call left as allocated
    (``zero=False``, the planted fault) hands them back at small sizes, and the zero check catches it; the call as
    the pool runs it (its pages given back, partial pages memset) returns zeros at every size after the same
    dirtying."""
    from sgl_jax.srt.kernels.ragged_paged_attention import cpu

    raw = jax.jit(lambda: cpu.fresh_buffer(shape, jnp.float32, zero=False)).lower().compile()
    zeroed = jax.jit(lambda: cpu.fresh_buffer(shape, jnp.float32)).lower().compile()
    dirty = 0
    for _ in range(4):
        _dirty_the_heap(shape)
        dirty += sum(bool(np.asarray(raw()).any()) for _ in range(4))
        _dirty_the_heap(shape)
        assert not any(np.asarray(zeroed()).any() for _ in range(4))
    if shape != BIG:  # (a large buffer may be a fresh mapping each time: zero even as allocated)
        assert dirty > 0


def _timed(allocate) -> float:
    import time

    t0 = time.perf_counter()
    jax.block_until_ready(allocate())
    return time.perf_counter() - t0
