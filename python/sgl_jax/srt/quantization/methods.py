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
from typing import Dict, Optional, Tuple

import numpy as np

from sgl_jax.srt.server_args import QUANTIZATION_METHODS


@dataclasses.dataclass(frozen=True)
class QuantMethod:
    """One ``--quantization`` method.

    Attributes:
        name: SGLang's name ("int8", "fp8", "w8a8_int8", "w8a8_fp8").
        weight_dtype_name: the stored weight's dtype, "int8" or "float8_e4m3fn" (`weight_dtype`: as a numpy dtype,
            ml_dtypes' for float8; ml_dtypes is imported only then: its import takes ~0.75 s on a 2-core CPU, and
            the HTTP and detokenizer processes read these methods without ever needing a float8 type).
        activations: True for W8A8 (activations quantized per token, dynamically).
        qmax: the largest magnitude a quantized value takes (127 for int8, 448 for float8_e4m3fn).
    """

    name: str
    weight_dtype_name: str
    activations: bool
    qmax: float

    @property
    def weight_dtype(self) -> np.dtype:
        if self.weight_dtype_name == "int8":
            return np.dtype(np.int8)
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, self.weight_dtype_name))

    @property
    def is_int(self) -> bool:
        return self.weight_dtype_name == "int8"


METHODS: Dict[str, QuantMethod] = {
    "int8": QuantMethod("int8", "int8", False, 127.0),
    "fp8": QuantMethod("fp8", "float8_e4m3fn", False, 448.0),
    "w8a8_int8": QuantMethod("w8a8_int8", "int8", True, 127.0),
    "w8a8_fp8": QuantMethod("w8a8_fp8", "float8_e4m3fn", True, 448.0),
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


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """How a model's quantized linear layers store their weights.

    Attributes:
        method: the ``--quantization`` method name (METHODS): the weight dtype and whether activations are
            quantized.
        group_size: None: one scale per output channel (``weight_scale`` float32 [out]); an int g: one scale per
            output channel and group of g input features (``weight_scale`` float32 [out, in / g]), as GGUF's
            32-value blocks and HF FP8's [128, 128] blocks (whose one scale per 128 rows is repeated per row at
            load: 4 bytes per 128 weights more, so that k/v head replication and a column-parallel split act on
            rows alone; a row-parallel split divides the groups: distributed/sharding.py).
        with_min: the groups also carry an offset, w ~ q * scale + min (``weight_min`` float32 [out, in / g]):
            GGUF Q4_1.
    """

    method: str
    group_size: Optional[int] = None
    with_min: bool = False

    def __post_init__(self):
        if get_method(self.method).activations and self.group_size is not None:
            raise ValueError(f"{self.method} quantizes activations per token; per-group weight scales are served "
                             f"weight-only (int8 / fp8)")
        if self.with_min and self.group_size is None:
            raise ValueError("a quantization scheme with per-group mins needs a group_size")


def as_scheme(quantization) -> Optional[QuantScheme]:
    """A ``--quantization`` method name, a `QuantScheme` or None, as a `QuantScheme` (or None)."""
    if quantization is None or isinstance(quantization, QuantScheme):
        return quantization
    return QuantScheme(str(quantization))


def quantize_weight_groups(w, method: QuantMethod, group_size: int, xp=np) -> Tuple[object, object]:
    """A weight [out, in] (in divisible by `group_size`) -> (q [out, in] in ``method.weight_dtype``, scale float32
    [out, in / group_size]), symmetric absmax per group of `group_size` input features: w ~ q * scale repeated
    along the input axis. `xp`: numpy or jax.numpy."""
    out, n_in = w.shape
    g = w.reshape(out, n_in // group_size, group_size)
    scale = absmax_scale(g, 2, method.qmax, xp)
    return quantize(g, scale, method, xp).reshape(out, n_in), scale[..., 0]


def quantize_experts(w, method: QuantMethod, xp=np) -> Tuple[object, object]:
    """A mixture-of-experts layer's stacked expert weights [E, in, out] -> (q [E, in, out] in
    ``method.weight_dtype``, scale float32 [E, out]): one symmetric absmax scale per expert and output channel
    (the reduction axis is `in`, as a linear layer's per-output-channel scale). `xp`: numpy or jax.numpy."""
    scale = absmax_scale(w, 1, method.qmax, xp)
    return quantize(w, scale, method, xp), scale[:, 0, :]


# group sizes for the token embedding table and the LM head, largest first: the first that divides the hidden size
TABLE_GROUP_SIZES = (128, 64, 32)


def table_scheme(hidden_size: int) -> Optional[QuantScheme]:
    """How ``--quantization`` stores the token embedding table and the LM head [vocab_size, hidden_size], whatever
    the method: int8, weight-only, one scale per row (token) and group of the largest of `TABLE_GROUP_SIZES`
    features dividing `hidden_size` (llama.cpp's Q8_0 keeps its token embeddings the same way, in groups of 32);
    None (the tables stay in the model dtype) when none divides it.

    Why int8 groups for every method: the tables are 21% (SmolLM2) to 63% (Gemma-3-270M) of a small model's
    weights (13% of Llama-3-8B's), so left in bfloat16 they keep the model far above half of its bfloat16 bytes;
    and measured on SmolLM2-135M (reports/quantization-smollm2-cpu-2026-11-28.notes.md), one scale per row cost
    up to +1.9 points of perplexity (fp8 e4m3 rows) where int8 groups of 64 cost none measurable."""
    for g in TABLE_GROUP_SIZES:
        if hidden_size % g == 0:
            return QuantScheme("int8", group_size=g)
    return None


def dequantize_rows(q, scale, dtype, xp=np):
    """Rows of a quantized table, in `dtype`: q [..., H] (int8 / fp8) times `scale` float32 [..., H / g] repeated
    over each group of g features, or [...] (one scale per row). `xp`: numpy or jax.numpy."""
    x = q.astype(xp.float32)
    if scale.ndim == q.ndim - 1:
        return (x * scale[..., None]).astype(dtype)
    groups = scale.shape[-1]
    x = x.reshape(q.shape[:-1] + (groups, q.shape[-1] // groups)) * scale[..., None]
    return x.reshape(q.shape).astype(dtype)


def quantize_for(w, scheme: QuantScheme, xp=np) -> Tuple[object, ...]:
    """`w` quantized as a layer of `scheme` stores it: (q, scale) for a linear weight [out, in] (per output
    channel, or per group of ``scheme.group_size`` input features, with zero mins appended for ``with_min``) or
    for stacked experts [E, in, out] (per expert and output channel, whatever the group size)."""
    method = get_method(scheme.method)
    if w.ndim == 3:
        return quantize_experts(w, method, xp)
    if scheme.group_size is None:
        return quantize_weight(w, method, xp)
    q, scale = quantize_weight_groups(w, method, scheme.group_size, xp)
    return (q, scale, xp.zeros_like(scale)) if scheme.with_min else (q, scale)
