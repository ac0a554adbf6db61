"""Tensor parallelism on 8 virtual CPU devices (``--xla_force_host_platform_device_count=8``, set in a
subprocess before jax is imported: tensor_parallel_worker.py).

Tiny random Llama (attention bias, untied head, 2 KV heads: tp 4 replicates each KV head twice) and Qwen3
(q/k norms, tied embeddings, 4 KV heads) configs, and a tiny Llama with SmolLM2's head counts (9 heads, 3 KV heads:
tp 3; SmolLM2 itself took ~70 s of the suite to compare with itself):
- greedy tokens of tp 2 and 4 identical to tp 1 over 16 prompts x 32 tokens, logprobs within 1e-3, with no
  compile after warm-up;
- every parameter's sharding as distributed/sharding.py specifies it, the KV cache sharded over heads;
- per-device parameter bytes <= the model's bytes / tp + 5% (plus the copies of replicated KV heads).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch


WORKER = os.path.join(os.path.dirname(__file__), "tensor_parallel_worker.py")
LOGPROB_TOL = 1e-3
KV_PROJ = ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")
EXPECTED_SPECS = [  # (parameter name suffix, spec as the worker reports it)
    (("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight"), ["tensor", None]),
    (("q_proj.bias", "k_proj.bias", "v_proj.bias"), ["tensor"]),
    (("o_proj.weight", "down_proj.weight"), [None, "tensor"]),
    (("embed_tokens.weight", "lm_head.weight"), ["tensor", None]),
    (("norm.weight",), []),
]


def run_worker(model_path: str, *args: str, timeout: float = 600) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    proc = subprocess.run([sys.executable, WORKER, model_path, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


def save_tiny(path, config, seed: int = 0) -> str:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: randomize them so their sharding is tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig

    return save_tiny(tmp_path_factory.mktemp("tiny_llama"), LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, attention_bias=True,
        tie_word_embeddings=False))


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    from transformers import Qwen3Config

    return save_tiny(tmp_path_factory.mktemp("tiny_qwen3"), Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=True), seed=1)


def expected_spec(name: str):
    for suffixes, spec in EXPECTED_SPECS:
        if name.endswith(suffixes):
            return spec
    return []


def trimmed(spec: list) -> list:
    """A PartitionSpec without trailing Nones (JAX drops them in the specs of a jitted function's outputs)."""
    spec = list(spec)
    while spec and spec[-1] is None:
        spec.pop()
    return spec


def check_same_as_tp1(results: dict) -> None:
    base = results["1"]
    for tp, r in results.items():
        assert r["num_compiles_after_warmup"] == 0, f"tp {tp} compiled after warm-up"
        assert r["tokens"] == base["tokens"], f"tp {tp}: greedy tokens differ from tp 1"
        diff = np.abs(np.asarray(r["logprobs"]) - np.asarray(base["logprobs"])).max()
        assert diff <= LOGPROB_TOL, f"tp {tp}: logprobs differ from tp 1 by {diff}"


def check_shardings(results: dict, num_kv_heads: int) -> None:
    total = sum(p["bytes"] for p in results["1"]["params"].values())  # tp 1: no replicated KV heads
    for tp, r in results.items():
        tp = int(tp)
        assert len(r["devices"]) == tp
        for name, p in r["params"].items():
            assert trimmed(p["spec"]) == trimmed(expected_spec(name)), (tp, name, p["spec"])
        per_device = sum(p["device_bytes"] for p in r["params"].values())
        heads = max(num_kv_heads, tp)  # replicated up to one KV head per device
        # replicated KV heads add their k/v projection copies (0 when tp divides the KV heads)
        kv_proj = sum(p["bytes"] for n, p in results["1"]["params"].items() if n.endswith(KV_PROJ))
        extra = kv_proj * (heads // num_kv_heads - 1) / tp
        assert per_device <= total / tp * 1.05 + extra, f"tp {tp}: {per_device} bytes per device of {total}"
        assert r["kv_shape"][2] == heads
        if tp > 1:  # (on one device a step's outputs come back with the trivial spec)
            assert trimmed(r["kv_spec"]) == ["data", None, "tensor"], r["kv_spec"]
        assert r["kv_device_shape"][2] == heads // tp


def test_tiny_llama_tp_2_4_match_tp_1(tiny_llama):
    results = run_worker(tiny_llama, "--tp", "1", "2", "4", "--prompts", "16", "--steps", "32")
    check_same_as_tp1(results)
    check_shardings(results, num_kv_heads=2)


def test_tiny_qwen3_tp_2_4_match_tp_1(tiny_qwen3):
    results = run_worker(tiny_qwen3, "--tp", "1", "2", "4", "--prompts", "16", "--steps", "32", "--page-size", "4")
    check_same_as_tp1(results)
    check_shardings(results, num_kv_heads=4)


@pytest.fixture(scope="module")
def tiny_llama_9_heads(tmp_path_factory):
    """SmolLM2's head counts (9 query heads, 3 KV heads) in a tiny random Llama whose every sharded dimension
    (vocabulary 768, MLP 192, heads) divides by 3."""
    from transformers import LlamaConfig

    return save_tiny(tmp_path_factory.mktemp("tiny_llama_9_heads"), LlamaConfig(
        vocab_size=768, hidden_size=144, intermediate_size=192, num_hidden_layers=2, num_attention_heads=9,
        num_key_value_heads=3, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=True), seed=2)


def test_smollm2_head_counts_tp_3_match_tp_1(tiny_llama_9_heads):
    results = run_worker(tiny_llama_9_heads, "--tp", "1", "3", "--prompts", "16", "--steps", "32")
    check_same_as_tp1(results)
    check_shardings(results, num_kv_heads=3)


def test_tp_that_does_not_divide_the_model_is_a_clear_error():
    from sgl_jax.srt.distributed.sharding import check_tp, padded_kv_heads

    with pytest.raises(ValueError, match="--tp-size 2 does not divide the model's attention heads"):
        check_tp(9, 3, 49152, 1536, 2)
    with pytest.raises(ValueError, match="--tp-size 3 must divide"):
        padded_kv_heads(2, 3)
    assert padded_kv_heads(2, 4) == 4 and padded_kv_heads(8, 4) == 8


def test_parallelism_flags_are_checked():
    from sgl_jax.srt.distributed.mesh import create_mesh
    from sgl_jax.srt.server_args import ServerArgs, prepare_server_args

    assert prepare_server_args(["--tp-size", "4", "--device-indexes", "4", "5", "6", "7"]).device_indexes == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="--tp-size must be a positive integer"):
        ServerArgs(tp_size=0)
    with pytest.raises(ValueError, match="--dp-size must be a positive integer"):
        ServerArgs(dp_size=0)
    with pytest.raises(ValueError, match="--load-balance-method must be one of"):
        ServerArgs(dp_size=2, load_balance_method="random")
    assert prepare_server_args(["--dp-size", "2", "--load-balance-method", "cache_aware"]).load_balance_method \
        == "cache_aware"
    with pytest.raises(ValueError, match="--device-indexes must be 2 distinct"):
        ServerArgs(tp_size=2, device_indexes=[1, 1])
    with pytest.raises(ValueError, match="needs 16 devices"):  # this process sees fewer
        create_mesh(16)
    mesh = create_mesh(1)
    assert mesh.axis_names == ("data", "tensor") and mesh.devices.shape == (1, 1)
