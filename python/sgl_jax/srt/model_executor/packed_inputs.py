"""A step's host inputs (ForwardBatch and SamplingBatch arrays) as one int32 buffer: one host-to-device copy a step.

Putting each of a step's ~30 small arrays on the device separately costs a transfer and Python dispatch each (on an
H100 the host's work per decode step of a tiny model, ~4 ms, was mostly that, against ~1 ms of device time). The
arrays are int32, float32 or bool: float32 travels bit for bit (a view as int32), bool as 0/1. The layout -- the
pytree structure, each leaf's dtype, shape and offset -- depends only on the step's padded shape, so it is a static
argument of the compiled step and one program serves every step of a bucket, as before.
"""

from __future__ import annotations

import math
from typing import Any, Tuple

import jax
import jax.numpy as jnp
import numpy as np

Layout = Tuple[Any, Tuple[Tuple[str, Tuple[int, ...], int], ...]]  # (treedef, per leaf (dtype, shape, offset))


def pack(tree) -> Tuple[np.ndarray, Layout]:
    """(int32[N] buffer of every leaf of `tree`, raveled in order; its `Layout`). Leaves must be host arrays (or
    scalars) of a 4-byte dtype or bool.

    Raises:
        TypeError: a leaf of another dtype.
    """
    leaves, treedef = jax.tree.flatten(tree)
    parts, specs, offset = [], [], 0
    for leaf in leaves:
        a = np.asarray(leaf)
        if a.dtype == np.bool_:
            flat = a.astype(np.int32).ravel()
        elif a.dtype.itemsize == 4:
            flat = np.ascontiguousarray(a).view(np.int32).ravel()
        else:
            raise TypeError(f"cannot pack a {a.dtype} step input (int32, float32 or bool only)")
        specs.append((a.dtype.str, tuple(a.shape), offset))
        parts.append(flat)
        offset += flat.size
    buf = np.concatenate(parts) if parts else np.zeros((0,), np.int32)
    return buf, (treedef, tuple(specs))


def unpack(buf: jax.Array, layout: Layout):
    """The tree `pack` packed into `buf` (int32[N], traced), each leaf back in its dtype and shape."""
    treedef, specs = layout
    leaves = []
    for dtype, shape, offset in specs:
        x = buf[offset:offset + math.prod(shape)].reshape(shape)
        dt = np.dtype(dtype)
        if dt == np.bool_:
            x = x != 0
        elif dt != np.int32:
            x = jax.lax.bitcast_convert_type(x, jnp.dtype(dt))
        leaves.append(x)
    return jax.tree.unflatten(treedef, leaves)
