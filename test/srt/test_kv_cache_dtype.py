"""--kv-cache-dtype bfloat16 / fp8_e4m3 / fp8_e5m2 on the real SmolLM2 (float32 weights): the KV cache is stored
in half / a quarter of the bytes, attention still computes in float32, and logprobs stay close to the transformers
float32 reference (the exact difference is printed: bfloat16 2.1e-2 worst, 4.2e-3 mean on this prompt; fp8 below,
at their test)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import jax.numpy as jnp

from sgl_jax.srt.kernels.ragged_paged_attention.ref import to_cache_dtype
from sgl_jax.srt.model_executor.memory_budget import kv_bytes_per_token, kv_cache_dtype
from sgl_jax.srt.server_args import ServerArgs
from srt_helpers import SMALL_ENGINE_ARGS, checked_engine

PROMPT = ("<|im_start|>user\nWrite a short story about a lighthouse keeper who finds a message in a bottle. "
          "Describe the weather, the sea, the bottle and the message itself.<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def engine():
    with checked_engine(**dict(SMALL_ENGINE_ARGS, kv_cache_dtype="bfloat16", log_level="warning")) as e:
        yield e


def logprob_diff(engine, hf_smollm2, smollm2_tokenizer):
    """Greedy generation of 24 tokens after PROMPT: (|our logprob - transformers float32's| per prompt and output
    position, the number of prompt positions, transformers' logprobs [len, V], the output ids, the prompt ids)."""
    torch.set_num_threads(1)
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
    return np.abs(ours - theirs), len(inp), ref, out["output_ids"], ids, theirs


def test_logprobs_mean_within_1e_2_max_within_5e_2_of_float32_reference(engine, hf_smollm2, smollm2_tokenizer):
    state = engine.get_server_info()["internal_states"][0]
    assert state["kv_cache_dtype"] == "bfloat16"
    diff, n_in, ref, output_ids, ids, theirs = logprob_diff(engine, hf_smollm2, smollm2_tokenizer)
    print(f"bfloat16 KV vs float32 reference: max |logprob diff| {diff.max():.2e} (prompt tokens "
          f"{diff[:n_in].max():.2e}, generated {diff[n_in:].max():.2e}), mean {diff.mean():.2e} over {len(diff)} "
          f"tokens; worst at logprob {theirs[diff.argmax()]:.2f}")
    # bfloat16 keeps 8 bits of mantissa: measured 2.1e-2 worst (a prompt token at logprob -6.2), 1.3e-2 worst
    # on generated tokens, 4.2e-3 mean -- above issue #17's 1e-2 goal, so float32 stays the default
    assert diff.max() < 5e-2 and diff.mean() < 1e-2
    assert diff.max() > 1e-4  # the cache really is bfloat16 (a float32 cache matches to ~1e-5)
    # greedy decoding with the bfloat16 cache still follows the reference's argmax at every step
    assert all(int(np.argmax(ref[len(ids) - 1 + j])) == t for j, t in enumerate(output_ids))
    assert state["memory_errors"] == 0


# fp8 KV (scale 1): (max, mean) |logprob diff| against the float32 reference on this prompt, about 1.5x the measured
# e4m3 0.34 / 0.054 and e5m2 1.27 / 0.22 (3 and 2 mantissa bits, against bfloat16's 7; greedy tokens equal to the
# reference's argmax at 92% / 88% of the 24 steps)
FP8_BOUNDS = {"fp8_e4m3": (0.5, 0.08), "fp8_e5m2": (2.0, 0.33)}


@pytest.mark.parametrize("kv_dtype", list(FP8_BOUNDS))
def test_fp8_kv_cache_stays_near_the_float32_reference(kv_dtype, hf_smollm2, smollm2_tokenizer):
    with checked_engine(**dict(SMALL_ENGINE_ARGS, kv_cache_dtype=kv_dtype, log_level="warning",
                               precompile_token_paddings=[64], precompile_bs_paddings=[1], chunked_prefill_size=64,
                               max_running_requests=1)) as e:
        state = e.get_server_info()["internal_states"][0]
        assert state["kv_cache_dtype"] == {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[kv_dtype]
        diff, n_in, ref, output_ids, ids, _ = logprob_diff(e, hf_smollm2, smollm2_tokenizer)
    agree = np.mean([int(np.argmax(ref[len(ids) - 1 + j])) == t for j, t in enumerate(output_ids)])
    print(f"{kv_dtype} KV vs float32 reference: max |logprob diff| {diff.max():.2e}, mean {diff.mean():.2e} over "
          f"{len(diff)} tokens; greedy tokens equal to the reference's argmax: {agree:.2f}")
    max_bound, mean_bound = FP8_BOUNDS[kv_dtype]
    assert diff.max() < max_bound and diff.mean() < mean_bound
    assert diff.max() > 5e-2  # the cache really is fp8 (bfloat16's is 2.1e-2)


def test_fp8_cache_saturates_instead_of_overflowing():
    x = jnp.asarray([1000.0, -1e6, 3.0, 0.1], jnp.float32)
    e4m3 = np.asarray(to_cache_dtype(x, jnp.float8_e4m3fn).astype(jnp.float32))
    np.testing.assert_array_equal(e4m3[:3], [448.0, -448.0, 3.0])
    assert abs(e4m3[3] - 0.1) <= 0.1 * 2 ** -4
    e5m2 = np.asarray(to_cache_dtype(x, jnp.float8_e5m2).astype(jnp.float32))
    assert e5m2[1] == -57344.0 and np.all(np.isfinite(e5m2))
    mc = types.SimpleNamespace(dtype="float32", num_key_value_heads=3, num_hidden_layers=30, head_dim=64)
    assert kv_bytes_per_token(mc, 1, "fp8_e4m3") == kv_bytes_per_token(mc) // 4


def test_kv_bytes_and_flag():
    mc = types.SimpleNamespace(dtype="float32", num_key_value_heads=3, num_hidden_layers=30, head_dim=64)
    assert kv_bytes_per_token(mc) == 2 * 30 * 3 * 64 * 4
    assert kv_bytes_per_token(mc, 1, "bfloat16") == kv_bytes_per_token(mc, 1, "bf16") == kv_bytes_per_token(mc) // 2
    assert kv_cache_dtype(mc, "auto") == np.float32
    with pytest.raises(ValueError, match="kv_cache_dtype|kv-cache-dtype"):
        ServerArgs(kv_cache_dtype="fp4")


# KV scales from the checkpoint: a tiny Llama whose keys and values are 1000x (and 10x for one KV head's values)
# larger than fp8 e4m3 holds, with q_proj and o_proj scaled back so that the model computes what the original does.
# Max |logprob difference| against transformers (float32), fp8_e4m3 cache: measured 0.349 for the original model,
# 0.349 for the large one with the checkpoint's k_scale (per tensor, 1000) and v_scale (per head, [1000, 10]), 4.66
# without them (keys and values saturate at 448). With its scales the large model must stay within 10% of the
# original's fp8 error; without them it is off by more than 5x that.
KV_SCALED_RATIO, KV_UNSCALED_RATIO = 1.1, 5.0


def _save_big_kv(tiny, out, with_scales: bool) -> None:
    """`tiny` (save_tiny_llama: 4 heads of 16, 2 KV heads) with K x 1000, V x [1000, 10] per KV head, q_proj / 1000
    and o_proj's columns divided alike; with `with_scales`, plus ``self_attn.k_scale`` [] and ``v_scale`` [2]."""
    import json

    from safetensors.numpy import load_file, save_file

    t = load_file(str(tiny / "model.safetensors"))
    head_dim, v_factor = 16, np.repeat(np.float32([1000.0, 10.0]), 16)
    for layer in range(2):
        p = f"model.layers.{layer}.self_attn."
        t[p + "k_proj.weight"] = t[p + "k_proj.weight"] * 1000
        t[p + "q_proj.weight"] = t[p + "q_proj.weight"] / 1000
        t[p + "v_proj.weight"] = t[p + "v_proj.weight"] * v_factor[:, None]
        # query heads 0, 1 read KV head 0; 2, 3 read KV head 1
        t[p + "o_proj.weight"] = t[p + "o_proj.weight"] / np.repeat(v_factor[::head_dim], 2 * head_dim)[None, :]
        if with_scales:
            t[p + "k_scale"] = np.array(1000.0, np.float32)
            t[p + "v_scale"] = np.float32([1000.0, 10.0])
    out.mkdir()
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(json.loads((tiny / "config.json").read_text())))


def test_fp8_kv_scales_from_the_checkpoint_keep_large_keys_and_values(tmp_path):
    """--kv-cache-dtype fp8_e4m3 with the checkpoint's k_scale (per tensor) and v_scale (per KV head): the cache
    holds K / k_scale and V / v_scale and attention puts the scales back, so keys and values far beyond 448 are
    served like the float32 reference; the same checkpoint without scales (scale 1) saturates."""
    from transformers import AutoModelForCausalLM

    from srt_helpers import save_tiny_llama
    from test_model_parity import RunnerHarness, _random_prompts, hf_reference

    save_tiny_llama(tmp_path / "tiny", init_std=0.1)
    _save_big_kv(tmp_path / "tiny", tmp_path / "scaled", True)
    _save_big_kv(tmp_path / "tiny", tmp_path / "unscaled", False)
    torch.set_num_threads(1)
    ref = hf_reference(AutoModelForCausalLM.from_pretrained(str(tmp_path / "scaled"), dtype=torch.float32).eval(),
                       _random_prompts(4, 2048, [12, 50]))
    diffs = {}
    for name in ("tiny", "scaled", "unscaled"):  # the original; the large one with and without scales
        h = RunnerHarness(str(tmp_path / name), kv_cache_dtype="fp8_e4m3", token_paddings=(64,))
        assert h.runner.kv_cache_dtype == jnp.float8_e4m3fn
        reqs, per_req, _ = h.prefill(ref.prompts)
        diffs[name] = max(float(np.abs(a - b).max()) for a, b in zip(per_req, ref.prefill))
        h.release(reqs)
    print(f"fp8 KV, max |logprob difference| vs float32: the original model {diffs['tiny']:.2e}, with the "
          f"checkpoint's scales {diffs['scaled']:.2e}, without {diffs['unscaled']:.2e}")
    assert diffs["scaled"] <= KV_SCALED_RATIO * diffs["tiny"]
    assert diffs["unscaled"] > KV_UNSCALED_RATIO * diffs["tiny"]


def test_pallas_backend_reads_an_fp8_cache_like_native(tmp_path):
    """--attention-backend pallas with --kv-cache-dtype fp8_e4m3 (once refused): the Pallas TPU kernel (in Pallas'
    interpreter) and its flash-decoding kernel widen the fp8 pages in VMEM, and a model with the checkpoint's KV
    scales gives the native backend's log-probabilities over a prefill of two prompts and 3 decode steps, at page
    size 16 (the kernels themselves against the reference on fp8 pages: test_ragged_paged_attention_pallas)."""
    from srt_helpers import save_tiny_llama
    from test_model_parity import RunnerHarness, _random_prompts

    save_tiny_llama(tmp_path / "tiny", init_std=0.1)
    _save_big_kv(tmp_path / "tiny", tmp_path / "scaled", True)
    prompts = _random_prompts(5, 2048, [12, 50])
    results = {}
    for backend in ("native", "pallas"):
        h = RunnerHarness(str(tmp_path / "scaled"), page_size=16, kv_cache_dtype="fp8_e4m3", token_paddings=(64,),
                          attention_backend=backend)
        assert h.runner.attention_backend == backend and h.runner.kv_cache_dtype == jnp.float8_e4m3fn
        reqs, per_req, last = h.prefill(prompts)
        rows = [np.concatenate(per_req)]
        for _ in range(3):
            last = h.decode(reqs, np.argmax(last, -1))
            rows.append(np.asarray(last))
        results[backend] = rows
        h.release(reqs)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(results["native"], results["pallas"]))
    print(f"fp8 KV cache, pallas vs native: max |logprob difference| {diff:.2e}")
    assert diff < 1e-4


def test_dummy_weights_with_an_fp8_kv_cache_are_the_same_model_with_unit_scales(tmp_path):
    """--load-format dummy: an fp8 KV cache adds k_scale / v_scale (float32 ones) without changing any other
    parameter's random values."""
    from flax import nnx

    from sgl_jax.srt.configs.model_config import ModelConfig
    from sgl_jax.srt.model_loader.loader import load_model
    from srt_helpers import save_tiny_llama

    model, _ = save_tiny_llama(tmp_path / "tiny")

    def flat(kv):
        mc = ModelConfig.from_server_args(ServerArgs(model_path=model, load_format="dummy", kv_cache_dtype=kv), "cpu")
        return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in
                nnx.to_flat_state(load_model(mc, "dummy", seed=5)[1])}

    plain, fp8 = flat("auto"), flat("fp8_e4m3")
    scales = sorted(set(fp8) - set(plain))
    assert len(scales) == 2 * 2 and all(n.endswith(("k_scale", "v_scale")) for n in scales)
    assert all(fp8[n].dtype == np.float32 and (fp8[n] == 1).all() and fp8[n].shape == (2,) for n in scales)
    for name, value in plain.items():
        np.testing.assert_array_equal(fp8[name], value)
