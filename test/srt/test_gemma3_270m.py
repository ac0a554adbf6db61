"""Gemma-3-270M (the packaged Q4_K_M GGUF, dequantized, float32) against transformers float32 through the real
runner, with prompts longer than its 512-token sliding window.

Two prompts of natural English text (Python's reference manual as shipped in ``pydoc_data``), 600 and 1,100
tokens, are prefilled in one batch and decoded for four steps through ReqToTokenPool, the paged allocator,
ScheduleBatch and ModelRunner (`RunnerHarness`). The reference is transformers' Gemma3ForCausalLM on the GGUF's
dequantized tensors (equal to transformers' own GGUF loader's: test_gguf_gemma3.py), computed once. Every
prefill position's logprobs and every decode step's are within 1e-3 (TOL) and the greedy tokens identical (but
for a near-tie under GREEDY_TIE, 1e-3):
- page size 1, one KV pool (windows masked);
- page size 4, hybrid SWA memory: the 15 sliding-window layers in a separate, smaller SWA pool whose pages are
  released as they leave the window (as the scheduler does after each step), so decoding reads SWA KV through
  the full-to-SWA page mapping with the prompts' early pages gone.
Then, free-running on the hybrid SWA configuration: our runner generates FREE_RUN_TOKENS (40) greedy tokens
from its own output, which must be transformers' greedy tokens (transformers decoding with its own KV cache).
"""

from __future__ import annotations

import pytest
from test_model_parity import RunnerHarness, check_against_reference, check_free_running, hf_reference

from sgl_jax.srt.model_loader.default_model import GEMMA3_270M_PACKAGE, find_packaged_gguf
from sgl_jax.srt.model_loader.gguf_file import iterate_gguf_tensors, prepare_gguf_hf_dir

WINDOW = 512
# (pydoc_data topic, prompt length in tokens): both longer than the window, the second more than twice
PROMPTS = [("import", 600), ("execmodel", 1100)]
CONTEXT = 2048
TOKEN_PADDINGS = (2048,)  # one extend bucket holds both prompts (1,700 tokens)
FREE_RUN_TOKENS = 40


@pytest.fixture(scope="module")
def gguf_path():
    return find_packaged_gguf(GEMMA3_270M_PACKAGE)


@pytest.fixture(scope="module")
def prompts(gguf_path):
    from pydoc_data.topics import topics
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prepare_gguf_hf_dir(gguf_path))
    out = []
    for topic, n in PROMPTS:
        ids = tokenizer.encode(topics[topic])
        assert len(ids) >= n, f"pydoc topic {topic!r} has only {len(ids)} tokens"
        out.append(ids[:n])
    return out


@pytest.fixture(scope="module")
def reference(gguf_path, prompts):
    """transformers' logprobs (float32) of the prefill and 4 decode steps, and its greedy tokens for
    FREE_RUN_TOKENS steps, computed once for every runner configuration. The model is built from the GGUF's
    dequantized tensors, which equal transformers' own GGUF loader's (test_gguf_gemma3.py)."""
    from test_gguf_gemma3 import hf_gemma3

    model = hf_gemma3(prepare_gguf_hf_dir(gguf_path), dict(iterate_gguf_tensors(gguf_path)))
    assert model.config.sliding_window == WINDOW
    return hf_reference(model, prompts, greedy_steps=FREE_RUN_TOKENS)


def _harness(gguf_path, page_size, swa_full_tokens_ratio=None):
    return RunnerHarness(gguf_path, page_size=page_size, max_total_tokens=4096, context_length=CONTEXT,
                         token_paddings=TOKEN_PADDINGS, swa_full_tokens_ratio=swa_full_tokens_ratio)


def test_one_pool_page_size_1_parity(gguf_path, reference):
    harness = _harness(gguf_path, 1)
    assert harness.runner.kv_spec.num_pools == 1
    assert [harness.mc.layer_window(i) for i in (0, 5, 6, 17)] == [WINDOW, None, WINDOW, None]
    check_against_reference(harness, reference)


@pytest.fixture(scope="module")
def hybrid_harness(gguf_path):
    """Page size 4, hybrid SWA memory at ratio 0.5 (shared: each test releases its requests)."""
    return _harness(gguf_path, 4, swa_full_tokens_ratio=0.5)


def test_hybrid_swa_memory_page_size_4_parity(hybrid_harness, reference):
    """Ratio 0.5: 4,096 tokens of one-pool memory become a full pool of 7,020 tokens (3 layers) and an SWA pool
    of 3,508 (15 layers); after the prefill each prompt keeps only about a window of SWA KV."""
    harness = hybrid_harness
    runner = harness.runner
    assert runner.kv_spec.pool_tokens == (7020, 3508)
    assert runner.kv_caches[0][0].shape[0] == 3508 // 4 + 1 and runner.kv_caches[5][0].shape[0] == 7020 // 4 + 1
    released = harness.swa_tokens_released
    check_against_reference(harness, reference)
    # the 1,100-token prompt's first 584 positions (whole pages before 1,100 - 512 + 1, less one page of slack)
    # and the 600-token prompt's first 84 lost their SWA KV while both were still decoding
    assert harness.swa_tokens_released - released >= 584 + 84


def test_hybrid_swa_memory_free_running_greedy_40_tokens(hybrid_harness, reference):
    """Free-running greedy decoding of both prompts (600 and 1,100 tokens, past the 512-token window) for 40
    tokens: each step feeds back our own argmax; all 40 tokens of each prompt must equal transformers' greedy
    tokens. The reference's top-2 logprob gap along both paths is at least 2.3e-2 (measured), far above
    GREEDY_TIE (1e-3), so no near-tie excuses a difference."""
    compared = check_free_running(hybrid_harness, reference, FREE_RUN_TOKENS)
    assert compared == [FREE_RUN_TOKENS] * len(reference.prompts)
