"""Token embedding (its table doubles as the LM head when embeddings are tied), in the model dtype or quantized."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
from flax import nnx

from sgl_jax.srt.layers.linear import initial_weight
from sgl_jax.srt.quantization.methods import QuantScheme, dequantize_rows, get_method

# a token table: its weight [vocab_size, hidden_size] in the model dtype, or (int8 / fp8 weight, float32 scales)
Table = Union[jax.Array, Tuple[jax.Array, jax.Array]]


class Embedding(nnx.Module):
    """Lookup table ``weight`` [vocab_size, hidden_size] (HF layout and name).

    Args:
        vocab_size, hidden_size: the table's shape (tokens, features).
        dtype: the parameter dtype, and the dtype of the rows looked up.
        rngs: initializer randomness (layers/linear.initial_weight; None: zeros).
        quantization: None, or a `QuantScheme` (quantization/methods.table_scheme: int8 in groups of g
            features): ``weight`` int8 [vocab_size, hidden_size] and ``weight_scale`` float32
            [vocab_size, hidden_size / g], filled by the loader (model_loader/loader.py) from the float table.
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype=jnp.float32, rngs: Optional[nnx.Rngs],
                 quantization: Optional[QuantScheme] = None):
        self.dtype = jnp.dtype(dtype)
        self.quantization = quantization
        if quantization is None:
            self.weight = nnx.Param(initial_weight(rngs, (vocab_size, hidden_size), dtype))
            self.weight_scale = None
        else:
            g = quantization.group_size or hidden_size
            self.weight = nnx.Param(jnp.zeros((vocab_size, hidden_size), get_method(quantization.method).weight_dtype))
            self.weight_scale = nnx.Param(jnp.ones((vocab_size, hidden_size // g), jnp.float32))

    def table(self) -> Table:
        """The table as `lookup` and `logits_processor.compute_logits` take it."""
        return table_of(self)

    def __call__(self, ids: jax.Array) -> jax.Array:
        """ids: int32[T] -> [T, hidden_size] in the layer's dtype."""
        return lookup(self.table(), ids, self.dtype)


def table_of(layer) -> Table:
    """A layer's [rows, features] weight as a `Table`: ``weight`` alone, or (``weight``, ``weight_scale``) when
    the layer is quantized (an `Embedding`, or a `layers.linear.Linear` serving as the LM head)."""
    if getattr(layer, "weight_scale", None) is None:
        return layer.weight[...]
    return layer.weight[...], layer.weight_scale[...]


def lookup(table: Table, ids: jax.Array, dtype) -> jax.Array:
    """Rows `ids` (int32[T]) of `table` -> [T, hidden_size] in `dtype`; a quantized table's rows are scaled back
    (only the T rows looked up are dequantized)."""
    if isinstance(table, tuple):
        q, scale = table
        return dequantize_rows(jnp.take(q, ids, axis=0), jnp.take(scale, ids, axis=0), dtype, jnp)
    return jnp.take(table, ids, axis=0).astype(dtype)
