"""The model's weights while serving: replaced in place (from a checkpoint on disk or from named tensors), read
back by name, and released from and restored to the devices, with the KV buffers (SGLang's
``update_weights_from_disk``, ``update_weights_from_tensor``, ``get_weights_by_name``,
``release_memory_occupation`` and ``resume_memory_occupation``, which RL frameworks call between training steps).

Nothing here compiles: every new array has the shape, dtype and sharding of the one it replaces (checked), so
the compiled programs read it as they read the old one. The KV buffers are re-made by the allocation programs
compiled at start-up (`ModelRunner.allocate_kv`).

A checkpoint update places the new tensors next to the old ones and swaps them all at once when every tensor has
arrived, so a refused or unreadable checkpoint leaves the served weights untouched; the devices need room for a
second copy of the weights meanwhile (release the KV buffers first where they do not have it).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from typing import Dict, Iterable, List, Optional, Tuple

import jax
import numpy as np

from sgl_jax.srt.model_loader.loader import KV_SCALES, LORA_SLOTS, CheckpointPlacer, weight_source

logger = logging.getLogger(__name__)

# ModelConfig fields two checkpoints must share for one's weights to replace the other's
MATCHING_FIELDS = ("architecture", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "layer_types", "sliding_window", "quantization")
MAX_WEIGHT_VALUES = 1 << 20  # the most values get_weights_by_name returns (a JSON array of floats)
# hf config entries that size parameters without a ModelConfig field of their own (absent ones are skipped)
MATCHING_HF_FIELDS = ("intermediate_size", "moe_intermediate_size", "num_experts", "num_local_experts",
                      "tie_word_embeddings")


def leaf_name(path) -> str:
    """A parameter's dotted name (HF style: ``model.layers.0.self_attn.q_proj.weight``) from its pytree path."""
    parts = []
    for k in path:
        key = getattr(k, "key", getattr(k, "name", getattr(k, "idx", None)))
        if key is not None and key != "value":
            parts.append(str(key))
    return ".".join(parts)


def param_index(runner) -> Dict[str, int]:
    """Parameter name -> its index among the runner's flat parameter leaves."""
    paths, _ = jax.tree_util.tree_flatten_with_path(runner.params)
    return {leaf_name(path): i for i, (path, _) in enumerate(paths)}


def config_mismatch(old, new) -> Optional[str]:
    """The first difference between two `ModelConfig`s that would change a parameter's shape (None: none), as
    ``"<field>: <old> != <new>"``."""
    for field in MATCHING_FIELDS:
        a, b = getattr(old, field), getattr(new, field)
        if a != b:
            return f"{field}: {a!r} (served) != {b!r} (new checkpoint)"
    for field in MATCHING_HF_FIELDS:
        a, b = getattr(old.hf_config, field, None), getattr(new.hf_config, field, None)
        if a != b:
            return f"{field}: {a!r} (served) != {b!r} (new checkpoint)"
    return None


def _replaceable(name: str) -> bool:
    """Whether parameter `name` comes from a checkpoint (LoRA slots and default fp8 KV scales do not)."""
    return not name.endswith(LORA_SLOTS + KV_SCALES)


def checkpoint_values(runner, new_config, load_format: str) -> Dict[str, jax.Array]:
    """Every parameter of the served model, read from `new_config`'s checkpoint and placed in its sharding.

    Raises:
        ValueError: a tensor's shape differs from the served parameter's (naming both), or a parameter has no
            tensor in the checkpoint (naming the first).
    """
    index = param_index(runner)
    leaves = runner._param_leaves
    shapes = {n: tuple(leaves[i].shape) for n, i in index.items()}
    writer = CheckpointPlacer(runner.model_config, shapes, runner.mesh)
    source, _ = weight_source(new_config, load_format)
    for name, arr in source:
        writer.add(name, arr)
    missing = [n for n in index if _replaceable(n) and n not in writer.values]
    if missing:
        raise ValueError(f"the new checkpoint has no tensor for {len(missing)} parameters, e.g. {missing[0]}")
    return writer.values


def tensor_values(runner, named_tensors: Iterable[Tuple[str, object]]) -> Dict[str, jax.Array]:
    """The parameters `named_tensors` ((HF name, host array) pairs, as a checkpoint holds them) fill, placed as
    the loader places them (sharding, k/v head replication, quantization of quantized layers, stacked experts).

    Raises:
        ValueError: an unknown name, or a shape that is not the parameter's (naming it).
    """
    index = param_index(runner)
    leaves = runner._param_leaves
    writer = CheckpointPlacer(runner.model_config, {n: tuple(leaves[i].shape) for n, i in index.items()},
                              runner.mesh)
    for name, arr in named_tensors:
        writer.add(name, np.asarray(arr))
        if writer.ignored:
            raise ValueError(f"{writer.ignored[0]!r} is not a parameter of the served model")
    partial = sorted(writer.stacker.buffers)
    if partial:  # (a stacked expert parameter is replaced whole: a call must carry all of its experts)
        raise ValueError(f"{partial[0]}: {len(writer.stacker.filled[partial[0]])} of its experts were given; send "
                         "every expert of a layer's stacked parameter in one call")
    return writer.values


def swap_values(runner, values: Dict[str, jax.Array]) -> None:
    """Replace the runner's parameters named in `values` (all at once).

    Raises:
        ValueError: a new array's shape, dtype or sharding differs from the served one (the compiled programs
            would not take it), naming the first.
    """
    index = param_index(runner)
    leaves = list(runner._param_leaves)
    for name, new in values.items():
        old = leaves[index[name]]
        if (new.shape, new.dtype) != (old.shape, old.dtype) or not new.sharding.is_equivalent_to(old.sharding,
                                                                                                 old.ndim):
            raise ValueError(f"{name}: new {new.dtype}{list(new.shape)} ({new.sharding}) does not match the served "
                             f"{old.dtype}{list(old.shape)} ({old.sharding})")
        leaves[index[name]] = new
    runner.params = jax.tree.unflatten(runner._param_treedef, leaves)


def weight_rows(runner, name: str, truncate_size: int = 100) -> list:
    """The first `truncate_size` rows of parameter `name` (HF name, as stored: [out, in] for a linear weight,
    k/v heads replicated past tp, a quantized layer's int8/fp8 values) as nested float lists (SGLang's
    ``get_weights_by_name``).

    Raises:
        KeyError: no parameter has that name.
        ValueError: more than MAX_WEIGHT_VALUES values asked for.
    """
    index = param_index(runner)
    if name not in index:
        raise KeyError(name)
    leaf = runner._param_leaves[index[name]]
    if leaf.ndim == 0:
        return float(np.asarray(jax.device_get(leaf)))
    n = min(leaf.shape[0], max(0, int(truncate_size)))
    row = int(np.prod(leaf.shape[1:]))
    if n * row > MAX_WEIGHT_VALUES:
        raise ValueError(f"truncate_size: {n} rows of {name} are {n * row} values; at most {MAX_WEIGHT_VALUES} are "
                         f"returned (ask for {max(1, MAX_WEIGHT_VALUES // row)} rows or fewer)")
    out = np.zeros((n, *leaf.shape[1:]), np.float64)
    for shard in leaf.addressable_shards:  # (only the shards holding those rows come to the host; no compile)
        idx = shard.index
        start = idx[0].start or 0
        if start < n:
            data = np.asarray(shard.data, np.float64)
            out[(slice(start, min(n, start + data.shape[0])), *idx[1:])] = data[:n - start]
    return out.tolist()


def device_bytes_in_use() -> int:
    """Bytes the local devices hold: the backend's own count where it reports one (TPU, GPU), else the live
    arrays' (CPU)."""
    gc.collect()  # (arrays only garbage holds are freed first)
    stats = [d.memory_stats() for d in jax.local_devices()]
    if all(s is not None and "bytes_in_use" in s for s in stats):
        return int(sum(s["bytes_in_use"] for s in stats))
    return int(sum(_local_bytes(a) for a in jax.live_arrays()))


def _local_bytes(x: jax.Array) -> int:
    """Bytes of `x` on this host's devices (from its sharding: reading ``shard.data`` would make new arrays)."""
    return int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize * len(x.sharding.addressable_devices)


@dataclasses.dataclass
class Occupation:
    """What `MemoryOccupation.release` took off the devices: KV buffers, weights (kept on the host here)."""

    kv_cache: bool = False
    weights: Optional[List[np.ndarray]] = None  # host copies of the flat parameter leaves


class MemoryOccupation:
    """Releases the KV buffers and the weights from the devices, and restores them (SGLang's tags ``kv_cache``
    and ``weights``). Released KV comes back zeroed (its contents were the caller's to drop: the prefix cache is
    flushed first); released weights come back from their host copy, or stay as a weight update placed them."""

    def __init__(self, runner):
        self.runner = runner
        self.released = Occupation()

    @property
    def kv_released(self) -> bool:
        return self.released.kv_cache

    @property
    def weights_released(self) -> bool:
        return self.released.weights is not None

    def release(self, kv_cache: bool, weights: bool) -> Tuple[float, int]:
        """Free the KV buffers and/or the weights on the devices; returns (seconds, bytes of the freed arrays on
        this host's devices)."""
        t0 = time.perf_counter()
        runner, freed = self.runner, 0
        if kv_cache and not self.kv_released:
            freed += sum(_local_bytes(x) for kv in runner.kv_caches for x in kv)
            for k, v in runner.kv_caches:
                k.delete()
                v.delete()
            runner.kv_caches = None
            self.released.kv_cache = True
        if weights and not self.weights_released:
            leaves = runner._param_leaves
            self.released.weights = [np.asarray(jax.device_get(x)) for x in leaves]
            self._shardings = [x.sharding for x in leaves]
            freed += sum(_local_bytes(x) for x in leaves)
            for x in leaves:
                x.delete()
        return time.perf_counter() - t0, freed

    def resume(self, kv_cache: bool, weights: bool) -> float:
        """Put back what `release` freed (the named parts); returns seconds."""
        t0 = time.perf_counter()
        runner = self.runner
        if weights and self.weights_released:
            leaves = [jax.device_put(h, s) for h, s in zip(self.released.weights, self._shardings)]
            runner.params = jax.tree.unflatten(runner._param_treedef, leaves)
            self.released.weights = None
        if kv_cache and self.kv_released:
            runner.kv_caches = runner.allocate_kv()
            self.released.kv_cache = False
        return time.perf_counter() - t0

    def weights_replaced(self) -> None:
        """A weight update placed new weights while the old ones were released: they stay, the host copy goes."""
        self.released.weights = None
