"""Logit parity with transformers (PyTorch CPU, float32), prefill and decode, through the real runner.

Batches go through the real pieces: ReqToTokenPool, the paged allocator, ScheduleBatch and ModelRunner
(paged KV cache written in place, ragged paged attention). The reference is transformers' model on the
same weights: SmolLM2 from its GGUF, and tiny random Qwen3 / Llama (llama3 rope scaling, untied head)
configs saved as safetensors.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.scheduler.schedule_batch import Req, ScheduleBatch
from sgl_jax.srt.mem_cache.kv_memory import KVMemory, kv_spec_for
from sgl_jax.srt.model_executor.buckets import ShapeBuckets
from sgl_jax.srt.forward_batch import ForwardMode, stack_ranks
from sgl_jax.srt.model_executor.model_runner import ModelRunner, setup_jax
from sgl_jax.srt.sampling.sampling_params import SamplingParams
from sgl_jax.srt.server_args import ServerArgs

TOL = 1e-3
DECODE_STEPS = 4


class RunnerHarness:
    """A ModelRunner with its pools, driven like the scheduler drives it (no processes).

    Args:
        model_path: HF directory or .gguf (None: the default SmolLM2 GGUF).
        page_size: tokens per KV page.
        max_total_tokens: the KV budget (one pool for every layer; the hybrid split shares it).
        dtype: "float32", "bfloat16" or "float16".
        kv_cache_dtype: --kv-cache-dtype ("auto": the model's dtype).
        context_length: tokens per sequence.
        token_paddings: the extend buckets (the largest must hold all prompts of one `prefill`).
        swa_full_tokens_ratio: None: one KV pool, windows only masked; a ratio: hybrid SWA memory (a separate
            SWA pool of that many tokens per full-pool token, SWA KV released as it leaves the window, as the
            scheduler does after every step).
    """

    def __init__(self, model_path: str, page_size: int = 1, max_total_tokens: int = 4096, dtype: str = "float32",
                 context_length: int = 512, token_paddings=(64, 256), swa_full_tokens_ratio: float = None,
                 kv_cache_dtype: str = "auto"):
        # the hybrid pool runs with the chunk cache only, until SWARadixCache lands
        swa = ({"disable_hybrid_swa_memory": True} if swa_full_tokens_ratio is None else
               {"swa_full_tokens_ratio": swa_full_tokens_ratio, "disable_radix_cache": True})
        args = ServerArgs(model_path=model_path, page_size=page_size, max_total_tokens=max_total_tokens,
                          context_length=context_length, disable_precompile=True, dtype=dtype,
                          kv_cache_dtype=kv_cache_dtype, **swa)
        setup_jax(args)  # as a server does: the persistent compilation cache serves later runs
        self.mc = ModelConfig.from_server_args(args, "cpu")
        self.buckets = ShapeBuckets(tuple(token_paddings), (1, 4))
        self.runner = ModelRunner(args, self.mc, buckets=self.buckets, max_context_len=context_length,
                                  kv_spec_fn=lambda _: kv_spec_for(args, self.mc, max_total_tokens))
        self.memory = KVMemory.create(self.runner.kv_spec, num_request_slots=4, context_len=context_length,
                                      disable_radix_cache=True, sliding_window=self.mc.sliding_window)
        self.page_size = page_size
        self.swa_tokens_released = 0

    def _run(self, batch):
        out = self.runner.forward(batch.build_model_worker_batch(self.buckets, self.memory))
        for r in batch.reqs:
            r.kv_committed_len = r.kv_allocated_len
        self.swa_tokens_released += self.memory.after_step(batch.reqs)
        return out

    def prefill(self, prompts):
        """Extend all prompts in one batch; returns (reqs, per-request logprobs of every position [n, V])."""
        reqs = [Req(f"r{i}", p, SamplingParams(max_new_tokens=64, temperature=0.0), eos_token_ids=[], seed=0)
                for i, p in enumerate(prompts)]
        for r in reqs:
            r.extend_input_len = len(r.origin_input_ids)  # no cached prefix: extend the whole prompt
        batch = ScheduleBatch(reqs, ForwardMode.EXTEND)
        batch.prepare_for_extend(self.memory)
        out = self._run(batch)
        hidden = np.asarray(out.hidden)
        per_req, o = [], 0
        for r in reqs:
            per_req.append(self.runner.full_logprobs(hidden[o:o + len(r.origin_input_ids)]))
            o += len(r.origin_input_ids)
        last = np.asarray(out.logprobs)[:len(reqs)]
        return reqs, per_req, last

    def decode(self, reqs, tokens):
        """Append `tokens` (one per request) and run one decode step; returns logprobs [S, V]."""
        for r, t in zip(reqs, tokens):
            r.output_ids.append(int(t))
        batch = ScheduleBatch(reqs, ForwardMode.DECODE)
        assert batch.prepare_for_decode(self.memory)
        out = self._run(batch)
        return np.asarray(out.logprobs)[:len(reqs)]

    def release(self, reqs):
        for r in reqs:
            self.memory.release(r)
        acc = self.memory.accounting()
        assert acc["kv_tokens_free"] == acc["kv_tokens_total"]
        assert acc.get("swa_tokens_free") == acc.get("swa_tokens_total")


@dataclasses.dataclass
class ParityReference:
    """transformers' float32 log-probabilities for `check_against_reference`.

    prompts: the token-id prompts; prefill[i]: float32[len(prompts[i]), V], every position of prompt i;
    tokens[k]: the reference's greedy token per prompt fed at decode step k; decode[k]: float32[len(prompts), V]
    after it.
    """

    prompts: list
    prefill: list
    tokens: list
    decode: list


def hf_reference(model, prompts, steps: int = DECODE_STEPS) -> ParityReference:
    """Prefill every prompt, then `steps` greedy decode steps (transformers' own KV cache), float32."""
    ref = ParityReference(prompts, [], [], [])
    caches = []
    with torch.no_grad():
        for p in prompts:
            out = model(torch.tensor([p]), use_cache=True)
            ref.prefill.append(torch.log_softmax(out.logits[0].float(), -1).numpy())
            caches.append(out.past_key_values)
            del out
        last = [lp[-1] for lp in ref.prefill]
        for _ in range(steps):
            ref.tokens.append([int(lp.argmax()) for lp in last])
            last = []
            for i, t in enumerate(ref.tokens[-1]):
                out = model(torch.tensor([[t]]), past_key_values=caches[i], use_cache=True)
                last.append(torch.log_softmax(out.logits[0, -1].float(), -1).numpy())
            ref.decode.append(np.stack(last))
    return ref


def _same_greedy(ours, ref, tol: float) -> bool:
    """Our argmax equals the reference's, unless the reference's top two are closer than 2 * tol (a tie within
    the logprob tolerance may go either way)."""
    top2 = np.sort(ref)[-2:]
    return int(np.argmax(ours)) == int(np.argmax(ref)) or top2[1] - top2[0] < 2 * tol


def check_against_reference(harness: RunnerHarness, ref: ParityReference, tol: float = TOL) -> float:
    """Prefill logprobs of every position and each decode step's logprobs within `tol` of `ref`, and the same
    greedy token at every step (decode feeds the reference's tokens, so both sides see the same sequences).
    Returns the max |logprob difference|."""
    reqs, per_req, last = harness.prefill(ref.prompts)
    worst = 0.0
    for i, lp in enumerate(ref.prefill):
        worst = max(worst, np.abs(per_req[i] - lp).max(), np.abs(last[i] - lp[-1]).max())
        assert _same_greedy(last[i], lp[-1], tol), f"prompt {i}: greedy token differs after prefill"
    del per_req
    for step, (tokens, ref_lp) in enumerate(zip(ref.tokens, ref.decode)):
        lp = harness.decode(reqs, tokens)
        worst = max(worst, np.abs(lp - ref_lp).max())
        for i in range(len(reqs)):
            assert _same_greedy(lp[i], ref_lp[i], tol), f"prompt {i}: greedy token differs at decode step {step}"
    harness.release(reqs)
    print(f"max |logprob difference| over {len(reqs)} prompts, prefill + {len(ref.tokens)} decode steps: "
          f"{worst:.2e}")
    assert worst < tol, f"max |logprob difference| {worst:.2e} >= {tol}"
    return worst


def check_parity(harness: RunnerHarness, hf_model, prompts, tol: float = TOL):
    """`check_against_reference` with transformers' `hf_model` on `prompts` as the reference."""
    return check_against_reference(harness, hf_reference(hf_model, prompts), tol)


@pytest.fixture(scope="module")
def smollm2_harness():
    return RunnerHarness(None)


def test_smollm2_gguf_tensors_bit_identical(hf_smollm2):
    from sgl_jax.srt.model_loader.default_model import find_default_model_path
    from sgl_jax.srt.model_loader.gguf_file import iterate_gguf_tensors

    ref = {k: v.numpy() for k, v in hf_smollm2.state_dict().items()}
    n = 0
    for name, arr in iterate_gguf_tensors(find_default_model_path()):
        assert np.array_equal(arr, ref[name]), name
        n += 1
    assert n == len(ref) - 1  # lm_head is tied to the embedding


def test_smollm2_logit_parity(smollm2_harness, hf_smollm2, smollm2_tokenizer):
    texts = [
        "The capital of France is",
        "def fibonacci(n):\n    if n < 2:\n        return n\n",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who",
        "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n",
    ]
    check_parity(smollm2_harness, hf_smollm2, [smollm2_tokenizer.encode(t) for t in texts])


def test_model_step_writes_kv_in_place(smollm2_harness, smollm2_tokenizer):
    """The compiled model step updates every layer's donated KV buffers in place: its HLO has no copy of a
    cache-sized buffer (a scatter into a flattened view of the cache once made XLA copy all 30 layers' K
    and V every step: 120 such copies), and the buffers survive a prefill and a decode step."""
    h = smollm2_harness
    r = h.runner
    batch = r.dummy_batch(ForwardMode.DECODE, 4, 4)
    fb, sampling = r.device_inputs(stack_ranks([batch], r.num_request_slots))
    hlo = r._step.lower(r.params, r.kv_caches, r.penalty_state, fb, sampling).compile().as_text()
    cache_shape = "f32[" + ",".join(map(str, r.kv_caches[0][0].shape)) + "]"
    copies = [ln for ln in hlo.splitlines() if f"{cache_shape}" in ln and " copy(" in ln]
    assert not copies, f"{len(copies)} copies of the KV cache per step, e.g. {copies[0].strip()[:200]}"
    ptrs = [(k.unsafe_buffer_pointer(), v.unsafe_buffer_pointer()) for k, v in r.kv_caches]
    reqs, _, last = h.prefill([smollm2_tokenizer.encode("In place, please.")])
    h.decode(reqs, [int(last[0].argmax())])
    assert [(k.unsafe_buffer_pointer(), v.unsafe_buffer_pointer()) for k, v in r.kv_caches] == ptrs
    h.release(reqs)


def test_smollm2_logit_parity_paged(hf_smollm2, smollm2_tokenizer):
    """page_size 16: prompts straddling page boundaries, decode crossing into new pages."""
    harness = RunnerHarness(None, page_size=16)
    prompts = [smollm2_tokenizer.encode("Paging test number %d: " % i + "word " * (10 + 7 * i)) for i in range(3)]
    check_parity(harness, hf_smollm2, prompts)


def _save_tiny(tmp_path, config, seed):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms are initialized to 1; randomize them so they are really tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


def _random_prompts(seed, vocab, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def test_tiny_qwen3_logit_parity(tmp_path):
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
    model = _save_tiny(tmp_path, config, seed=0)
    harness = RunnerHarness(str(tmp_path))
    check_parity(harness, model, _random_prompts(0, 512, [5, 40, 130]))


@pytest.mark.parametrize("dtype,kv_cache_dtype", [("bfloat16", "auto"), ("bfloat16", "float32"), ("float16", "auto")])
def test_tiny_qwen3_half_precision_stays_close(tmp_path, dtype, kv_cache_dtype):
    """--dtype bfloat16 or float16 (weights and activations; the KV cache too, or float32 with --kv-cache-dtype
    float32, where the native attention then computes in float32) against the float32 reference: bf16's 8-bit
    mantissa allows differences of a few 1e-2 in logprobs; a wrong layer would be far off."""
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
    model = _save_tiny(tmp_path, config, seed=2)
    harness = RunnerHarness(str(tmp_path), dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    want = jnp.float32 if kv_cache_dtype == "float32" else jnp.dtype(dtype)
    assert harness.runner.kv_caches[0][0].dtype == want
    check_parity(harness, model, _random_prompts(2, 512, [30, 7]), tol=0.1)


def test_attention_compute_dtype():
    from sgl_jax.srt.layers.attention import attention_compute_dtype

    bf16, f32 = jnp.bfloat16, jnp.float32
    assert attention_compute_dtype(bf16, f32, "native") == f32  # --dtype bfloat16 --kv-cache-dtype float32
    assert attention_compute_dtype(bf16, bf16, "native") == bf16
    assert attention_compute_dtype(f32, bf16, "native") == f32
    assert attention_compute_dtype(bf16, f32, "pallas") == bf16  # the kernels keep the model's dtype


def test_bfloat16_linear_accumulates_in_float32():
    """A bfloat16 Linear returns bfloat16 computed from a float32 accumulation of the bfloat16 operands (the
    result equals the float32 product of the rounded operands, rounded once)."""
    from flax import nnx

    from sgl_jax.srt.layers.linear import Linear

    layer = Linear(512, 96, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 512)), jnp.float32)
    y = layer(x)
    assert y.dtype == jnp.bfloat16
    want = (np.asarray(x.astype(jnp.bfloat16), np.float32) @ np.asarray(layer.weight[...], np.float32).T)
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=1e-2, atol=1e-3)
    # one row (a batch-1 decode step) goes through the two-row padding on CPU: the batch's values (up to the
    # bfloat16 rounding of a float32 sum taken in another order), shapes [1, out], [out] and [1, 1, out]
    for one, shape in ((x[:1], (1, 96)), (x[0], (96,)), (x[None, :1], (1, 1, 96))):
        got = layer(one)
        assert got.shape == shape and got.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got, np.float32).reshape(96), want[0], rtol=1e-2, atol=1e-3)


def test_bfloat16_logits_of_one_row_equal_the_batch_rows():
    """compute_logits pads a single bfloat16 row to two on CPU (layers/linear.dot_weight_t); the row's logits
    equal the same row's in a batch and the float32 product of the rounded operands."""
    from sgl_jax.srt.layers.logits_processor import compute_logits

    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((1000, 64)), jnp.bfloat16)
    h = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    batch, one = compute_logits(h, w), compute_logits(h[1:2], w)
    assert one.dtype == jnp.float32 and one.shape == (1, 1000)
    np.testing.assert_allclose(np.asarray(one), np.asarray(batch[1:2]), rtol=1e-6, atol=1e-5)
    want = np.asarray(h[1:2].astype(jnp.bfloat16), np.float32) @ np.asarray(w, np.float32).T
    np.testing.assert_allclose(np.asarray(one), want, rtol=1e-5, atol=1e-4)


def test_tiny_llama3_rope_scaling_logit_parity(tmp_path):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                         rope_theta=500000.0, tie_word_embeddings=False,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    model = _save_tiny(tmp_path, config, seed=1)
    harness = RunnerHarness(str(tmp_path))
    assert harness.mc.rope_parameters["rope_type"] == "llama3"
    check_parity(harness, model, _random_prompts(1, 512, [200, 3]))


def test_unknown_architecture_is_a_clear_error(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                                                      "vocab_size": 10, "n_embd": 8, "n_layer": 1, "n_head": 2}))
    from sgl_jax.srt.model_loader.loader import load_model

    args = ServerArgs(model_path=str(tmp_path), load_format="dummy")
    with pytest.raises(ValueError, match="not supported"):
        load_model(ModelConfig.from_server_args(args, "cpu"), "dummy")


def test_dummy_load_format_builds_random_weights(tmp_path):
    from transformers import Qwen3Config

    Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, architectures=["Qwen3ForCausalLM"]).save_pretrained(tmp_path)
    assert not any(f.endswith(".safetensors") for f in os.listdir(tmp_path))
    from sgl_jax.srt.model_loader.loader import load_model

    args = ServerArgs(model_path=str(tmp_path), load_format="dummy")
    _, params = load_model(ModelConfig.from_server_args(args, "cpu"), "dummy")
    import jax

    leaves = jax.tree.leaves(params)
    assert len(leaves) == 1 + 1 * 11 + 1 + 1  # embed, 11 per layer (incl. q/k norm), final norm, lm_head
    assert any(float(np.std(np.asarray(x))) > 0.01 for x in leaves)
