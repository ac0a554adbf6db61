"""How each array is sharded over the mesh: one table of PartitionSpecs by parameter kind.

Tensor parallelism (Shoeybi et al. 2019, "Megatron-LM"), with weights in HF layout (``Linear.weight`` is
``[out_features, in_features]``):

- column-parallel (q/k/v/gate/up projections): the output features are split, ``P("tensor", None)``;
  their biases ``P("tensor")``;
- row-parallel (o/down projections): the input features are split, ``P(None, "tensor")``; XLA all-reduces
  the partial sums;
- vocab-parallel: the embedding table and the LM head ``[vocab, hidden]`` split the vocabulary,
  ``P("tensor", None)``; logits are gathered (replicated) before sampling;
- a quantized layer's scales follow its weight: per output channel (``weight_scale`` [out], --quantization) split
  with a column-parallel layer's and replicated with a row-parallel one's; per group of input features
  (``weight_scale`` / ``weight_min`` [out, groups]: GGUF and HF FP8 blocks) split like the weight (a row-parallel
  layer's replicated when the groups do not split evenly: the loader's `_Placer`);
- everything else (norms, per-head q/k norms) is replicated.

Data-parallel attention ranks (``--dp-size``, the mesh's ``data`` axis): every array of a step is the ranks'
arrays stacked along axis 0 (rank r's tokens, sequences and KV pages in block r), sharded ``P("data", ...)``; weights
are replicated over ``data``. A rank's attention reads only its own block of the KV cache.

KV heads: the KV cache ``[pages, page_size, kv_heads, head_dim]`` is sharded over heads. When a model has
fewer KV heads than ``tp`` (GQA), each KV head is replicated ``tp / kv_heads`` times so every device holds
exactly one (SGLang's behaviour); k/v projection rows are repeated to match when the weights are placed.
"""

from __future__ import annotations

import re
from typing import List, Optional, Tuple

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

COLUMN = P("tensor", None)
ROW = P(None, "tensor")
VOCAB = P("tensor", None)
REPLICATED = P()
KV_CACHE = P("data", None, "tensor", None)  # [dp * pages, page_size, kv_heads, head_dim]: rank r's pages, r's block
HEADS = P("data", "tensor", None)  # activations [dp * tokens, heads, head_dim]: each rank's tokens on its row
RANK_ROWS = P("data")  # per-rank step metadata stacked along axis 0 (tokens, sequences, or one value per rank)

# (regex over the dotted parameter path, spec); the first match wins, no match means replicated
PARAM_SPECS: List[Tuple[str, P]] = [
    (r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$", COLUMN),
    (r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(bias|weight_scale|weight_min)$", P("tensor")),
    (r"\.(o_proj|down_proj)\.(weight|weight_scale|weight_min)$", ROW),
    (r"\.self_attn\.(k_scale|v_scale)$", P("tensor")),  # an fp8 KV cache's per-KV-head scales, with the heads
    # LoRA slots (layers/lora.py): B [n, R, out] split like a column-parallel weight's output features, A [n, R, in]
    # like a row-parallel weight's input features; the other halves replicated
    (r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.lora_b$", P(None, None, "tensor")),
    (r"\.(o_proj|down_proj)\.lora_a$", P(None, None, "tensor")),
    (r"(^|\.)(embed_tokens|lm_head)\.(weight|weight_scale)$", VOCAB),  # (a quantized table's scales [vocab, groups])
]


# a mixture-of-experts layer's stacked expert weights ([E, in, out], layers/moe.py)
STACKED_EXPERTS = r"\.experts\.\w+$"
EXPERTS = P("tensor", None, None)  # expert parallelism over the tensor axis: each device holds E / tp experts
EXPERTS_OVER_MESH = P(("data", "tensor"), None, None)  # over every device (DP attention + EP): E / (dp * tp) each


def expert_axes(ep_size: int, tp_size: int, dp_size: int = 1) -> Tuple[str, ...]:
    """The mesh axes a mixture-of-experts layer's experts are split over for ``--ep-size`` (SGLang's flag):

    - ``()`` at 1: every device holds every expert;
    - ``("tensor",)`` at ``tp_size``: the experts are split over the tensor axis and replicated over the
      data-parallel ranks (each rank's tokens are already on every device of its tensor axis);
    - ``("data", "tensor")`` at ``dp_size * tp_size`` with ``dp_size > 1``: split over every device (DP attention
      + EP, the usual large-MoE deployment: SGLang's ``--enable-dp-attention --ep-size``); the ranks' tokens are
      gathered to every device and the outputs reduce-scattered back (layers/moe.experts_expert_parallel).
      Device ``d * tp + t`` holds experts ``[(d * tp + t) * E / ep, ...)``.

    Raises:
        ValueError: any other ``ep_size`` (the message names ``--ep-size`` and the values it may take).
    """
    if ep_size == 1:
        return ()
    if ep_size == tp_size:
        return ("tensor",)
    if dp_size > 1 and ep_size == dp_size * tp_size:
        return ("data", "tensor")
    allowed = sorted({1, tp_size, dp_size * tp_size})
    raise ValueError(f"--ep-size must be one of {allowed} (1, --tp-size, or --tp-size x --dp-size: experts split "
                     f"over no axis, the tensor axis, or every device), got {ep_size}")


def param_spec(name: str, expert_axes: Tuple[str, ...] = (), ndim: Optional[int] = None) -> P:
    """The PartitionSpec of the parameter at dotted path `name` (e.g. ``model.layers.0.mlp.up_proj.weight``).
    Stacked expert weights are split by expert over `expert_axes` (`expert_axes`: from ``--ep-size``; empty:
    replicated). `ndim`: the parameter's rank, when known: a spec of more axes (a row-parallel layer's
    per-channel ``weight_scale`` [out] under the rule for its [out, groups] form) means replicated."""
    if re.search(STACKED_EXPERTS, name):  # (quantized experts' scales [E, out]: the same split of E)
        spec = {(): REPLICATED, ("tensor",): EXPERTS, ("data", "tensor"): EXPERTS_OVER_MESH}[tuple(expert_axes)]
        return P(*tuple(spec)[:ndim]) if ndim is not None else spec
    for pattern, spec in PARAM_SPECS:
        if re.search(pattern, name):
            return REPLICATED if ndim is not None and len(spec) > ndim else spec
    return REPLICATED


def padded_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads held in the cache and computed by k/v_proj under tensor parallelism: ``num_kv_heads`` when tp
    divides it, else ``tp_size`` (each KV head replicated ``tp_size / num_kv_heads`` times).

    Raises:
        ValueError: neither divides the other.
    """
    if num_kv_heads % tp_size == 0:
        return num_kv_heads
    if tp_size % num_kv_heads == 0:
        return tp_size
    raise ValueError(f"--tp-size {tp_size} must divide the model's {num_kv_heads} KV heads or be a multiple of it")


def check_tp(num_heads: int, num_kv_heads: int, vocab_size: int, intermediate_size: int, tp_size: int) -> None:
    """Raises ValueError (naming --tp-size) when the model cannot be split ``tp_size`` ways: attention heads,
    KV heads, vocabulary and MLP width must divide evenly (KV heads may also be replicated)."""
    for what, n in (("attention heads", num_heads), ("vocabulary size", vocab_size),
                    ("intermediate size", intermediate_size)):
        if n % tp_size:
            raise ValueError(f"--tp-size {tp_size} does not divide the model's {what} ({n})")
    padded_kv_heads(num_kv_heads, tp_size)


def replicate_kv_rows(weight, num_kv_heads: int, padded: int):
    """k/v_proj weight ``[kv_heads * head_dim, ...]`` (or bias) -> ``[padded * head_dim, ...]`` with each head's
    rows repeated ``padded / kv_heads`` times in place (head h -> heads h*r .. h*r + r - 1), so tensor shard i
    holds KV head ``i // r``: the one its query heads use. `weight`: a numpy array (the loader's host tensors) or
    a jax array (dummy weights drawn on device, traced under jit); the result is of the same kind."""
    if padded == num_kv_heads:
        return weight
    head_dim = weight.shape[0] // num_kv_heads
    heads = weight.reshape(num_kv_heads, head_dim, *weight.shape[1:])
    xp = np if isinstance(weight, np.ndarray) else jnp  # host arrays, or jax arrays (traced ones too)
    return xp.repeat(heads, padded // num_kv_heads, axis=0).reshape(padded * head_dim, *weight.shape[1:])
