"""The device mesh every array of the engine is placed on: axes ``("data", "tensor")``.

``tensor`` (size ``--tp-size``) is what the model is sharded over (tensor parallelism, Megatron-LM style:
Shoeybi et al. 2019); ``data`` (size ``--dp-size``) holds data-parallel attention ranks. tp 1 and dp 1 is a
mesh of one device: the same code, no special case. Communication is JAX's own (XLA collectives inserted by
GSPMD and inside ``jax.shard_map``), never an RPC layer of ours.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

AXES = ("data", "tensor")


def select_devices(tp_size: int, dp_size: int = 1, device_indexes: Optional[Sequence[int]] = None,
                   devices: Optional[List] = None) -> List:
    """The ``dp_size * tp_size`` devices of the mesh: ``device_indexes`` into `devices` (default
    ``jax.devices()``), else the first ones.

    Raises:
        ValueError: sizes below 1, too few devices, or device indexes out of range, repeated or of the wrong count.
    """
    if tp_size < 1 or dp_size < 1:
        raise ValueError(f"--tp-size and --dp-size must be >= 1, got {tp_size} and {dp_size}")
    devices = list(jax.devices() if devices is None else devices)
    need = tp_size * dp_size
    if device_indexes is None:
        if len(devices) < need:
            raise ValueError(f"--dp-size {dp_size} x --tp-size {tp_size} needs {need} devices, "
                             f"{len(devices)} are visible ({devices[0].platform})")
        return devices[:need]
    idx = list(device_indexes)
    if len(idx) != need or len(set(idx)) != need or any(not 0 <= i < len(devices) for i in idx):
        raise ValueError(f"--device-indexes must be {need} distinct indexes in [0, {len(devices)}), got {idx}")
    return [devices[i] for i in idx]


def create_mesh(tp_size: int = 1, dp_size: int = 1, device_indexes: Optional[Sequence[int]] = None,
                devices: Optional[List] = None) -> Mesh:
    """A ``Mesh`` of shape (dp_size, tp_size) with axes ``("data", "tensor")`` (see `select_devices`)."""
    chosen = select_devices(tp_size, dp_size, device_indexes, devices)
    return Mesh(np.array(chosen, dtype=object).reshape(dp_size, tp_size), AXES)


def tp_size_of(mesh: Mesh) -> int:
    """Devices along the ``tensor`` axis."""
    return int(mesh.shape["tensor"])
