"""The ``--quantization`` methods (SGLang's names) and their numerics, on host (numpy) or device (jax.numpy).

- ``int8`` / ``fp8``: weight-only. Each linear layer's weight [out, in] is stored as int8 (symmetric, values in
  [-127, 127]) or float8_e4m3fn with one float32 scale per output channel (``weight_scale`` [out]): w ~ q * scale.
  The matmul feeds the int8/fp8 weight to the dot converted to the activation dtype (XLA fuses the convert into
  the dot on TPU/GPU) and multiplies the scales into the [tokens, out] result.
- ``w8a8_int8`` / ``w8a8_fp8``: the same weights, and the activations quantized dynamically per token (one
  float32 scale per row of x, from its max |x|), so the dot itself is int8 x int8 -> int32 or
  fp8 x fp8 -> float32 (``preferred_element_type``); both scales multiply the result.

Symmetric absmax scaling as in LLM.int8() (Dettmers et al. 2022) and SmoothQuant's per-token W8A8 (Xiao et al.
2023) without smoothing; fp8 e4m3 as in "FP8 Formats for Deep Learning" (Micikevicius et al. 2022), max 448.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

import ml_dtypes
import numpy as np

from sgl_jax.srt.server_args import QUANTIZATION_METHODS


@dataclasses.dataclass(frozen=True)
class QuantMethod:
    """One ``--quantization`` method.

    Attributes:
        name: SGLang's name ("int8", "fp8", "w8a8_int8", "w8a8_fp8").
        weight_dtype: numpy dtype of the stored weight (np.int8 or ml_dtypes.float8_e4m3fn).
        activations: True for W8A8 (activations quantized per token, dynamically).
        qmax: the largest magnitude a quantized value takes (127 for int8, 448 for float8_e4m3fn).
    """

    name: str
    weight_dtype: np.dtype
    activations: bool
    qmax: float

    @property
    def is_int(self) -> bool:
        return np.dtype(self.weight_dtype) == np.int8


_INT8 = np.dtype(np.int8)
_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
METHODS: Dict[str, QuantMethod] = {
    "int8": QuantMethod("int8", _INT8, False, 127.0),
    "fp8": QuantMethod("fp8", _FP8, False, 448.0),
    "w8a8_int8": QuantMethod("w8a8_int8", _INT8, True, 127.0),
    "w8a8_fp8": QuantMethod("w8a8_fp8", _FP8, True, 448.0),
}
assert tuple(METHODS) == QUANTIZATION_METHODS


def get_method(name: str) -> QuantMethod:
    """The method called `name`.

    Raises:
        ValueError: an unknown name (the message names --quantization and the methods there are).
    """
    if name not in METHODS:
        raise ValueError(f"--quantization {name!r} is not supported; supported: {list(METHODS)}")
    return METHODS[name]


def absmax_scale(x, axis: int, qmax: float, xp=np):
    """Per-slice symmetric scale max|x| / qmax over `axis` (kept as a size-1 axis), float32; an all-zero slice
    gets scale 1 (its values quantize to 0 either way). `xp`: numpy or jax.numpy."""
    amax = xp.max(xp.abs(x.astype(xp.float32)), axis=axis, keepdims=True)
    return xp.where(amax > 0, amax / qmax, 1.0).astype(xp.float32)


def quantize(x, scale, method: QuantMethod, xp=np):
    """x / scale in the method's storage dtype: rounded to the nearest integer and clipped to [-127, 127] for
    int8, clipped to +-448 and rounded to the nearest float8_e4m3fn for fp8. `scale` broadcasts against x."""
    y = x.astype(xp.float32) / scale
    if method.is_int:
        return xp.clip(xp.round(y), -method.qmax, method.qmax).astype(xp.int8)
    return xp.clip(y, -method.qmax, method.qmax).astype(method.weight_dtype)


def quantize_weight(w, method: QuantMethod, xp=np) -> Tuple[object, object]:
    """A linear layer's weight [out, in] (any float dtype) -> (q [out, in] in ``method.weight_dtype``,
    scale float32 [out]) with w ~ q * scale[:, None] (per output channel).

    `xp`: numpy (the loader, on host) or jax.numpy (dummy weights, made on the devices)."""
    scale = absmax_scale(w, 1, method.qmax, xp)
    return quantize(w, scale, method, xp), scale[:, 0]
