"""Mixture-of-experts models (models/moe.py) against transformers (float32, CPU) through the real runner:
tiny random Qwen3-MoE (a dense layer among the sparse ones), Qwen2-MoE (shared expert, q/k/v biases) and
Mixtral configs saved as safetensors (per-expert tensors, stacked by the loader), logits and greedy tokens of
prefill and decode within test_model_parity's tolerances, with the grouped-matmul backend and the dense
reference backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from sgl_jax.srt.model_loader.loader import ExpertStacker
from test_model_parity import RunnerHarness, _random_prompts, _save_tiny, check_parity

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)


def tiny_config(arch: str):
    """A tiny random config of `arch` whose router spreads tokens over every expert of 8 (top 2)."""
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**COMMON, head_dim=16, num_hidden_layers=3, intermediate_size=96,
                              moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                              mlp_only_layers=[1])
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(**COMMON, num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=32,
                              num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                              shared_expert_intermediate_size=48)
    return MixtralConfig(**COMMON, num_hidden_layers=2, intermediate_size=32, num_local_experts=8,
                         num_experts_per_tok=2)


@pytest.mark.parametrize("arch,backend", [("qwen3_moe", "ragged_dot"), ("qwen3_moe", "dense"),
                                          ("qwen2_moe", "ragged_dot"), ("mixtral", "ragged_dot")])
def test_tiny_moe_logit_parity_within_1e_3(tmp_path, arch, backend):
    torch.set_num_threads(1)
    model = _save_tiny(tmp_path, tiny_config(arch), seed=0)
    with torch.no_grad():  # every expert of the first sparse layer is routed to by these prompts
        prompts = _random_prompts(0, VOCAB, [5, 40, 130])
        layer = model.model.layers[0]
        block = getattr(layer, "mlp", None) or layer.block_sparse_moe
        hidden = layer.input_layernorm(model.model.embed_tokens(torch.tensor(sum(prompts, []))))
        top = torch.topk(torch.nn.functional.linear(hidden, block.gate.weight), 2).indices
    assert set(top.flatten().tolist()) == set(range(8))
    harness = RunnerHarness(str(tmp_path), moe_backend=backend)
    check_parity(harness, model, prompts)


def test_expert_stacker():
    """Per-expert [out, in] tensors become one [E, in, out] parameter, in any order; a wrong shape, an index
    out of range or a repeated expert is an error naming the tensor."""
    shapes = {"model.layers.0.mlp.experts.up_proj": (3, 4, 2)}
    stacker = ExpertStacker(shapes, np.float32)
    tensors = {e: np.arange(8, dtype=np.float32).reshape(2, 4) + 10 * e for e in range(3)}
    assert stacker.target("model.layers.0.mlp.experts.1.up_proj.weight") == "model.layers.0.mlp.experts.up_proj"
    assert stacker.target("model.layers.0.mlp.gate.weight") is None
    assert stacker.add("model.layers.0.mlp.experts.2.up_proj.weight", tensors[2])[1] is None
    assert stacker.add("model.layers.0.mlp.experts.0.up_proj.weight", tensors[0])[1] is None
    with pytest.raises(ValueError, match="appears twice"):
        stacker.add("model.layers.0.mlp.experts.0.up_proj.weight", tensors[0])
    with pytest.raises(ValueError, match="experts.1.up_proj.weight has shape"):
        stacker.add("model.layers.0.mlp.experts.1.up_proj.weight", tensors[1].T)
    with pytest.raises(ValueError, match="expected expert < 3"):
        stacker.add("model.layers.0.mlp.experts.3.up_proj.weight", tensors[1])
    name, stacked = stacker.add("model.layers.0.mlp.experts.1.up_proj.weight", tensors[1])
    assert name == "model.layers.0.mlp.experts.up_proj" and stacked.shape == (3, 4, 2)
    assert all(np.array_equal(stacked[e], tensors[e].T) for e in range(3))


def test_dummy_weights_build_the_stacked_experts(tmp_path):
    """--load-format dummy gives every stacked expert parameter its full shape (no checkpoint needed)."""
    from sgl_jax.srt.configs.model_config import ModelConfig
    from sgl_jax.srt.model_loader.loader import load_model
    from sgl_jax.srt.server_args import ServerArgs

    config = tiny_config("mixtral")
    config.architectures = ["MixtralForCausalLM"]
    config.save_pretrained(tmp_path)
    mc = ModelConfig.from_server_args(ServerArgs(model_path=str(tmp_path), load_format="dummy"), "cpu")
    _, params = load_model(mc, "dummy")
    experts = params["model"]["layers"][0]["block_sparse_moe"]["experts"]
    assert experts["w1"][...].shape == experts["w3"][...].shape == (8, 64, 32)
    assert experts["w2"][...].shape == (8, 32, 64) and float(np.std(np.asarray(experts["w2"][...]))) > 0.01
