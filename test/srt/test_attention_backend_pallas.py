"""`--attention-backend pallas` end to end on CPU: the server runs the Pallas TPU kernel in Pallas' interpreter
for every layer, and gives the native (pure-JAX) path's greedy tokens and, within LOGPROB_ATOL, its
log-probabilities of every prompt position and every generated token.

The kernel does not depend on the model: both servers serve the tiny random Llama (srt_helpers.save_tiny_llama,
2 layers: the interpreted kernel costs a fraction of SmolLM2's 30 layers), its query and key projections scaled
by QK_SCALE. As initialized, its attention scores are ~0.03 and every softmax is nearly uniform (a row's largest
weight 0.015 over ~75 keys), so a kernel whose scores were 0.1% off (a planted fault) moved no log-probability
by 1e-5; scaled, a row's largest weight is ~0.2 and that fault moves them by 1.7e-4 (Pallas vs native without a
fault: 9.5e-7); SmolLM2's greedy tokens, this test's check before, did not catch it either. The tiny model's
logits are nearly flat (std ~0.16), so greedy tokens alone prove little: the log-probabilities carry the check,
and the greedy tokens count only where the native side's top two are MIN_GREEDY_GAP apart (asserted: no
near-tie on the prompts' greedy paths; a gap's error is at most 2 x LOGPROB_ATOL).
"""

from __future__ import annotations


import httpx
import numpy as np
import pytest

from srt_helpers import SMALL_ENGINE_ARGS, edit_checkpoint, module_server, save_tiny_llama

# Few shapes: every layer of every compiled shape holds an interpreted kernel.
ARGS = dict(SMALL_ENGINE_ARGS, precompile_token_paddings=[64], precompile_bs_paddings=[1, 4],
            max_running_requests=4, max_total_tokens=4096, chunked_prefill_size=64)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    # longer than one 64-token extend step: chunked prefill, then decode over a 100+ token context
    "Here is a list of fruits, one per line, with their colours: " + ", ".join(["apple red", "banana yellow",
                                                                                  "grape purple"] * 8),
]
GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
LOGPROBS = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
LOGPROB_ATOL = 1e-5
MIN_GREEDY_GAP = 1e-4
QK_SCALE = 8.0


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """save_tiny_llama's model with its query and key projections multiplied by QK_SCALE (sharp attention)."""
    model_dir, tokenizer = save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_pallas"))

    def scale_qk(tensors):
        scaled = [k for k in tensors if k.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight"))]
        assert len(scaled) == 4  # 2 layers
        return {k: v * QK_SCALE if k in scaled else v for k, v in tensors.items()}

    edit_checkpoint(model_dir, scale_qk)
    return model_dir, tokenizer


def _serve(model, backend: str):
    model_dir, tokenizer = model
    return module_server(["--model-path", model_dir, "--tokenizer-path", tokenizer],
                         engine_args=dict(ARGS, attention_backend=backend))


def _generate(url, text) -> list:
    """Greedy /generate of `text` (a prompt or a list) with every log-probability; a list of results."""
    r = httpx.post(url + "/generate", json={"text": text, "sampling_params": GREEDY, **LOGPROBS}, timeout=600)
    assert r.status_code == 200, r.text
    out = r.json()
    return out if isinstance(out, list) else [out]


def _logprobs(result) -> np.ndarray:
    """Log-probabilities of every prompt position (the first has none) and every generated token."""
    meta = result["meta_info"]
    return np.array([e[0] for e in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]])


def _min_gap(result) -> float:
    """The smallest gap between the top two log-probabilities where `result` chose a token."""
    return min(top[0][0] - top[1][0] for top in result["meta_info"]["output_top_logprobs"])


def _compare(got, want) -> float:
    """`got` (Pallas) has `want`'s (native) greedy tokens and log-probabilities within LOGPROB_ATOL; returns
    the max |difference|."""
    assert got["output_ids"] == want["output_ids"]
    a, b = _logprobs(got), _logprobs(want)
    assert a.shape == b.shape and len(a) > len(want["output_ids"])
    diff = float(np.abs(a - b).max())
    assert diff < LOGPROB_ATOL, f"max |logprob difference| {diff:.2e} >= {LOGPROB_ATOL}"
    return diff


@pytest.fixture(scope="module")
def native(tiny_llama):
    """The native backend's results on PROMPTS (its server is stopped, checked clean, before Pallas' starts)."""
    gen = _serve(tiny_llama, "native")
    server = next(gen)
    try:
        out = _generate(server.url, PROMPTS)
    finally:
        next(gen, None)
    for i, o in enumerate(out):
        assert len(o["output_ids"]) == GREEDY["max_new_tokens"]
        assert _min_gap(o) > MIN_GREEDY_GAP, f"prompt {i}: a near-tie on the greedy path ({_min_gap(o):.1e})"
    return out


@pytest.fixture(scope="module")
def pallas_server(tiny_llama):
    yield from _serve(tiny_llama, "pallas")


def test_pallas_interpret_tokens_equal_and_logprobs_within_1e_5_of_native(pallas_server, native):
    assert "Attention backend: pallas (--attention-backend pallas on cpu)" in pallas_server.log_text()
    batch = _generate(pallas_server.url, PROMPTS)
    diffs = [_compare(got, want) for got, want in zip(batch, native)]
    # one at a time too (decode batches of 1 instead of 4)
    diffs.append(_compare(_generate(pallas_server.url, PROMPTS[3])[0], native[3]))
    print(f"max |logprob difference| per prompt, Pallas vs native: {['%.1e' % d for d in diffs]}; native's "
          f"smallest top-2 gap per prompt: {['%.1e' % _min_gap(o) for o in native]}")
