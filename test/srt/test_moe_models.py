"""Mixture-of-experts models (models/moe.py) against transformers (float32, CPU) through the real runner:
tiny random Qwen3-MoE (a dense layer among the sparse ones), Qwen2-MoE (shared expert, q/k/v biases) and
Mixtral configs saved as safetensors (per-expert tensors, stacked by the loader), logits and greedy tokens of
prefill and decode within test_model_parity's tolerances, with the grouped-matmul backend and the dense
reference backend."""

from __future__ import annotations

import os

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


# ---------------------------------------------------------------- GGUF (llama.cpp's MoE tensor names)
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}


def _gguf_tensors(sd: dict, arch: str, cfg) -> dict:
    """A saved checkpoint's tensors (`sd`: HF names, per-expert weights) under llama.cpp's names and layouts
    (experts stacked [E, out, in], llama q/k rows permuted as llama.cpp's converter permutes them)."""
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
           "output.weight": sd["lm_head.weight"]}
    moe = "block_sparse_moe" if arch == "mixtral" else "mlp"
    names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    experts = cfg.num_local_experts if arch == "mixtral" else cfg.num_experts

    def permute(w, n):  # the inverse of gguf_file.unpermute_qk
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out[b + "attn_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[b + "ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        for ours, theirs in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
            w = sd[f"{p}self_attn.{ours}.weight"]
            if arch == "mixtral" and ours in ("q_proj", "k_proj"):
                w = permute(w, cfg.num_attention_heads if ours == "q_proj" else cfg.num_key_value_heads)
            out[f"{b}{theirs}.weight"] = w
            if f"{p}self_attn.{ours}.bias" in sd:
                out[f"{b}{theirs}.bias"] = sd[f"{p}self_attn.{ours}.bias"]
        for norm in ("q_norm", "k_norm"):
            if f"{p}self_attn.{norm}.weight" in sd:
                out[f"{b}attn_{norm}.weight"] = sd[f"{p}self_attn.{norm}.weight"]
        if f"{p}{moe}.gate.weight" not in sd:  # a dense layer
            for ours, theirs in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                out[f"{b}{theirs}.weight"] = sd[f"{p}mlp.{ours}.weight"]
            continue
        out[b + "ffn_gate_inp.weight"] = sd[f"{p}{moe}.gate.weight"]
        for ours, theirs in zip(names, ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
            out[f"{b}{theirs}.weight"] = np.stack([sd[f"{p}{moe}.experts.{e}.{ours}.weight"] for e in range(experts)])
        for ours, theirs in (("gate_proj", "ffn_gate_shexp"), ("up_proj", "ffn_up_shexp"), ("down_proj", "ffn_down_shexp")):
            if f"{p}mlp.shared_expert.{ours}.weight" in sd:
                out[f"{b}{theirs}.weight"] = sd[f"{p}mlp.shared_expert.{ours}.weight"]
        if f"{p}mlp.shared_expert_gate.weight" in sd:
            out[b + "ffn_gate_inp_shexp.weight"] = sd[f"{p}mlp.shared_expert_gate.weight"][0]
    return out


def write_moe_gguf(model_dir: str, arch: str, cfg, path: str) -> None:
    """A float32 GGUF of the tiny model saved in `model_dir`, written with the `gguf` library: SmolLM2's
    tokenizer metadata, the architecture's hyper-parameters (expert counts and sizes included) and
    `_gguf_tensors`."""
    from safetensors.numpy import load_file
    import gguf

    from sgl_jax.srt.configs.model_config import resolve_model_path

    g = GGUF_ARCH[arch]
    reader = gguf.GGUFReader(resolve_model_path(None).gguf_file)
    writer = gguf.GGUFWriter(path, g)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = {"sub_type": field.types[-1]} if field.types[0] == gguf.GGUFValueType.ARRAY else {}
            writer.add_key_value(key, field.contents(), field.types[0], **sub)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_expert_count(cfg.num_local_experts if arch == "mixtral" else cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if arch != "mixtral":
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    for name, arr in _gguf_tensors(load_file(os.path.join(model_dir, "model.safetensors")), arch, cfg).items():
        writer.add_tensor(name, np.ascontiguousarray(arr))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_gguf_moe_file_matches_transformers(tmp_path, monkeypatch, arch):
    """A GGUF written from the tiny weights (llama.cpp's qwen3moe / qwen2moe / llama-with-experts layout) loads
    with the same config and serves the same logits as transformers (hence as the safetensors load)."""
    monkeypatch.setenv("SGL_JAX_CACHE_DIR", str(tmp_path / "cache"))
    torch.set_num_threads(1)
    cfg = tiny_config(arch)
    cfg.vocab_size = 49152  # SmolLM2's tokenizer, whose metadata the file carries
    model = _save_tiny(tmp_path / "hf", cfg, seed=1)
    path = str(tmp_path / f"tiny-{arch}.gguf")
    write_moe_gguf(str(tmp_path / "hf"), arch, cfg, path)
    harness = RunnerHarness(path)
    assert harness.mc.architecture == type(model).__name__
    got = harness.mc.hf_config
    if arch == "qwen3_moe":
        assert got.mlp_only_layers == [1] and got.norm_topk_prob is True
    check_parity(harness, model, _random_prompts(1, 49152, [7, 60]))


# ---------------------------------------------------------------- expert parallelism (8 virtual CPU devices)
@pytest.mark.parametrize("arch", ["qwen3_moe"])
def test_expert_parallel_ep_2_4_match_ep_1(tmp_path, arch):
    """--ep-size = --tp-size 2 and 4 (tensor_parallel_worker.py, a subprocess with 8 virtual devices): greedy
    tokens over 16 prompts x 32 steps identical to one device, logprobs within 1e-3, no compile after warm-up,
    each device holding E / ep experts of every stacked weight. One architecture (~23 s each on the 2-core CI
    machine): test_moe_dp_ep_serving.py serves all three at ep2 and ep4 against transformers."""
    from test_tensor_parallel import check_same_as_tp1, run_worker, save_tiny

    model_dir = save_tiny(tmp_path, tiny_config(arch))
    results = run_worker(model_dir, "--tp", "1", "2", "4", "--ep", "--prompts", "16", "--steps", "32")
    check_same_as_tp1(results)
    for tp, r in results.items():
        experts = {n: p for n, p in r["params"].items() if ".experts." in n}
        assert len(experts) == 6  # (gate, up, down) of 2 sparse layers
        for name, p in experts.items():
            if tp != "1":
                assert p["spec"][:1] == ["tensor"], (tp, name, p["spec"])
            assert p["device_bytes"] * int(tp) == p["bytes"], (tp, name)


def test_ep_size_flag_is_checked():
    from sgl_jax.srt.server_args import ServerArgs

    from sgl_jax.srt.distributed.sharding import expert_axes

    with pytest.raises(ValueError, match="--ep-size must be 1, --tp-size"):
        ServerArgs(ep_size=2)
    for bad in (0, 3, 8):
        with pytest.raises(ValueError, match="--ep-size"):
            ServerArgs(tp_size=2, dp_size=2, ep_size=bad)
    assert ServerArgs(tp_size=2, ep_size=2).ep_size == 2
    assert ServerArgs(tp_size=2, dp_size=2, ep_size=4).ep_size == 4 == ServerArgs(dp_size=4, ep_size=4).ep_size
    assert expert_axes(1, 2, 2) == () and expert_axes(2, 2, 2) == ("tensor",)
    assert expert_axes(4, 2, 2) == expert_axes(2, 1, 2) == ("data", "tensor")
    with pytest.raises(ValueError, match="--ep-size must be one of \\[1, 2, 4\\]"):
        expert_axes(3, 2, 2)
