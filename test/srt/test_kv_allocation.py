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
