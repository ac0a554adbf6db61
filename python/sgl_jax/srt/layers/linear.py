"""Dense layers with HF-layout weights, in the model dtype or quantized (``--quantization``, quantization/)."""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
import qwix
from flax import nnx

from sgl_jax.srt.layers.lora import lora_delta
from sgl_jax.srt.quantization.methods import QuantMethod, QuantScheme, as_scheme, get_method


def dot_weight_t(x: jax.Array, w: jax.Array, preferred_element_type: Optional[jnp.dtype] = None) -> jax.Array:
    """x @ w.T for an HF-layout weight, with x cast to w's dtype.

    Args:
        x: [..., in_features]; w: [out_features, in_features]; preferred_element_type: the dot's result dtype
            (None: w's).
    Returns:
        [..., out_features].

    On CPU a single row times a bfloat16 weight is padded to two rows: XLA's CPU backend sends a one-row
    bfloat16 dot down a path ten times slower than two rows (30 x [4608, 576]: 120 ms for one row, 11 ms
    padded to two, 12 ms for one float32 row), which made a batch-1 bfloat16 decode step 5x slower than
    float32's."""
    def dot(x):
        return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())),
                                   preferred_element_type=preferred_element_type)

    x = x.astype(w.dtype)
    return dot(x) if w.dtype == jnp.float32 else _two_rows_on_cpu(x, dot)


def _two_rows_on_cpu(x: jax.Array, dot):
    """dot(x) [..., out], with a single row of x padded to two on CPU (and the result cut back): XLA's CPU backend
    runs a one-row dot of bfloat16 or int8 operands ten times slower than a two-row one (30 layers of
    [1536, 576] int8: 64 ms for one row, 4 ms for two)."""
    if jax.default_backend() != "cpu" or math.prod(x.shape[:-1]) != 1:
        return dot(x)
    lead = x.shape[:-1]
    y = dot(jnp.concatenate([x.reshape(1, -1), jnp.zeros((1, x.shape[-1]), x.dtype)]))
    return y[:1].reshape(lead + y.shape[-1:])


def initial_weight(rngs: Optional[nnx.Rngs], shape: Tuple[int, ...], dtype) -> jax.Array:
    """A parameter's initial value [shape] in `dtype`: normal with std 0.02 from ``rngs.params()``; real weights are
    loaded over it. `rngs` None: zeros, for a model built only for its shapes and shardings (the loader's
    ``nnx.eval_shape``): there each draw's stream update made JAX look up the tracer's origin for an error message
    it then dropped (flax's Variable.set_value reads ``.sharding``), ~1 s of a SmolLM2 load on a 2-core CPU."""
    if rngs is None:
        return jnp.zeros(shape, dtype)
    return jax.random.normal(rngs.params(), shape, dtype) * 0.02


class Linear(nnx.Module):
    """y = x @ W.T (+ b), with W stored as [out_features, in_features] like `torch.nn.Linear`.

    Keeping HF's layout makes checkpoint loading a copy (no transposes) and XLA contracts over W's
    second axis without materializing a transpose.

    Args:
        in_features, out_features: sizes in elements.
        use_bias: add a [out_features] bias.
        dtype: parameter and compute dtype (the output's dtype; a quantized layer's bias stays in it).
        rngs: initializer randomness (`initial_weight`; None: zeros).
        quantization: a ``--quantization`` method name or a `QuantScheme` (quantization/methods.py); None: W in
            `dtype`. Quantized, W is int8 or float8_e4m3fn and ``weight_scale`` float32 holds its scales: [out] per
            output channel, or [out, in / group_size] per group of input features (GGUF blocks, HF FP8 blocks),
            with ``weight_min`` [out, in / group_size] where groups carry an offset (GGUF Q4_1). The loader fills
            them from a float checkpoint or a pre-quantized one (model_loader/loader.py).
        lora: (slots n, rank R, backend): LoRA adapter slots ``lora_a`` [n, R, in] and ``lora_b`` [n, R, out] in
            `dtype` (zeros until an adapter is written into a slot; layers/lora.py), used when a call passes
            ``lora_ids``; None: no slots.
    Raises:
        ValueError: an unknown quantization method, or a group size that does not divide `in_features`.
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = False, dtype=jnp.float32,
                 rngs: Optional[nnx.Rngs], quantization: Union[str, QuantScheme, None] = None,
                 lora: Optional[tuple] = None):
        scheme = self.quantization = as_scheme(quantization)
        if scheme is None:
            self.weight = nnx.Param(initial_weight(rngs, (out_features, in_features), dtype))
            self.weight_scale = None
        else:
            method = get_method(scheme.method)
            self.weight = nnx.Param(jnp.zeros((out_features, in_features), method.weight_dtype))
            scale_shape = (out_features,)
            if scheme.group_size is not None:
                if in_features % scheme.group_size:
                    raise ValueError(f"a quantization group of {scheme.group_size} input features does not divide "
                                     f"a layer's {in_features}")
                scale_shape = (out_features, in_features // scheme.group_size)
            self.weight_scale = nnx.Param(jnp.ones(scale_shape, jnp.float32))
        self.weight_min = nnx.Param(jnp.zeros(scale_shape, jnp.float32)) if scheme and scheme.with_min else None
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else None
        self.dtype = jnp.dtype(dtype)
        n, rank, self.lora_backend = lora if lora is not None else (0, 0, None)
        self.lora_a = nnx.Param(jnp.zeros((n, rank, in_features), dtype)) if lora is not None else None
        self.lora_b = nnx.Param(jnp.zeros((n, rank, out_features), dtype)) if lora is not None else None

    def __call__(self, x: jax.Array, lora_ids: Optional[jax.Array] = None) -> jax.Array:
        """x: [..., in_features] -> [..., out_features] in the layer's dtype; `lora_ids` int32[T] (x [T, in]):
        each token's adapter slot (-1: none), adding its LoRA update (`lora_delta`) when the layer has slots.

        On CPU the product accumulates in float32 and is cast back: asked for a bfloat16 result, XLA's CPU
        backend took a path 2x slower than float32 (2048 x 576 x 1536: 19 ms), while a float32 result from
        bfloat16 operands ran 2x faster than float32 (9 ms) on a CPU with AVX512-BF16. TPU/GPU keep the
        parameter dtype's result (their dots accumulate in float32 anyway), so a tensor-parallel row layer's
        partial sums cross devices in bfloat16."""
        scheme = self.quantization
        if scheme is not None and scheme.group_size is not None:
            y = group_quantized_matmul(x.astype(self.dtype), self.weight[...], self.weight_scale[...],
                                       None if self.weight_min is None else self.weight_min[...])
        elif scheme is not None:
            y = quantized_matmul(x.astype(self.dtype), self.weight[...], self.weight_scale[...],
                                 get_method(scheme.method))
        else:
            w = self.weight[...]
            acc = jnp.float32 if jax.default_backend() == "cpu" else None
            y = dot_weight_t(x, w, acc)
        if self.bias is not None:
            y = y + self.bias[...]
        if self.lora_a is not None and lora_ids is not None:
            y = y + lora_delta(x, self.lora_a[...], self.lora_b[...], lora_ids, self.lora_backend)
        return y.astype(self.dtype)


def quantized_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, method: QuantMethod) -> jax.Array:
    """x @ (q * scale[:, None]).T without a dequantized weight: the scales multiply the dot's result.

    Args:
        x: [..., in] activations (float32 or bfloat16).
        q: [out, in] int8 or float8_e4m3fn weight; scale: float32 [out], its per-output-channel scales.
        method: weight-only (``int8``/``fp8``): q enters the dot converted to x's dtype (XLA fuses the convert
            into the dot on TPU/GPU; exact for int8 in bfloat16). W8A8: x is quantized per token (absmax, one
            scale per row) and the dot is int8 x int8 accumulating in int32 (exact), or fp8 x fp8 accumulating
            in float32 (``preferred_element_type``): qwix's ``quantize`` and ``dot_general`` with the weight as a
            ``QArray``. qwix's own weight-only path dequantizes the weight before the dot, hence ours.
    Returns:
        float32 [..., out].
    """
    if not method.activations:
        return dot_weight_t(x, q.astype(x.dtype), jnp.float32) * scale
    w = qwix.QArray(qvalue=q, scale=scale[:, None])

    def dot(x):
        xq = qwix.quantize(x, q.dtype, channelwise_axes=tuple(range(x.ndim - 1)))
        return qwix.dot_general(xq, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    return _two_rows_on_cpu(x, dot)


# the most bytes of float32 partial products [groups, tokens, out] one step of `group_quantized_matmul` may hold
GROUP_PARTIALS_BYTES = 64 << 20


def group_quantized_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, minimum: Optional[jax.Array] = None,
                           partials_bytes: int = GROUP_PARTIALS_BYTES) -> jax.Array:
    """x @ w.T for a weight quantized per group of input features, w[o, k] ~ q[o, k] * scale[o, k // g]
    (+ minimum[o, k // g]), without a dequantized weight: each group's dot runs on q converted to x's dtype
    (exact: int8 and float8_e4m3fn values are bfloat16 values) and its [tokens, out] result is scaled and summed
    over the groups in float32. The minimums add (sum of x over the group) @ minimum.T.

    Args:
        x: [..., in] activations (float32 or bfloat16).
        q: [out, in] int8 or float8_e4m3fn; scale, minimum: float32 [out, in / g] (g = in / scale.shape[1]).
        partials_bytes: the groups are taken a chunk at a time (a loop over chunks) so that the float32 partial
            products [groups, tokens, out] stay under this many bytes (a 2,000-token prefill of a 5120 x 25600
            layer would otherwise hold 40 x 2000 x 25600 floats).
    Returns:
        float32 [..., out].

    The layouts served: GGUF Q8_0 / Q4_0 / Q4_1 blocks of 32 (llama.cpp's ggml-quants), HF FP8 blocks of
    [128, 128] (``weight_scale_inv``, the dense Qwen3-*-FP8 releases).
    """
    out, n_in = q.shape
    n_groups = scale.shape[1]
    g = n_in // n_groups

    def dot(x):
        x3 = x.reshape(-1, n_groups, g)
        tokens = x3.shape[0]
        step = _groups_per_step(n_groups, tokens * out * 4, partials_bytes)

        def partial(xc, qc, sc):  # [T, G, g], [out, G, g], [out, G] -> [T, out]
            p = jax.lax.dot_general(xc, qc.astype(x.dtype), (((2,), (2,)), ((1,), (1,))),
                                    preferred_element_type=jnp.float32)  # [G, T, out]
            return jnp.einsum("gto,og->to", p, sc)

        if step == n_groups:
            y = partial(x3, q.reshape(out, n_groups, g), scale)
        else:
            chunks = n_groups // step
            x4 = x3.reshape(tokens, chunks, step, g)
            q4, s4 = q.reshape(out, chunks, step, g), scale.reshape(out, chunks, step)

            def body(c, acc):
                def take(a):
                    return jax.lax.dynamic_index_in_dim(a, c, 1, keepdims=False)
                return acc + partial(take(x4), take(q4), take(s4))

            y = jax.lax.fori_loop(0, chunks, body, jnp.zeros((tokens, out), jnp.float32))
        if minimum is not None:
            sums = x3.astype(jnp.float32).sum(-1)  # [T, groups]
            y = y + jax.lax.dot_general(sums, minimum, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return y.reshape(x.shape[:-1] + (out,))

    return _two_rows_on_cpu(x, dot)


def _groups_per_step(n_groups: int, bytes_per_group: int, limit: int) -> int:
    """The largest divisor of `n_groups` whose partial products fit `limit` bytes (at least 1)."""
    best = 1
    for d in range(1, n_groups + 1):
        if n_groups % d == 0 and d * bytes_per_group <= limit:
            best = d
    return best
