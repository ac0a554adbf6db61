"""Next-token sampling on device: greedy, temperature, top-k, top-p (nucleus), min-p, per-request seeds.

Semantics follow SGLang's sampler: temperature 0 (or top_k 1) is greedy argmax; otherwise logits are
divided by the temperature and filtered by top-k, top-p (keep the smallest prefix of tokens, by
probability, whose mass reaches top_p; Holtzman et al. 2019) and min-p (keep tokens with probability
>= min_p * max probability). Each request draws from its own stream, fold_in(key(seed), step), so a
seeded request samples the same tokens alone or inside any batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sgl_jax.srt.model_executor.forward_batch_info import SamplingMetadata

NEG_INF = -jnp.inf


def _row_gumbel(seed: jax.Array, step: jax.Array, vocab: int) -> jax.Array:
    key = jax.random.fold_in(jax.random.key(seed.astype(jnp.uint32)), step)
    return jax.random.gumbel(key, (vocab,), jnp.float32)


def _gumbel(meta: SamplingMetadata, vocab: int) -> jax.Array:
    return jax.vmap(_row_gumbel, in_axes=(0, 0, None))(meta.seeds, meta.steps, vocab)


def _sample_filtered(scaled: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """Sample after top-k / top-p / min-p filtering (sorts each row once)."""
    S, V = scaled.shape
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    rank = jnp.arange(V)[None, :]
    top_k = jnp.where(meta.top_ks > 0, meta.top_ks, V)[:, None]
    keep = rank < top_k
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= mass_before < meta.top_ps[:, None]
    keep &= probs >= meta.min_ps[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)
    filtered = jnp.where(keep, sorted_logits, NEG_INF)
    choice = jnp.argmax(filtered + _gumbel(meta, V), axis=-1)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]


def sample(logits: jax.Array, meta: SamplingMetadata, eos_token_ids: jax.Array):
    """Pick the next token of every row.

    Args:
        logits: float32[S, V] next-token logits.
        meta: per-row parameters (see SamplingMetadata).
        eos_token_ids: int32[E] ids masked for rows with ``suppress_eos``.
    Returns:
        (next_token_ids int32[S], logprobs float32[S, V]) where logprobs is the log-softmax of the raw
        logits (before temperature and filtering), the distribution `return_logprob` reports.
    """
    S, V = logits.shape
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    is_eos = jnp.zeros((V,), bool).at[eos_token_ids].set(True)
    logits = jnp.where(meta.suppress_eos[:, None] & is_eos[None, :], NEG_INF, logits)
    greedy_rows = (meta.temperatures <= 0.0) | (meta.top_ks == 1)
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.where(greedy_rows, 1.0, meta.temperatures)[:, None]
    needs_filter = (meta.top_ps < 1.0) | ((meta.top_ks > 0) & (meta.top_ks < V)) | (meta.min_ps > 0.0)
    branch = jnp.where(jnp.all(greedy_rows), 0, jnp.where(jnp.any(needs_filter & ~greedy_rows), 2, 1))
    sampled = jax.lax.switch(
        branch,
        [
            lambda: greedy,
            lambda: jnp.argmax(scaled + _gumbel(meta, V), axis=-1),
            lambda: _sample_filtered(scaled, meta),
        ],
    )
    next_ids = jnp.where(greedy_rows, greedy, sampled).astype(jnp.int32)
    return next_ids, logprobs
