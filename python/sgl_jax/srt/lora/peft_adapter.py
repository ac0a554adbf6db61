"""PEFT LoRA adapters read from disk or the hub: ``adapter_config.json`` + ``adapter_model.safetensors``.

An adapter adds ``scaling * B (A x)`` to the output of each targeted linear layer (Hu et al., "LoRA: Low-Rank
Adaptation of Large Language Models", 2021), with PEFT's ``scaling = lora_alpha / r``, or ``lora_alpha / sqrt(r)``
with ``use_rslora`` (Kalajdzievski, "A Rank Stabilization Scaling Factor for Fine-Tuning with LoRA", 2023);
``rank_pattern`` / ``alpha_pattern`` give single modules their own r and alpha, matched as PEFT matches them
(``(.*\\.)?(key)$`` against the module's dotted name). The scaling is folded into B here, so the serving side
computes ``(x A^T) B'^T`` only.

Served targets: the attention and MLP projections of a Llama-family decoder (`LORA_MODULES`). Anything else in
the file (DoRA magnitudes, biases, ``modules_to_save`` copies, embedding or LM-head adapters) is refused with a
message naming it, never silently dropped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Dict, Iterable, Optional, Tuple

import numpy as np

# the linear layers an adapter may target, in a decoder layer's order, and the submodule holding each
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODULE_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                 "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# row-parallel layers (their input features are split under tensor parallelism: A is split with them)
ROW_PARALLEL = ("o_proj", "down_proj")

_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.[\w-]+)?\.weight$")


def normalize_target_modules(names: Optional[Iterable[str]]) -> Tuple[str, ...]:
    """``--lora-target-modules`` (names of `LORA_MODULES`, or ``all``) -> the served targets in layer order.

    Raises:
        ValueError: a name outside `LORA_MODULES` and ``all`` (the message lists what is accepted).
    """
    names = list(names or ())
    if "all" in names:
        return LORA_MODULES
    bad = [n for n in names if n not in LORA_MODULES]
    if bad:
        raise ValueError(f"--lora-target-modules: {bad} not supported; choose from {list(LORA_MODULES)} or 'all'")
    return tuple(m for m in LORA_MODULES if m in names)


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """One adapter, on the host.

    Attributes:
        name: the name requests use (``lora_path``, ``model: "<base>:<name>"``).
        path: where it was read from (a directory, or a hub id).
        rank: the largest r of its modules.
        targets: the `LORA_MODULES` it adapts (in layer order).
        weights: (layer, module) -> (A float32 [r, in_features], B float32 [out_features, r] with the module's
            scaling multiplied in).
        use_rslora: whether its config asks for rsLoRA's scaling.
    """

    name: str
    path: str
    rank: int
    targets: Tuple[str, ...]
    weights: Dict[Tuple[int, str], Tuple[np.ndarray, np.ndarray]]
    use_rslora: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of its host weights (float32)."""
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def adapter_dir(path: str, revision: Optional[str] = None, cache_dir: Optional[str] = None) -> str:
    """The local directory of adapter `path`: an existing directory, else a hub id fetched into the cache
    (`model_loader.hub.download_adapter`).

    Raises:
        FileNotFoundError: neither a directory with adapter_config.json nor a hub adapter.
    """
    from sgl_jax.srt.model_loader.hub import download_adapter, is_hub_id

    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "adapter_config.json")):
            raise FileNotFoundError(f"LoRA adapter {path!r} has no adapter_config.json (not a PEFT adapter)")
        return path
    if is_hub_id(path):
        return download_adapter(path, revision, cache_dir)
    raise FileNotFoundError(f"LoRA adapter {path!r} is neither a directory nor a hub id org/name")


def read_adapter_config(directory: str) -> dict:
    """``adapter_config.json`` of a PEFT adapter directory, checked for what serving supports.

    Raises:
        ValueError: not a LoRA adapter (``peft_type``), DoRA, trained biases, ``modules_to_save`` or
            ``fan_in_fan_out`` (each named).
    """
    with open(os.path.join(directory, "adapter_config.json")) as f:
        cfg = json.load(f)
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"adapter {directory!r} is a {peft_type} adapter; only LoRA is served")
    refused = [("use_dora", bool(cfg.get("use_dora"))), ("bias", cfg.get("bias", "none") not in (None, "none")),
               ("lora_bias", bool(cfg.get("lora_bias"))), ("modules_to_save", bool(cfg.get("modules_to_save"))),
               ("fan_in_fan_out", bool(cfg.get("fan_in_fan_out"))),
               ("trainable_token_indices", bool(cfg.get("trainable_token_indices"))),
               ("alora_invocation_tokens", bool(cfg.get("alora_invocation_tokens"))),
               ("layer_replication", bool(cfg.get("layer_replication"))),
               ("target_parameters", bool(cfg.get("target_parameters")))]
    bad = [k for k, on in refused if on]
    if bad:
        raise ValueError(f"adapter {directory!r}: {', '.join(bad)} not supported (served: plain LoRA on "
                         f"{list(LORA_MODULES)})")
    return cfg


def _pattern_value(patterns: dict, module_name: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching the module's dotted name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def load_peft_adapter(name: str, path: str, *, revision: Optional[str] = None,
                      cache_dir: Optional[str] = None) -> LoraAdapter:
    """Read a PEFT LoRA adapter into float32 host arrays, scaling folded into B.

    Args:
        name: the adapter's serving name.
        path: a directory or a hub id (`adapter_dir`).
    Raises:
        FileNotFoundError: see `adapter_dir`; or no ``adapter_model.safetensors`` (a ``.bin``-only adapter is not
            read: re-save it with safetensors).
        ValueError: see `read_adapter_config`; a tensor that is not the A or B of a `LORA_MODULES` layer, or an A
            without its B.
    """
    from sgl_jax.srt.model_loader.loader import safetensors_tensors

    directory = adapter_dir(path, revision, cache_dir)
    cfg = read_adapter_config(directory)
    file = os.path.join(directory, "adapter_model.safetensors")
    if not os.path.exists(file):
        raise FileNotFoundError(f"LoRA adapter {path!r} has no adapter_model.safetensors")
    tensors = dict(safetensors_tensors(file))  # (bfloat16 adapters too: widened to float32 below)
    halves: Dict[Tuple[int, str], Dict[str, np.ndarray]] = {}
    for key, arr in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(3) not in LORA_MODULES or MODULE_PARENT[m.group(3)] != m.group(2):
            raise ValueError(f"adapter {name!r}: tensor {key!r} is not the lora_A / lora_B of a served target "
                             f"({list(LORA_MODULES)})")
        halves.setdefault((int(m.group(1)), m.group(3)), {})[m.group(4)] = np.asarray(arr, np.float32)
    use_rslora = bool(cfg.get("use_rslora", False))
    alpha = float(cfg.get("lora_alpha", 8))  # (PEFT's default)
    weights = {}
    for (layer, module), ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"adapter {name!r}: layer {layer} {module} has lora_{''.join(ab)} only")
        a, b = ab["A"], ab["B"]
        r = a.shape[0]
        if b.shape[1] != r:
            raise ValueError(f"adapter {name!r}: layer {layer} {module}: lora_A {a.shape} and lora_B {b.shape} "
                             f"disagree on the rank")
        dotted = f"model.layers.{layer}.{MODULE_PARENT[module]}.{module}"
        a_m = float(_pattern_value(cfg.get("alpha_pattern"), dotted, alpha))
        scaling = a_m / math.sqrt(r) if use_rslora else a_m / r
        weights[(layer, module)] = (a, b * np.float32(scaling))
    if not weights:
        raise ValueError(f"adapter {name!r} ({path}) holds no LoRA weights")
    targets = tuple(m for m in LORA_MODULES if any(mod == m for _, mod in weights))
    rank = max(a.shape[0] for a, _ in weights.values())
    return LoraAdapter(name=name, path=path, rank=rank, targets=targets, weights=weights, use_rslora=use_rslora)


def adapter_shape(path: str, revision: Optional[str] = None, cache_dir: Optional[str] = None) -> Tuple[int, tuple]:
    """(rank, targets) an adapter needs, from its config alone (``r``, ``rank_pattern``, ``target_modules``): what
    start-up sizes the slots by when --max-lora-rank / --lora-target-modules are not given (SGLang infers them
    the same way). ``target_modules`` given as a regex or ``all-linear`` counts as every served module.

    Raises:
        FileNotFoundError, ValueError: as `adapter_dir` and `read_adapter_config`.
    """
    cfg = read_adapter_config(adapter_dir(path, revision, cache_dir))
    rank = max([int(cfg.get("r", 8))] + [int(v) for v in (cfg.get("rank_pattern") or {}).values()])
    tm = cfg.get("target_modules")
    if isinstance(tm, list):
        targets = tuple(m for m in LORA_MODULES if any(str(t).split(".")[-1] == m for t in tm))
    else:
        targets = LORA_MODULES
    return rank, targets
