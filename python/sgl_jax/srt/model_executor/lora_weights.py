"""Writing LoRA adapters into the model's device slots (layers/lora.py) without compiling anything while serving.

Every targeted linear layer holds ``lora_a`` [n, R, in] and ``lora_b`` [n, R, out] parameters (zeros at load,
model_loader/loader.py). Writing adapter weights into slot s replaces slot s of each of them through one jitted
``dynamic_update_index_in_dim`` per distinct parameter shape, donated and compiled at warm-up
(`LoraSlotWriter.warmup_programs`), so the forward programs see new data, never a new program. Only the written
slot crosses from host to device.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Dict, List, Optional, Tuple

import jax
import numpy as np

from sgl_jax.srt.distributed.sharding import replicate_kv_rows
from sgl_jax.srt.model_executor.weight_update import leaf_name

logger = logging.getLogger(__name__)

_LEAF = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([ab])$")


class LoraSlotWriter:
    """Writes adapters into the LoRA slots of a `ModelRunner`'s parameters.

    Args:
        runner: the model runner (its ``params`` are replaced leaf by leaf).
        kv_heads, padded_kv_heads: the model's K/V heads and their count after tensor-parallel replication
            (k/v B matrices get their rows replicated as the k/v weights do).
    """

    def __init__(self, runner, kv_heads: int, padded_kv_heads: int):
        self.runner = runner
        self.kv_heads, self.padded_kv_heads = kv_heads, padded_kv_heads
        # (layer, module, "a"|"b") -> index into the runner's flat parameter leaves
        self.leaves: Dict[Tuple[int, str, str], int] = {}
        paths, _ = jax.tree_util.tree_flatten_with_path(runner.params)
        for i, (path, _) in enumerate(paths):
            m = _LEAF.match(leaf_name(path))
            if m:
                self.leaves[(int(m.group(1)), m.group(2), m.group(3))] = i
        self._set_fns: Dict[tuple, object] = {}
        # bytes of one slot on one device (a sharded half counts its shard; a replicated one whole)
        self.slot_bytes = sum(self._leaf(i).addressable_shards[0].data.nbytes
                              for i in self.leaves.values()) // max(1, self.num_slots)

    @property
    def num_slots(self) -> int:
        """Device slots of every LoRA parameter (``--max-loras-per-batch``); 0 without any."""
        return next((self._leaf(i).shape[0] for i in self.leaves.values()), 0)

    def _leaf(self, i: int) -> jax.Array:
        return self.runner._param_leaves[i]

    def _set_fn(self, leaf: jax.Array):
        key = (leaf.shape, leaf.dtype, leaf.sharding)
        if key not in self._set_fns:
            self._set_fns[key] = jax.jit(
                lambda stack, slot, value: jax.lax.dynamic_update_index_in_dim(stack, value.astype(stack.dtype),
                                                                                slot, 0),
                donate_argnums=(0,), out_shardings=leaf.sharding)
        return self._set_fns[key]

    def warmup_programs(self) -> List[Tuple[str, object]]:
        """(name, thunk lowering it) of the slot-writing program of each distinct LoRA parameter shape."""
        seen, out = set(), []
        for i in self.leaves.values():
            leaf = self._leaf(i)
            key = (leaf.shape, leaf.dtype, leaf.sharding)
            if key in seen:
                continue
            seen.add(key)
            value = np.zeros(leaf.shape[1:], np.float32)
            out.append((f"LoRA slot write {list(leaf.shape)}",
                        lambda leaf=leaf, value=value: self._set_fn(leaf).lower(leaf, np.int32(0), value)))
        return out

    def _host_values(self, adapter, layer: int, module: str, shape_a: tuple, shape_b: tuple):
        """(A [R, in], B transposed [R, out]) float32 of `adapter` (None: zeros) for one layer's module,
        rank-padded."""
        a_pad, b_pad = np.zeros(shape_a, np.float32), np.zeros(shape_b, np.float32)
        w = None if adapter is None else adapter.weights.get((layer, module))
        if w is not None:
            a, b = w
            r = a.shape[0]
            if module in ("k_proj", "v_proj") and self.padded_kv_heads != self.kv_heads:
                b = replicate_kv_rows(b, self.kv_heads, self.padded_kv_heads)
            if r > shape_a[0]:
                raise ValueError(f"LoRA adapter {adapter.name!r}: layer {layer} {module} has rank {r}, the slots "
                                 f"{shape_a[0]}")
            if a.shape[1] != shape_a[1] or b.shape[0] != shape_b[1]:
                raise ValueError(f"LoRA adapter {adapter.name!r}: layer {layer} {module} is [{b.shape[0]} x "
                                 f"{a.shape[1]}], the model's is [{shape_b[1]} x {shape_a[1]}] (another base model?)")
            a_pad[:r], b_pad[:r] = a, b.T
        return a_pad, b_pad

    def check(self, adapter) -> None:
        """Raises ValueError naming the first layer of `adapter` (a `LoraAdapter`) the model has no slots for or
        whose shape differs from the model's (an adapter of another base model); what a load checks before it
        answers."""
        extra = [k for k in adapter.weights if (k[0], k[1], "a") not in self.leaves]
        if extra:
            raise ValueError(f"LoRA adapter {adapter.name!r} has weights for layer {extra[0][0]} {extra[0][1]}, "
                             "which the model has no slots for")
        for (layer, module) in adapter.weights:
            la, lb = self._leaf(self.leaves[(layer, module, "a")]), self._leaf(self.leaves[(layer, module, "b")])
            self._host_values(adapter, layer, module, la.shape[1:], lb.shape[1:])

    def write(self, slot: int, adapter: Optional[object]) -> float:
        """Put `adapter` (a `LoraAdapter`; None: clear) into device slot `slot`; returns the seconds it took.

        Raises:
            ValueError: as `check` (nothing is written then).
        """
        t0 = time.perf_counter()
        if adapter is not None:
            self.check(adapter)
        updates = {}
        for (layer, module, half), i in self.leaves.items():
            if half != "a":
                continue
            ia, ib = i, self.leaves[(layer, module, "b")]
            la, lb = self._leaf(ia), self._leaf(ib)
            a, b = self._host_values(adapter, layer, module, la.shape[1:], lb.shape[1:])
            updates[ia], updates[ib] = a, b
        leaves = list(self.runner._param_leaves)
        for i, value in updates.items():
            leaves[i] = self._set_fn(leaves[i])(leaves[i], np.int32(slot), value)
        self.runner.params = jax.tree.unflatten(self.runner._param_treedef, leaves)
        return time.perf_counter() - t0
