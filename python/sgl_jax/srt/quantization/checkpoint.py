"""Quantized checkpoints: what a model's config.json says about its own quantization (``quantization_config``)."""

from __future__ import annotations

from typing import Optional

from sgl_jax.srt.server_args import QUANTIZATION_METHODS


def checkpoint_quant_method(hf_config) -> Optional[str]:
    """The ``quant_method`` of the checkpoint's ``quantization_config`` (HF's field: "fp8", "compressed-tensors",
    "gptq", "awq", ...; a dict or transformers' config object), None for a checkpoint in a float dtype."""
    qc = getattr(hf_config, "quantization_config", None)
    if not qc:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return str(getattr(method, "value", method) or "unknown")


def check_checkpoint_quantization(hf_config, model_path: str) -> None:
    """Refuse, at start-up, a checkpoint whose weights are stored quantized: sgl-jax loads float checkpoints only
    (and quantizes them itself with --quantization), so reading int8 / fp8 tensors without their scales would
    serve a broken model.

    Raises:
        ValueError: naming the checkpoint's quant_method and what can be served instead.
    """
    method = checkpoint_quant_method(hf_config)
    if method is not None:
        raise ValueError(f"{model_path}: the checkpoint is quantized (config.json quantization_config.quant_method "
                         f"{method!r}), which sgl-jax cannot load yet; serve its float (bfloat16/float32) release, "
                         f"quantized at load with --quantization {{{', '.join(QUANTIZATION_METHODS)}}}")
