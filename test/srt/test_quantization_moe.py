"""Mixture-of-experts models under --quantization: the stacked experts in int8 / fp8 with one scale per expert and
output channel (layers/moe.StackedExperts), on every grouped-matmul backend and under expert parallelism.

The reference is transformers run on the weights we serve, dequantized (every linear layer's and expert's
int8 / fp8 values times their scales, the token tables' int8 groups too): our quantized model must compute what
that float model computes, within test_model_parity's float32 tolerance."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flax import nnx
from test_model_parity import RunnerHarness, _random_prompts, _save_tiny, check_parity
from test_moe_models import VOCAB, tiny_config

from sgl_jax.srt.quantization.methods import dequantize_rows

torch.set_num_threads(1)


def _served_params(harness) -> dict:
    return {".".join(map(str, p)): np.asarray(v.get_value()).astype(np.float32)
            for p, v in nnx.to_flat_state(harness.runner.params)}


def load_dequantized(model, params: dict) -> int:
    """Overwrite transformers' `model` (Qwen2-MoE: experts fused as gate_up_proj [E, 2I, D], down_proj [E, D, I])
    with our quantized weights times their scales; returns how many quantized tensors it replaced."""
    state = model.state_dict()
    n = 0
    with torch.no_grad():
        for name, q in params.items():
            scale = params.get(name + "_scale")
            if scale is None:
                continue
            n += 1
            if q.ndim == 2:  # a linear layer [out, in], scales [out]; a token table [V, H], scales [V, H / g]
                state[name].copy_(torch.from_numpy(dequantize_rows(q, scale, np.float32)))
                continue
            w = torch.from_numpy((q * scale[:, None, :]).transpose(0, 2, 1).copy())  # [E, out, in]
            prefix, kind = name.rsplit(".", 1)
            if kind == "down_proj":
                state[f"{prefix}.down_proj"].copy_(w)
            else:
                half = w.shape[1]
                rows = slice(0, half) if kind == "gate_proj" else slice(half, 2 * half)
                state[f"{prefix}.gate_up_proj"][:, rows, :].copy_(w)
    return n


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    """A tiny Qwen2-MoE (8 experts, top 2, a shared expert) saved as safetensors, and transformers' model of it."""
    path = tmp_path_factory.mktemp("qwen2_moe")
    return path, _save_tiny(path, tiny_config("qwen2_moe"), seed=0)


@pytest.mark.parametrize("method,backends", [("int8", ("tiled", "ragged_dot", "dense")), ("fp8", ("tiled",))])
def test_quantized_experts_compute_the_dequantized_model(qwen2_moe, method, backends):
    """Every projection, shared-expert projection and stacked expert weight is stored in one byte per value;
    each backend computes what transformers computes on those values times their scales (max |logprob
    difference| under 1e-3, greedy tokens equal), so the experts' scales are applied per expert and output
    channel."""
    path, model = qwen2_moe
    prompts = _random_prompts(0, VOCAB, [5, 40, 130])
    for backend in backends:
        harness = RunnerHarness(str(path), moe_backend=backend, quantization=method)
        params = _served_params(harness)
        raw = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(harness.runner.params)}
        experts = [n for n in raw if n.endswith(("experts.gate_proj", "experts.up_proj", "experts.down_proj"))]
        assert len(experts) == 2 * 3 and all(raw[n].dtype.itemsize == 1 for n in experts)
        assert raw["model.layers.0.mlp.experts.down_proj_scale"].shape == (8, 64)
        # q, k, v, o and the shared expert's gate, up, down per layer, the 3 stacked experts; the embedding table and
        # the (untied) LM head in int8 groups
        assert load_dequantized(model, params) == 2 * (4 + 3 + 3) + 2
        check_parity(harness, model, prompts)


def test_quantized_experts_under_expert_parallelism_equal_one_device(tmp_path):
    """--ep-size = --tp-size 2 and 4 with --quantization int8: the experts and their scales split by expert over
    the devices, greedy tokens and logprobs equal to one device's."""
    from test_tensor_parallel import check_same_as_tp1, run_worker, save_tiny

    model_dir = save_tiny(tmp_path, tiny_config("qwen3_moe"))
    results = run_worker(model_dir, "--tp", "1", "2", "4", "--ep", "--prompts", "8", "--steps", "12",
                         "--quantization", "int8")
    check_same_as_tp1(results)
    for tp, r in results.items():
        for name, p in r["params"].items():
            if ".experts." in name:
                assert p["spec"][:1] == (["tensor"] if tp != "1" else p["spec"][:1]), (tp, name, p["spec"])
                assert p["device_bytes"] * int(tp) == p["bytes"], (tp, name)
                if not name.endswith("_scale"):
                    assert p["bytes"] == np.prod(p["shape"]), name  # one byte per value
