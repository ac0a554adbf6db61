"""Explicit host <-> device copies of a step's small arrays, at the cost of the copy rather than of Python.

``jax.device_put`` of one small host array costs ~40 us of Python on a 2-core CPU (argument canonicalisation, the
sharding and layout checks of a general API); the copy itself is ~4 us. A decode step makes one such copy, so on a
small model that overhead alone was a fifth of a step. `put` calls JAX's own batched copy primitive (the one
``jax.device_put`` ends in) inside JAX's explicit-transfer scope, so ``jax.transfer_guard("disallow")`` still
accepts it as explicit; where a JAX release lacks those internals it is ``jax.device_put``. `get` is
``np.asarray`` under the explicit device-to-host scope (``jax.device_get``'s tree handling skipped). Both set the
scope's thread-local flag directly: JAX's own context managers are generators, a few us each in a decode step.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Tuple

import jax
import numpy as np

try:  # JAX internals (jax/_src/api.py device_put's own path); jax.device_put where they are missing
    from jax._src import core as _core
    from jax._src.lib import guard_lib as _guard_lib
    from jax._src.lib import xla_client as _xc

    _batched_device_put = _xc.batched_device_put
    _guard_state = _guard_lib.thread_local_state  # (what config.explicit_device_put/get_scope set, without a generator)
    _ = (_guard_state().explicit_device_put, _guard_state().explicit_device_get)  # (a JAX without them: the fallback)
    _ShapedArray = _core.ShapedArray
except (ImportError, AttributeError):  # pragma: no cover - depends on the JAX release
    _batched_device_put = None
    _guard_state = None

_avals: Dict[Tuple[tuple, str], object] = {}


def put(x: np.ndarray, sharding) -> jax.Array:
    """`x` (a host numpy array) on the devices of `sharding`, replicated (a fully replicated NamedSharding: every
    device gets all of it), committed to it: what ``jax.device_put(x, sharding)`` returns."""
    if _batched_device_put is None:
        return jax.device_put(x, sharding)
    key = (x.shape, x.dtype.str)
    aval = _avals.get(key)
    if aval is None:
        aval = _avals[key] = _ShapedArray(x.shape, x.dtype)
    devices = getattr(sharding, "_addressable_device_assignment", None) or tuple(sharding.addressable_devices)
    state = _guard_state()  # JAX's explicit-transfer scope (config.explicit_device_put_scope), set and restored
    prev, state.explicit_device_put = state.explicit_device_put, True
    try:
        return _batched_device_put(aval, sharding, [x] * len(devices), list(devices), True)
    finally:
        state.explicit_device_put = prev


def start_get(x: jax.Array) -> None:
    """Start copying `x` to the host without waiting (``x.copy_to_host_async()``); a fully replicated array copies
    its first device's buffer through JAX's own single-buffer method (the public one's annotation and sharding
    checks skipped: ~3 us of a decode step's host time)."""
    fast = getattr(x, "_copy_single_device_array_to_host_async", None)
    if fast is not None and x.is_fully_replicated and getattr(x, "_npy_value", None) is None:
        fast()
    else:
        x.copy_to_host_async()


def get(x: jax.Array) -> np.ndarray:
    """`x` on the host (waits for it): ``jax.device_get`` of one array."""
    if _guard_state is None:
        return jax.device_get(x)
    state = _guard_state()  # (config.explicit_device_get_scope's flag, set and restored)
    prev, state.explicit_device_get = state.explicit_device_get, True
    try:
        return np.asarray(x)
    finally:
        state.explicit_device_get = prev


def transfer_guard(enabled: bool):
    """``jax.transfer_guard("disallow")`` when `enabled` (every implicit host <-> device transfer then raises;
    `put`, `get` and ``jax.device_put`` stay allowed), else a context that does nothing."""
    return jax.transfer_guard("disallow") if enabled else contextlib.nullcontext()
