"""typical_p (locally typical sampling, Meister et al. 2022) against transformers' TypicalLogitsWarper: the
tokens the compiled sampler can draw are exactly the set transformers keeps (512 rows of the same logits, one
seed each; ties at the boundary included), alone and combined with top-k; and the request field reaches it from
both protocols."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TypicalLogitsWarper

from sgl_jax.srt.layers.sampler import new_penalty_state, sample
from sgl_jax.srt.sampling.sampling_batch import SamplingBatch
from sgl_jax.srt.sampling.sampling_params import SamplingParams

V, ROWS, TEMPERATURE = 32, 512, 0.8


def drawn(logits: np.ndarray, **params) -> set:
    """The set of tokens the sampler draws for `logits` over ROWS seeds."""
    sp = [SamplingParams(temperature=TEMPERATURE, **params)] * ROWS
    all_allowed = np.full((ROWS, -(-V // 32)), -1, np.int32)  # (what the model runner passes without grammars)
    batch = SamplingBatch.build(sp, {"seeds": list(range(ROWS))}, ROWS, all_allowed)
    batch = jax.tree.map(jnp.asarray, batch)
    ids, _, _ = sample(jnp.asarray(np.tile(logits, (ROWS, 1))), batch, jnp.asarray([V], jnp.int32),
                       new_penalty_state(ROWS, V))
    return set(np.asarray(ids).tolist())


def kept(warper, logits: np.ndarray) -> set:
    """The tokens a transformers logits warper keeps of the temperature-scaled distribution."""
    torch.set_num_threads(1)
    scores = warper(None, torch.tensor(logits[None, :] / TEMPERATURE, dtype=torch.float32))
    return set(np.nonzero(np.isfinite(scores.numpy()[0]))[0].tolist())


def kept_by_transformers(logits: np.ndarray, mass: float) -> set:
    return kept(TypicalLogitsWarper(mass=mass), logits)


@pytest.mark.parametrize("mass", [0.3, 0.6, 0.9])
def test_drawn_tokens_are_transformers_typical_set(mass):
    logits = np.random.default_rng(7).normal(0.0, 1.0, V).astype(np.float32)
    expected = kept_by_transformers(logits, mass)
    assert 1 < len(expected) < V
    assert drawn(logits, typical_p=mass) == expected


def test_ties_at_the_boundary_all_stay():
    """Equal shifts at the boundary (here uniform logits: every token equally typical) stay together, as in
    transformers: all 32 tokens, not the first half of them."""
    logits = np.zeros(V, np.float32)
    assert kept_by_transformers(logits, 0.5) == set(range(V)) == drawn(logits, typical_p=0.5)


def test_typical_p_combines_with_top_k_and_one_is_off():
    logits = np.random.default_rng(11).normal(0.0, 1.0, V).astype(np.float32)
    assert drawn(logits, typical_p=1.0) == drawn(logits)  # 1: off (the same tokens for the same seeds)
    # the engine's filters each see the whole distribution and their kept sets are intersected (as top-k, top-p and
    # min-p already combine; transformers would apply them one after the other, renormalizing in between)
    both = kept(TypicalLogitsWarper(mass=0.5), logits) & kept(TopKLogitsWarper(12), logits)
    assert len(both) > 1 and drawn(logits, typical_p=0.5, top_k=12) == both


def test_the_field_is_validated_and_reaches_sampling_params():
    from pydantic import ValidationError

    from sgl_jax.srt.entrypoints.native_protocol import SamplingParamsRequest
    from sgl_jax.srt.entrypoints.openai.protocol import ChatCompletionRequest
    from sgl_jax.srt.entrypoints.openai.utils import sampling_params_from

    assert SamplingParams.from_dict(SamplingParamsRequest(typical_p=0.4).to_engine_dict()).typical_p == 0.4
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], typical_p=0.4)
    assert sampling_params_from(chat, 8)["typical_p"] == 0.4
    for bad in (0.0, 1.5):
        with pytest.raises(ValidationError, match="typical_p"):
            SamplingParamsRequest(typical_p=bad)
