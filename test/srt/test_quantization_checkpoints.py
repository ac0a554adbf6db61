"""Pre-quantized checkpoints served as stored (quantization/checkpoint.py): HF block FP8 against transformers' own
dequantized model, compressed-tensors int8 against our load-time quantization of the same weights, and GGUF
Q8_0 / Q4_0 / Q4_1 blocks kept as int8 with per-block scales (model_loader/gguf_blocks.py) against the gguf
library and the dequantized model."""

from __future__ import annotations

import json
import re

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from test_model_parity import RunnerHarness, _random_prompts, check_parity
from test_quantization import _programs
from test_tensor_parallel import run_worker

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.model_loader.gguf_blocks import read_blocks
from sgl_jax.srt.quantization.methods import table_scheme
from sgl_jax.srt.server_args import ServerArgs

torch.set_num_threads(1)


def _params(harness) -> dict:
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(harness.runner.params)}


def _linear(name: str) -> bool:
    return name.endswith(("_proj.weight",)) and ".layers." in name


# ------------------------------------------------------------------------------------------------------ HF FP8
def _fp8_blocks(w: torch.Tensor, block=(128, 128)):
    """HF FP8 block quantization of w [out, in] (in a multiple of block[1]): (float8_e4m3fn [out, in],
    weight_scale_inv float32 [ceil(out / bo), in / bi]) with w ~ q * scale per block; transformers'
    FineGrainedFP8 layout."""
    bo, bi = block
    out, n_in = w.shape
    rows = -(-out // bo) * bo
    padded = torch.zeros(rows, n_in)
    padded[:out] = w
    blocks = padded.reshape(rows // bo, bo, n_in // bi, bi)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).reshape(rows, n_in)[:out].to(torch.float8_e4m3fn)
    return q, scale.float()


def _save_fp8_qwen3(path, quantized=_linear) -> None:
    """A tiny random Qwen3 written as an HF FP8 checkpoint (Qwen3-*-FP8's config and tensor names): every
    attention and MLP projection float8_e4m3fn with ``weight_scale_inv``, the rest float32. One KV head of 64
    rows exercises a block row taller than the weight. `quantized`: which tensor names are stored fp8."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                         rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = {}
    for name, t in model.state_dict().items():
        if quantized(name):
            tensors[name], tensors[name + "_scale_inv"] = _fp8_blocks(t)
        else:
            tensors[name] = t.contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    raw = config.to_dict()
    raw["architectures"] = ["Qwen3ForCausalLM"]
    raw["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(raw))


def test_hf_fp8_block_checkpoint_matches_transformers_dequantized(tmp_path):
    """An HF block-FP8 checkpoint loads as stored (fp8 weights, per-block scales repeated per row) and matches
    transformers' own computation on it (which dequantizes FP8 on CPU) within 1e-3 in logprob, prefill and
    decode."""
    from transformers import AutoModelForCausalLM

    _save_fp8_qwen3(tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert ref.model.layers[0].mlp.up_proj.weight.dtype == torch.float32  # transformers dequantized it
    harness = RunnerHarness(str(tmp_path))
    assert harness.mc.quantization == "fp8" and harness.mc.quant_scheme.group_size == 128
    params = _params(harness)
    assert params["model.layers.0.mlp.up_proj.weight"].dtype == ml_dtypes.float8_e4m3fn
    assert params["model.layers.0.mlp.up_proj.weight_scale"].shape == (384, 2)
    assert params["model.layers.0.self_attn.k_proj.weight_scale"].shape == (64, 2)
    check_parity(harness, ref, _random_prompts(1, 512, [7, 60]))


# tp 2 / tp 4 against tp 1 on the FP8 checkpoint: max |logprob difference| of the greedy tokens, measured 4.8e-7 / 9.5e-7; the
# weights are identical, only the order of the partial sums changes
FP8_TP_TOL = 1e-5


def test_hf_fp8_block_checkpoint_tp_2_and_4_equal_tp_1(tmp_path):
    """Under tensor parallelism the block scales follow their rows (the one KV head's replicated 4x at tp 4) and
    a row-parallel layer's groups that do not split evenly over the devices (down_proj's 3 groups at tp 2 and 4,
    o_proj's 2 at tp 4) keep their scales replicated; greedy tokens and logprobs equal tp 1's."""
    _save_fp8_qwen3(tmp_path)
    results = run_worker(str(tmp_path), "--tp", "1", "2", "4", "--prompts", "4", "--steps", "6")
    for tp in ("2", "4"):
        r = results[tp]
        assert r["num_compiles_after_warmup"] == 0
        assert r["tokens"] == results["1"]["tokens"], f"tp {tp}: greedy tokens differ from tp 1"
        diff = np.abs(np.asarray(r["logprobs"]) - np.asarray(results["1"]["logprobs"])).max()
        print(f"fp8 checkpoint tp {tp}: max |logprob - tp 1's| {diff:.1e}")
        assert diff <= FP8_TP_TOL
        params = r["params"]
        assert params["model.layers.0.mlp.up_proj.weight_scale"]["spec"][0] == "tensor"
        assert [a for a in params["model.layers.0.mlp.down_proj.weight_scale"]["spec"] if a] == []
        assert params["model.layers.0.self_attn.k_proj.weight_scale"]["shape"] == [64 * max(1, int(tp)), 2]


# ----------------------------------------------------------------------------------------- compressed-tensors
def _on_table_grid(w: np.ndarray) -> np.ndarray:
    """`w` [V, H] moved onto the grid --quantization stores token tables on (methods.table_scheme: int8 in groups),
    with power-of-two scales and a value of 127 steps in every group, so that quantizing it at load is exact: the
    compressed-tensors checkpoint serves its (ignored) tables in float, --quantization quantizes them."""
    g = table_scheme(w.shape[1]).group_size
    x = w.reshape(w.shape[0], -1, g).astype(np.float64)
    scale = 2.0 ** np.round(np.log2(np.abs(x).max(-1, keepdims=True) / 127.0))
    q = np.clip(np.round(x / scale), -127, 127)
    np.put_along_axis(q, np.abs(q).argmax(-1)[..., None], 127.0, axis=-1)
    return (q * scale).reshape(w.shape).astype(np.float32)


def _save_int8_pair(tiny_dir, out_float, out_ct, activations: bool) -> None:
    """From the tiny Llama at `tiny_dir`: a compressed-tensors int8 checkpoint (``int-quantized``, per-channel
    symmetric weights, dynamic per-token activations when `activations`) and the float checkpoint of exactly its
    dequantized weights."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(tiny_dir / "model.safetensors"))
    floats, ct = {}, {}
    for name, w in tensors.items():
        if _linear(name):
            scale = np.abs(w).max(1, keepdims=True) / 127.0
            q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
            ct[name], ct[name[:-len("weight")] + "weight_scale"] = q, scale.astype(np.float32)
            floats[name] = q.astype(np.float32) * scale
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            ct[name] = floats[name] = _on_table_grid(w)
        else:
            ct[name] = floats[name] = w
    config = json.loads((tiny_dir / "config.json").read_text())
    scheme = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                 "strategy": "channel", "dynamic": False}}
    if activations:
        scheme["input_activations"] = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                       "dynamic": True}
    for d, ts, qc in ((out_float, floats, None), (out_ct, ct, {
            "quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": scheme},
            "ignore": ["lm_head"]})):
        d.mkdir()
        for f in tiny_dir.iterdir():
            if f.name not in ("model.safetensors", "config.json"):
                (d / f.name).write_bytes(f.read_bytes())
        save_file(ts, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(dict(config, **({"quantization_config": qc} if qc else {}))))


@pytest.mark.parametrize("activations,method", [(True, "w8a8_int8"), (False, "int8")])
def test_compressed_tensors_int8_equals_load_time_quantization(tmp_path, activations, method):
    """A compressed-tensors int8 checkpoint (W8A8 or W8A16) serves as w8a8_int8 / int8 with its stored int8
    weights and scales, and equals --quantization of the same weights given in float (their per-channel absmax
    scales are the stored ones): logprobs within 1e-5, and the same greedy tokens."""
    from srt_helpers import save_tiny_llama

    tiny = tmp_path / "tiny"
    save_tiny_llama(tiny, init_std=0.1)
    _save_int8_pair(tiny, tmp_path / "float", tmp_path / "ct", activations)
    ours = RunnerHarness(str(tmp_path / "ct"), token_paddings=(64,))
    assert ours.mc.quantization == method
    assert _params(ours)["model.layers.0.mlp.down_proj.weight"].dtype == np.int8
    again = RunnerHarness(str(tmp_path / "float"), token_paddings=(64,), quantization=method)
    prompts = _random_prompts(2, 256, [9, 40])
    a, b = ours.prefill(prompts), again.prefill(prompts)
    for x, y in zip(a[1], b[1]):
        assert np.abs(x - y).max() < 1e-5
        assert (x.argmax(-1) == y.argmax(-1)).all()
    ours.release(a[0])
    again.release(b[0])


# -------------------------------------------------------------------------------------------------------- GGUF
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_hold_exactly_the_gguf_librarys_values(type_name):
    """read_blocks' int8 values, scales and mins give exactly gguf.quants.dequantize's floats."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[type_name]
    w = np.random.default_rng(0).normal(size=(16, 96)).astype(np.float32)
    raw = quantize(w, qtype)
    g = read_blocks(raw.reshape(-1).view(np.uint8), type_name, w.shape)
    assert g.q.dtype == np.int8 and g.scale.shape == (16, 3)
    ours = g.q.reshape(16, 3, 32) * g.scale[..., None]
    if g.minimum is not None:
        ours = ours + g.minimum[..., None]
    np.testing.assert_array_equal(ours.reshape(w.shape), dequantize(raw, qtype).reshape(w.shape))


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("shape", [(16, 96), (3, 4, 64), (256,)])
def test_gguf_blocks_dequantize_bit_identical_to_the_gguf_library(type_name, shape):
    """dequantize_blocks (the loader's path for these types, ~4x faster) gives gguf.quants.dequantize's float32
    values bit for bit, for tensors of any rank (stacked experts are 3-D, norms 1-D)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from sgl_jax.srt.model_loader.gguf_blocks import dequantize_blocks

    qtype = GGMLQuantizationType[type_name]
    w = np.random.default_rng(1).normal(size=shape).astype(np.float32) * 3 + 0.5
    raw = quantize(w, qtype)
    ours = dequantize_blocks(raw.reshape(-1).view(np.uint8), type_name, shape)
    ref = np.asarray(dequantize(raw, qtype), np.float32).reshape(shape)
    assert ours.dtype == np.float32 and ours.shape == shape
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))


# SmolLM2's Q4_1 GGUF served with --quantization gguf against the same file dequantized, both float32: max |logprob
# difference| over the vocabulary at every position of the two prompts below. Measured 1.1e-4 (the weights are
# identical; the dot sums each block's products apart, then the blocks; 1.3e-3 on two prompts of arbitrary token
# ids); the bound keeps 9x headroom.
GGUF_KEPT_TOL = 1e-3


def test_gguf_blocks_kept_quantized_match_the_dequantized_model(smollm2_tokenizer):
    """--quantization gguf keeps SmolLM2's Q4_1 projections as int8 values with per-block scales and mins (1.25
    bytes per weight instead of float32's 4) and computes what the dequantized model computes."""
    dense = RunnerHarness(None, token_paddings=(256,))
    kept = RunnerHarness(None, token_paddings=(256,), quantization="gguf")
    assert kept.mc.quant_scheme.group_size == 32 and kept.mc.quant_scheme.with_min
    params, floats = _params(kept), _params(dense)
    name = "model.layers.3.self_attn.q_proj.weight"  # rows un-permuted like the float tensor's
    g = params[name].reshape(576, 18, 32) * params[name + "_scale"][..., None] + params[name + "_min"][..., None]
    np.testing.assert_allclose(np.asarray(g).reshape(576, 576), floats[name], rtol=0, atol=1e-6)
    linear = [n for n in params if _linear(n)]
    assert len(linear) == 30 * 7 and all(params[n].dtype == np.int8 for n in linear)
    kept_bytes = sum(params[n].nbytes + params[n + "_scale"].nbytes + params[n + "_min"].nbytes for n in linear)
    assert kept_bytes / sum(floats[n].nbytes for n in linear) == pytest.approx(1.25 / 4)
    prompts = [smollm2_tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4),
               smollm2_tokenizer.encode("def add(a, b):\n    return a + b\n\nprint(add(2, 3))")]
    a, b = dense.prefill(prompts), kept.prefill(prompts)
    worst = max(float(np.abs(x - y).max()) for x, y in zip(a[1], b[1]))
    print(f"max |logprob difference|, gguf blocks kept vs dequantized: {worst:.2e}")
    assert worst < GGUF_KEPT_TOL
    assert all((x.argmax(-1) == y.argmax(-1)).all() for x, y in zip(a[1], b[1]))
    dense.release(a[0])
    kept.release(b[0])


# ------------------------------------------------------------------------------------------- the group matmul
IN, OUT, GROUP = 576, 1536, 32  # SmolLM2's hidden and intermediate widths, GGUF's block


def group_program_problems(lowered: str, compiled: str, storage: str, group: int = GROUP) -> list:
    """What is wrong with the program of a group-quantized layer [OUT, IN] (empty: nothing): the weight must enter
    in its storage dtype (`storage`: "i8" or "f8E4M3FN"), and nothing may multiply an array of the weight's
    shape, flat [OUT, IN] or grouped [OUT, IN / group, group] (a dequantized weight)."""
    problems = []
    if f"tensor<{OUT}x{IN}x{storage}>" not in lowered:
        problems.append(f"the weight is not a {storage} parameter")
    shapes = (f"{OUT}x{IN}", f"{OUT}x{IN // group}x{group}")
    for m in re.finditer(rf"= stablehlo\.multiply .*tensor<({'|'.join(shapes)})x\w+>$", lowered, re.M):
        problems.append(f"a weight-shaped multiply: {m.group(0)[:160]}")
    compiled_shapes = (f"{OUT},{IN}", f"{OUT},{IN // group},{group}")
    if re.search(rf"\S+\[({'|'.join(compiled_shapes)})\]\{{[^}}]*\}} multiply\(", compiled):
        problems.append("the compiled program multiplies a weight-shaped array")
    return problems


@pytest.mark.parametrize("method,with_min", [("int8", True), ("int8", False), ("fp8", False)])
def test_the_group_dot_takes_the_stored_values_and_scales_its_results(method, with_min):
    """A layer quantized per group of 32 input features (GGUF blocks; FP8 blocks alike) computes on its int8 /
    fp8 parameter without a dequantized weight, and gives x @ (q * scale + min).T; a planted layer that
    dequantizes first is caught by the same check."""
    from sgl_jax.srt.layers.linear import Linear
    from sgl_jax.srt.quantization.methods import METHODS, QuantScheme, quantize_weight_groups

    rng = np.random.default_rng(3)
    q, scale = quantize_weight_groups(rng.standard_normal((OUT, IN)).astype(np.float32), METHODS[method], GROUP)
    minimum = (rng.standard_normal(scale.shape) * 0.01).astype(np.float32)
    layer = Linear(IN, OUT, rngs=nnx.Rngs(0), quantization=QuantScheme(method, GROUP, with_min))
    layer.weight.set_value(jax.numpy.asarray(q))
    layer.weight_scale.set_value(jax.numpy.asarray(scale))
    if with_min:
        layer.weight_min.set_value(jax.numpy.asarray(minimum))
    graphdef, state = nnx.split(layer)
    x = jax.numpy.asarray(rng.standard_normal((8, IN)), jax.numpy.float32)
    storage = "i8" if method == "int8" else "f8E4M3FN"
    assert group_program_problems(*_programs(lambda s, x: nnx.merge(graphdef, s)(x), state, x), storage) == []
    w = (q.astype(np.float32).reshape(OUT, -1, GROUP) * scale[..., None]
         + (minimum[..., None] if with_min else 0)).reshape(OUT, IN)
    ref = np.asarray(x) @ w.T
    assert np.abs(np.asarray(layer(x)) - ref).max() < 1e-4 * np.abs(ref).max()

    def dequantize_first(q, scale, x):
        return x @ (q.astype(jax.numpy.float32).reshape(OUT, -1, GROUP) * scale[..., None]).reshape(OUT, IN).T

    assert any("weight-shaped" in p for p in group_program_problems(
        *_programs(dequantize_first, jax.numpy.asarray(q), jax.numpy.asarray(scale), x), storage))


def test_token_tables_are_int8_groups_looked_up_and_dotted_without_a_float_copy():
    """--quantization's token tables (methods.table_scheme: int8 in groups of the largest of 128 / 64 / 32 features
    dividing the hidden size): a lookup gives the looked-up rows dequantized, and the LM head's logits are the group
    dot on the int8 table (no dequantized [V, H] array in the program; a planted dequantizing head is caught)."""
    from sgl_jax.srt.layers.embedding import Embedding, lookup
    from sgl_jax.srt.layers.logits_processor import compute_logits
    from sgl_jax.srt.quantization.methods import dequantize_rows, quantize_for

    assert [getattr(table_scheme(h), "group_size", None) for h in (576, 640, 2048, 96, 100)] == [64, 128, 128, 32,
                                                                                                  None]
    scheme = table_scheme(IN)
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((OUT, IN)) * 0.05).astype(np.float32)
    q, scale = quantize_for(w, scheme)
    assert q.dtype == np.int8 and scale.shape == (OUT, IN // 64)
    table = Embedding(OUT, IN, rngs=nnx.Rngs(0), quantization=scheme)
    table.weight.set_value(jax.numpy.asarray(q))
    table.weight_scale.set_value(jax.numpy.asarray(scale))
    deq = dequantize_rows(q, scale, np.float32)
    assert np.abs(deq - w).max() <= np.abs(w).max() / 127 / 2 * 1.0001  # half a step of the coarsest group
    ids = jax.numpy.asarray([0, 7, OUT - 1, 7], jax.numpy.int32)
    np.testing.assert_array_equal(np.asarray(table(ids)), deq[np.asarray(ids)])
    np.testing.assert_array_equal(np.asarray(lookup(table.table(), ids, jax.numpy.float32)), deq[np.asarray(ids)])
    h = jax.numpy.asarray(rng.standard_normal((5, IN)), jax.numpy.float32)
    ref = np.asarray(h) @ deq.T
    logits = np.asarray(compute_logits(h, table.table()))
    assert np.abs(logits - ref).max() < 1e-4 * np.abs(ref).max()
    args = (jax.numpy.asarray(q), jax.numpy.asarray(scale), h)
    assert group_program_problems(*_programs(lambda q, s, h: compute_logits(h, (q, s)), *args), "i8", 64) == []
    assert any("weight-shaped" in p for p in group_program_problems(
        *_programs(lambda q, s, h: compute_logits(h, jax.numpy.asarray(dequantize_rows(q, s, jax.numpy.float32,
                                                                                       jax.numpy))), *args),
        "i8", 64))


# ----------------------------------------------------------------------------------------------------- refusals
def test_unservable_checkpoint_quantizations_are_refused_naming_them(tmp_path):
    """What cannot be served is refused at start-up naming the method and the reason: per-tensor FP8,
    compressed-tensors in another format or scheme, GPTQ; a --quantization contradicting the checkpoint's; and
    --quantization gguf on a model that is not a .gguf."""
    from srt_helpers import save_tiny_llama

    save_tiny_llama(tmp_path / "tiny")
    base = json.loads((tmp_path / "tiny" / "config.json").read_text())
    cases = [
        ({"quant_method": "fp8", "activation_scheme": "static"}, None, r"'fp8'.*weight_block_size None"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, None, r"'fp8'.*fmt 'e5m2'"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, None, r"format 'pack-quantized'"),
        ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}}}}, None,
         r"'compressed-tensors'.*weights"),
        ({"quant_method": "gptq", "bits": 4}, None, r"quant_method 'gptq'.*cannot load"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "int8",
         r"--quantization int8 contradicts the checkpoint's own quantization \('fp8'"),
        (None, "gguf", r"--quantization gguf keeps a GGUF file's blocks.*not a \.gguf"),
    ]
    for i, (qc, flag, message) in enumerate(cases):
        d = tmp_path / f"case{i}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(dict(base, **({"quantization_config": qc} if qc else {}))))
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_server_args(ServerArgs(model_path=str(d), tokenizer_path=str(tmp_path / "tiny"),
                                                    quantization=flag), "cpu")


def test_fp8_checkpoint_tensors_are_read_without_a_float_copy(tmp_path):
    """The loader reads a safetensors float8_e4m3fn tensor (which safetensors' numpy reader cannot return) as
    ml_dtypes' float8 with the bytes torch wrote."""
    from safetensors.torch import save_file

    from sgl_jax.srt.model_loader.loader import _iterate_safetensors

    t = torch.randn(3, 256).to(torch.float8_e4m3fn)
    save_file({"a": torch.ones(2), "w": t}, str(tmp_path / "x.safetensors"))
    got = {name: np.asarray(t) for name, t in _iterate_safetensors(str(tmp_path))}  # (read while the file is open)
    assert got["w"].dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(got["w"].astype(np.float32), t.float().numpy())
    assert jax.numpy.asarray(got["w"]).dtype == jax.numpy.float8_e4m3fn


def test_a_quantized_tensor_of_a_layer_served_unquantized_is_refused(tmp_path):
    """An fp8 LM head (a layer sgl-jax serves in the model dtype) cannot be cast without its scales: the load
    fails naming the tensor instead of serving a wrong model."""
    from sgl_jax.srt.model_loader.loader import load_model

    _save_fp8_qwen3(tmp_path, quantized=lambda n: _linear(n) or n == "lm_head.weight")
    mc = ModelConfig.from_server_args(ServerArgs(model_path=str(tmp_path)), "cpu")
    with pytest.raises(ValueError, match=r"lm_head\.weight.*serves unquantized"):
        load_model(mc, "auto")
