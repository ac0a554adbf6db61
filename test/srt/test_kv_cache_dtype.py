"""--kv-cache-dtype bfloat16 on the real SmolLM2 (float32 weights): the KV cache is stored in half the bytes,
attention still computes in float32, and logprobs stay close to the transformers float32 reference (the exact
difference is printed: 2.1e-2 worst, 4.2e-3 mean on this prompt)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from sgl_jax.srt.model_executor.model_runner import kv_bytes_per_token, kv_cache_dtype
from sgl_jax.srt.server_args import ServerArgs
from srt_helpers import SMALL_ENGINE_ARGS, checked_engine

PROMPT = ("<|im_start|>user\nWrite a short story about a lighthouse keeper who finds a message in a bottle. "
          "Describe the weather, the sea, the bottle and the message itself.<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def engine():
    with checked_engine(**dict(SMALL_ENGINE_ARGS, kv_cache_dtype="bfloat16", log_level="warning")) as e:
        yield e


def test_logprobs_mean_within_1e_2_max_within_5e_2_of_float32_reference(engine, hf_smollm2, smollm2_tokenizer):
    torch.set_num_threads(1)
    state = engine.get_server_info()["internal_states"][0]
    assert state["kv_cache_dtype"] == "bfloat16"
    ids = smollm2_tokenizer.encode(PROMPT)
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 24, "temperature": 0},
                          return_logprob=True, logprob_start_len=0)
    meta = out["meta_info"]
    full = ids + out["output_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf_smollm2(torch.tensor([full])).logits[0], -1).numpy()
    inp = [lp for lp, _, _ in meta["input_token_logprobs"][1:]]
    outp = [lp for lp, _, _ in meta["output_token_logprobs"]]
    ours = np.array(inp + outp)
    theirs = np.array([ref[p - 1, full[p]] for p in range(1, len(full))])
    diff = np.abs(ours - theirs)
    n_in = len(inp)
    print(f"bfloat16 KV vs float32 reference: max |logprob diff| {diff.max():.2e} (prompt tokens "
          f"{diff[:n_in].max():.2e}, generated {diff[n_in:].max():.2e}), mean {diff.mean():.2e} over {len(diff)} "
          f"tokens; worst at logprob {theirs[diff.argmax()]:.2f}")
    # bfloat16 keeps 8 bits of mantissa: measured 2.1e-2 worst (a prompt token at logprob -6.2), 1.3e-2 worst
    # on generated tokens, 4.2e-3 mean -- above issue #17's 1e-2 goal, so float32 stays the default
    assert diff.max() < 5e-2 and diff.mean() < 1e-2
    assert diff.max() > 1e-4  # the cache really is bfloat16 (a float32 cache matches to ~1e-5)
    # greedy decoding with the bfloat16 cache still follows the reference's argmax at every step
    assert all(int(np.argmax(ref[len(ids) - 1 + j])) == t for j, t in enumerate(out["output_ids"]))
    assert state["memory_errors"] == 0


def test_kv_bytes_and_flag():
    mc = types.SimpleNamespace(dtype="float32", num_key_value_heads=3, num_hidden_layers=30, head_dim=64)
    assert kv_bytes_per_token(mc) == 2 * 30 * 3 * 64 * 4
    assert kv_bytes_per_token(mc, 1, "bfloat16") == kv_bytes_per_token(mc, 1, "bf16") == kv_bytes_per_token(mc) // 2
    assert kv_cache_dtype(mc, "auto") == np.float32
    with pytest.raises(ValueError, match="kv_cache_dtype|kv-cache-dtype"):
        ServerArgs(kv_cache_dtype="fp4")
