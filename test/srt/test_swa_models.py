"""Sliding-window models against transformers (float32): tiny random Gemma 3 and Qwen3-with-SWA configs.

Prompts of W-1, W, W+1 and 3W+5 tokens (W, the window, in {8, 16}) at page sizes 1 and 4 go through the real
runner (ReqToTokenPool, the paged allocator, ScheduleBatch, ModelRunner); prefill logprobs of every position
and four decode steps must be within 1e-3 of transformers' and every greedy token identical.
"""

from __future__ import annotations

import pytest
from test_model_parity import RunnerHarness, _random_prompts, _save_tiny, check_parity

VOCAB = 512


def _prompt_lengths(window: int):
    return [window - 1, window, window + 1, 3 * window + 5]


def gemma3_config(window: int, **overrides):
    from transformers import Gemma3TextConfig

    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                  sliding_window=window, query_pre_attn_scalar=24, rms_norm_eps=1e-6,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                  rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
                  architectures=["Gemma3ForCausalLM"])
    kwargs.update(overrides)
    return Gemma3TextConfig(**kwargs)


def qwen3_swa_config(window: int):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                       use_sliding_window=True, sliding_window=window, max_window_layers=1,
                       tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"])


@pytest.mark.parametrize("window,page_size", [(8, 1), (8, 4), (16, 1), (16, 4)])
def test_tiny_gemma3_parity(tmp_path, window, page_size):
    model = _save_tiny(tmp_path, gemma3_config(window), seed=window + page_size)
    harness = RunnerHarness(str(tmp_path), page_size=page_size)
    assert harness.mc.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert [harness.mc.layer_window(i) for i in range(3)] == [window, None, window]
    check_parity(harness, model, _random_prompts(window, VOCAB, _prompt_lengths(window)))


def test_tiny_gemma3_final_logit_soft_cap_parity(tmp_path):
    """The final logit soft-cap (off in the released Gemma 3 configs). attn_logit_softcapping is set too and,
    as in transformers' Gemma 3, has no effect."""
    config = gemma3_config(8, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    model = _save_tiny(tmp_path, config, seed=3)
    check_parity(RunnerHarness(str(tmp_path), page_size=4), model, _random_prompts(3, VOCAB, _prompt_lengths(8)))


@pytest.mark.parametrize("window,page_size", [(8, 1), (8, 4), (16, 1), (16, 4)])
def test_tiny_qwen3_sliding_window_parity(tmp_path, window, page_size):
    config = qwen3_swa_config(window)
    assert config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    model = _save_tiny(tmp_path, config, seed=window * page_size)
    harness = RunnerHarness(str(tmp_path), page_size=page_size)
    assert harness.mc.swa_layer_ids == [1, 2]
    check_parity(harness, model, _random_prompts(window + 1, VOCAB, _prompt_lengths(window)))


def test_layer_types_are_validated():
    from types import SimpleNamespace

    from sgl_jax.srt.configs.model_config import _layer_types

    assert _layer_types(SimpleNamespace(sliding_window=None), 2) == ["full_attention"] * 2
    assert _layer_types(SimpleNamespace(sliding_window=64), 2) == ["sliding_attention"] * 2  # Mistral-style
    with pytest.raises(ValueError, match="must list 3"):
        _layer_types(SimpleNamespace(sliding_window=8, layer_types=["full_attention"]), 3)
    with pytest.raises(ValueError, match="unknown"):
        _layer_types(SimpleNamespace(sliding_window=8, layer_types=["chunked_attention"]), 1)
    with pytest.raises(ValueError, match="no sliding_window"):
        _layer_types(SimpleNamespace(sliding_window=None, layer_types=["sliding_attention"]), 1)
