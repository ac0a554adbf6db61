"""Quantized checkpoints: what a model's config.json says about its own quantization (``quantization_config``), and
which `QuantScheme` serves it.

Served as stored (no detour through a float copy):

- HF FP8, block-wise (``quant_method: "fp8"``, ``fmt: "e4m3"``, ``weight_block_size: [bo, bi]``, each projection's
  ``weight`` float8_e4m3fn [out, in] and ``weight_scale_inv`` float32 [ceil(out / bo), in / bi], w = q * scale):
  transformers' ``FineGrainedFP8Config``, the dense Qwen3-*-FP8 releases' layout (an MoE release's experts are refused
  at load). Weight-only here: activations
  stay in the model dtype (SGLang quantizes them per group of 128 on GPUs with fp8 dots).
- compressed-tensors int8 (``quant_method: "compressed-tensors"``, ``format: "int-quantized"``, one config group of
  8-bit symmetric int weights with ``strategy: "channel"``; ``weight`` int8 [out, in], ``weight_scale`` [out, 1]),
  with 8-bit dynamic per-token activations (W8A8: llm-compressor's ``W8A8`` scheme) -> ``w8a8_int8``, or without
  (an int-quantized W8A16) -> ``int8``.
- a GGUF file with ``--quantization gguf``: Q8_0 / Q4_0 / Q4_1 blocks of 32 kept as int8 plus per-block scales
  (and Q4_1's mins); see model_loader/gguf_blocks.py.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Set, Tuple

from sgl_jax.srt.quantization.methods import QuantScheme, as_scheme
from sgl_jax.srt.server_args import QUANTIZATION_METHODS

# GGUF tensor names of the dense linear layers (llama.cpp's names), whose blocks --quantization gguf keeps
GGUF_LINEAR_SUFFIXES = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
                        "ffn_up.weight", "ffn_down.weight")
GGUF_GROUP = 32  # values per Q8_0 / Q4_0 / Q4_1 block (ggml's QK8_0, QK4_0, QK4_1)


@dataclasses.dataclass(frozen=True)
class ResolvedQuantization:
    """What serves a model's linear layers.

    Attributes:
        name: what /get_server_info reports: a --quantization method, or "gguf".
        scheme: the layers' `QuantScheme` (None: not quantized).
        checkpoint: the stored format the loader reads as it is: "fp8" (HF block FP8), "compressed-tensors",
            "gguf", or None (a float checkpoint, quantized at load when `scheme` is set).
        block: HF FP8's weight_block_size (rows, columns) of one ``weight_scale_inv`` value.
    """

    name: Optional[str] = None
    scheme: Optional[QuantScheme] = None
    checkpoint: Optional[str] = None
    block: Optional[Tuple[int, int]] = None


def checkpoint_quantization_config(hf_config) -> Optional[dict]:
    """The checkpoint's ``quantization_config`` as a dict (config.json's, or transformers' config object's), None
    for a checkpoint in a float dtype."""
    qc = getattr(hf_config, "quantization_config", None)
    if not qc:
        return None
    return dict(qc) if isinstance(qc, dict) else qc.to_dict()


def checkpoint_quant_method(hf_config) -> Optional[str]:
    """The ``quant_method`` of the checkpoint's ``quantization_config`` (HF's field: "fp8", "compressed-tensors",
    "gptq", "awq", ...), None for a checkpoint in a float dtype."""
    qc = checkpoint_quantization_config(hf_config)
    if qc is None:
        return None
    method = qc.get("quant_method")
    return str(getattr(method, "value", method) or "unknown")


def resolve_quantization(hf_config, model_path: str, requested: Optional[str],
                         gguf_linear_types: Optional[Set[str]] = None) -> ResolvedQuantization:
    """The quantization a model is served with, from its checkpoint's ``quantization_config`` and ``--quantization``
    (`requested`; SGLang's rule: a pre-quantized checkpoint brings its own method, and a flag naming another one is
    refused). `gguf_linear_types`: for a GGUF model, the tensor types (gguf's names: "Q4_1", "F32", ...) of its dense
    linear layers' weights (the tensors named `GGUF_LINEAR_SUFFIXES`); None for any other model.

    Raises:
        ValueError: a checkpoint quantized in a way sgl-jax cannot serve (naming its quant_method and what is
            unsupported), a --quantization that contradicts the checkpoint's, or --quantization gguf without a
            .gguf model.
    """
    method = checkpoint_quant_method(hf_config)
    if method is None:
        if requested == "gguf":
            return _gguf(gguf_linear_types, model_path)
        return ResolvedQuantization(requested, as_scheme(requested))
    qc = checkpoint_quantization_config(hf_config)
    if method == "fp8":
        resolved = _hf_fp8(qc, model_path)
    elif method == "compressed-tensors":
        resolved = _compressed_tensors(qc, model_path)
    else:
        raise ValueError(f"{model_path}: the checkpoint is quantized (config.json quantization_config.quant_method "
                         f"{method!r}), which sgl-jax cannot load; it serves quant_method 'fp8' (block-wise) and "
                         f"'compressed-tensors' (int8) checkpoints, and float (bfloat16/float32) ones quantized at "
                         f"load with --quantization {{{', '.join(QUANTIZATION_METHODS)}}}")
    if requested not in (None, resolved.name):
        raise ValueError(f"{model_path}: --quantization {requested} contradicts the checkpoint's own quantization "
                         f"({method!r}, served as {resolved.name}); leave --quantization unset")
    return resolved


def _refuse(model_path: str, method: str, why: str):
    raise ValueError(f"{model_path}: the checkpoint is quantized (config.json quantization_config.quant_method "
                     f"{method!r}), which sgl-jax cannot load: {why}")


def _hf_fp8(qc: dict, model_path: str) -> ResolvedQuantization:
    block = qc.get("weight_block_size")
    if not block or len(block) != 2:
        _refuse(model_path, "fp8", f"weight_block_size {block!r}: only block-wise FP8 ([rows, columns]) is served, "
                                   f"not per-tensor scales")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        _refuse(model_path, "fp8", f"fmt {fmt!r}: only e4m3 weights are served")
    bo, bi = int(block[0]), int(block[1])
    return ResolvedQuantization("fp8", QuantScheme("fp8", group_size=bi), "fp8", (bo, bi))


def _compressed_tensors(qc: dict, model_path: str) -> ResolvedQuantization:
    fmt = qc.get("format")
    if fmt != "int-quantized":
        _refuse(model_path, "compressed-tensors", f"format {fmt!r}: only 'int-quantized' (int8) is served")
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        _refuse(model_path, "compressed-tensors", f"{len(groups)} config_groups: one is served")
    weights, acts = groups[0].get("weights") or {}, groups[0].get("input_activations")
    want = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    if any(weights.get(k) != v for k, v in want.items()):
        _refuse(model_path, "compressed-tensors", f"weights {weights!r}: only {want} is served")
    if acts is None:
        return ResolvedQuantization("int8", QuantScheme("int8"), "compressed-tensors")
    want_acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    if any(acts.get(k) != v for k, v in want_acts.items()):
        _refuse(model_path, "compressed-tensors", f"input_activations {acts!r}: only {want_acts} is served")
    return ResolvedQuantization("w8a8_int8", QuantScheme("w8a8_int8"), "compressed-tensors")


def _gguf(linear_types: Optional[Set[str]], model_path: str) -> ResolvedQuantization:
    """--quantization gguf: int8 groups of 32, with mins when any dense linear tensor is Q4_1."""
    if linear_types is None:
        raise ValueError(f"--quantization gguf keeps a GGUF file's blocks quantized; {model_path} is not a .gguf")
    scheme = QuantScheme("int8", group_size=GGUF_GROUP, with_min="Q4_1" in linear_types)
    return ResolvedQuantization("gguf", scheme, "gguf")
