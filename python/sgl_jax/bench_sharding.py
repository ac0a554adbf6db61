"""Sharding-plan benchmark: per-device weight and KV memory under tensor and expert parallelism, from shapes.

``python -m sgl_jax.bench_sharding [--output reports/sharding-plan-2026-11-26.md]``

Dense models (Llama-3-8B, Qwen3-8B, Qwen3-32B; bfloat16) at tp 1, 4, 8 (and quantized, `QUANT_PLANS`, at tp
1, 2, 4), and mixture-of-experts models
(Qwen3-30B-A3B, Qwen3-235B-A22B, Mixtral-8x7B) at expert parallelism ep 4, 8, 16. A row at ep N is tp N with
``ModelConfig.ep_size`` N (experts over the tensor axis; DP attention + EP, ``--ep-size`` = tp x dp, is only in
the dispatch table): attention, embeddings and LM head split as in the dense rows, each MoE layer's stacked
experts [E, in, out] split on E (`distributed/sharding.EXPERTS`).

Each model is built abstractly with ``nnx.eval_shape`` over a ``jax.sharding.AbstractMesh`` of shape (1, tp) (no
weights, no devices: the k/v projections come out sized by `padded_kv_heads`, as on a real mesh), each parameter's
shard sized from its `param_spec`, and the KV bytes per token taken from `kv_bytes_per_token`. From those: the
largest KV pool (tokens) and batch of 4k-token sequences that fit in a TPU v6e chip (32 GiB HBM) or an H100
(80 GiB) per device, with `MEM_FRACTION` of device memory usable. A combination the engine cannot build (experts
or heads that do not divide over ep) gets a row saying why. Runs in under a minute on any machine.
"""

from __future__ import annotations

import argparse
import datetime
import math
import re
import sys
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence, Tuple

GIB = 2 ** 30
MIB = 2 ** 20
MEM_FRACTION = 0.9  # share of device memory for weights + KV pool; the rest: activations, XLA workspace
DEVICES = {"v6e": 32 * GIB, "H100": 80 * GIB}  # HBM per chip: TPU v6e (Trillium) 32 GiB, H100 SXM 80 GiB
SEQ_LEN = 4096  # tokens per sequence for the "batch@4k" column
TP_SIZES = (1, 4, 8)
EP_SIZES = (4, 8, 16)  # expert parallelism of the MoE rows (tp = ep)
TABLE_HEADER = ("| model | tp | weights GiB/device | KV MiB per 1k tokens/device | v6e KV tokens | v6e batch@4k "
                "| H100 KV tokens | H100 batch@4k |")
MOE_TABLE_HEADER = ("| model | ep (= tp) | experts/device | weights GiB/device | of which experts GiB/device "
                    "| KV MiB per 1k tokens/device | v6e KV tokens | v6e batch@4k | H100 KV tokens | H100 batch@4k |")
ATTENTION_PARAMS = r"\.self_attn\."  # dotted-path pattern of the attention layers' parameters

# Shapes from each model's HF config.json (meta-llama/Meta-Llama-3-8B, Qwen/Qwen3-8B, Qwen/Qwen3-32B).
# Llama-3-8B carries Llama-3.1-8B's llama3 rope scaling (same shapes; rope does not change memory).
MODELS: Dict[str, dict] = {
    "Llama-3-8B": dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       vocab_size=128256, tie_word_embeddings=False, rms_norm_eps=1e-5, attention_bias=False,
                       max_position_embeddings=131072,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8192}),
    "Qwen3-8B": dict(architectures=["Qwen3ForCausalLM"], hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=151936, tie_word_embeddings=False, rms_norm_eps=1e-6, attention_bias=False,
                     max_position_embeddings=40960,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "Qwen3-32B": dict(architectures=["Qwen3ForCausalLM"], hidden_size=5120, intermediate_size=25600,
                      num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                      vocab_size=151936, tie_word_embeddings=False, rms_norm_eps=1e-6, attention_bias=False,
                      max_position_embeddings=40960,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
}


# Shapes from each model's HF config.json (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B, mistralai/Mixtral-8x7B-v0.1).
# Every Qwen3-MoE layer is sparse (decoder_sparse_step 1, no mlp_only_layers): intermediate_size is unused there.
_QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], num_key_value_heads=4, head_dim=128, num_experts=128,
                  num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                  vocab_size=151936, tie_word_embeddings=False, rms_norm_eps=1e-6, attention_bias=False,
                  max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
MOE_MODELS: Dict[str, dict] = {
    "Qwen3-30B-A3B": dict(_QWEN3_MOE, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          moe_intermediate_size=768, intermediate_size=6144),
    "Qwen3-235B-A22B": dict(_QWEN3_MOE, hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                            moe_intermediate_size=1536, intermediate_size=12288),
    "Mixtral-8x7B": dict(architectures=["MixtralForCausalLM"], hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         num_local_experts=8, num_experts_per_tok=2, vocab_size=32000, tie_word_embeddings=False,
                         rms_norm_eps=1e-5, attention_bias=False, sliding_window=None, max_position_embeddings=32768,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
}


def num_experts(hf_config) -> int:
    """Experts per MoE layer: ``num_experts`` (Qwen2/3-MoE) or ``num_local_experts`` (Mixtral); 0 for a dense
    model."""
    return int(getattr(hf_config, "num_experts", 0) or getattr(hf_config, "num_local_experts", 0) or 0)


def make_model_config(name: str, dtype: str = "bfloat16", ep_size: int = 1, quantization: Optional[str] = None):
    """A `ModelConfig` for ``MODELS[name]`` or ``MOE_MODELS[name]`` with a plain-namespace ``hf_config`` (no
    transformers, no files).

    Args:
        name: a key of `MODELS` or `MOE_MODELS`.
        dtype: "bfloat16" or "float32" (parameter and KV-cache dtype).
        ep_size: ``--ep-size``: 1, or the tp the model is built for (experts split over the tensor axis).
        quantization: ``--quantization`` (its linear layers' weights in one byte plus a float32 scale per output
            channel, the embedding table and LM head in one byte plus a float32 scale per group:
            ModelConfig.table_quant_scheme), None: not quantized.
    """
    from sgl_jax.srt.configs.model_config import ModelConfig, ResolvedModel

    c = MODELS[name] if name in MODELS else MOE_MODELS[name]
    return ModelConfig(
        resolved=ResolvedModel(model_path=f"{name} (shapes only)", hf_dir="", gguf_file=None),
        hf_config=SimpleNamespace(**c), architecture=c["architectures"][0], dtype=dtype,
        context_len=c["max_position_embeddings"], vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"], head_dim=c["head_dim"], eos_token_ids=[],
        rope_parameters=dict(c["rope_parameters"]), ep_size=ep_size, quantization=quantization)


def param_shapes(model_config, tp: int) -> Dict[str, Tuple[Tuple[int, ...], int]]:
    """{dotted parameter path: (global shape, bytes per element)} of the model built for a tensor axis of size
    `tp` (``nnx.eval_shape`` on an ``AbstractMesh((1, tp), ("data", "tensor"))``: nothing is allocated)."""
    import jax
    from flax import nnx

    from sgl_jax.srt.distributed.mesh import AXES
    from sgl_jax.srt.model_loader.loader import JNP_DTYPES
    from sgl_jax.srt.models.registry import get_model_class

    cls = get_model_class(model_config.architecture)
    mesh = jax.sharding.AbstractMesh((1, tp), AXES)
    dtype = JNP_DTYPES[model_config.dtype]
    abstract = nnx.eval_shape(lambda: cls(model_config, dtype=dtype, rngs=None, mesh=mesh))  # (shapes only)
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        v = var.get_value()
        out[".".join(str(p) for p in path)] = (tuple(v.shape), v.dtype.itemsize)
    return out


def weight_bytes_per_device(model_config, tp: int, shapes: Optional[dict] = None, only: Optional[str] = None) -> int:
    """Bytes of parameters on each of the `tp` devices: every dimension that `param_spec` puts on ``"tensor"``
    is split `tp` ways (rounded up, as GSPMD pads), every other one is held whole (replicated). Stacked experts
    are split on E when ``model_config.ep_size > 1`` (as the loader's `_Placer` places them), else replicated.

    Args:
        shapes: `param_shapes(model_config, tp)` if already computed.
        only: a regex over dotted parameter paths: count just the parameters it matches (e.g.
            `sharding.STACKED_EXPERTS`, `ATTENTION_PARAMS`); None counts all.
    """
    from sgl_jax.srt.distributed.sharding import param_spec

    expert_parallel = getattr(model_config, "ep_size", 1) > 1
    total = 0
    for name, (shape, itemsize) in (shapes or param_shapes(model_config, tp)).items():
        if only is not None and not re.search(only, name):
            continue
        spec = tuple(param_spec(name, ("tensor",) if expert_parallel else (), len(shape))) + (None,) * len(shape)
        total += itemsize * math.prod(-(-d // tp) if ax == "tensor" else d for d, ax in zip(shape, spec))
    return total


def kv_pool_tokens(hbm_bytes: int, weight_bytes: int, kv_bytes_per_token: int,
                   fraction: float = MEM_FRACTION) -> int:
    """Tokens of KV cache one device can hold (and so the whole tp group: each device keeps its heads of every
    token) after its weights, in ``fraction * hbm_bytes``; 0 when the weights alone do not fit."""
    return max(0, int(fraction * hbm_bytes) - weight_bytes) // kv_bytes_per_token


def plan(models: Sequence[str] = tuple(MODELS), tp_sizes: Sequence[int] = TP_SIZES,
         quantization: Optional[str] = None, kv_cache_dtype: str = "auto") -> List[dict]:
    """One row per (model, tp): ``weight_bytes`` (per device, bytes), ``kv_bytes_per_1k`` (per device, bytes
    per 1024 tokens), and for each device of `DEVICES` ``<dev>_tokens`` (KV pool, tokens) and ``<dev>_batch``
    (sequences of `SEQ_LEN` tokens). `quantization` / `kv_cache_dtype`: the ``--quantization`` and
    ``--kv-cache-dtype`` flags (bfloat16 weights and KV when not given); rows carry both."""
    from sgl_jax.srt.distributed.sharding import check_tp, padded_kv_heads
    from sgl_jax.srt.model_executor.memory_budget import kv_bytes_per_token

    rows = []
    for name in models:
        mc = make_model_config(name, quantization=quantization)
        shapes = {}  # the mesh changes the model's shapes only through padded_kv_heads: build once per value
        for tp in tp_sizes:
            check_tp(mc.num_attention_heads, mc.num_key_value_heads, mc.vocab_size,
                     int(mc.hf_config.intermediate_size), tp)
            key = padded_kv_heads(mc.num_key_value_heads, tp)
            if key not in shapes:
                shapes[key] = param_shapes(mc, tp)
            w, kv = weight_bytes_per_device(mc, tp, shapes[key]), kv_bytes_per_token(mc, tp, kv_cache_dtype)
            row = {"model": name, "tp": tp, "weight_bytes": w, "kv_bytes_per_1k": kv * 1024}
            if quantization is not None or kv_cache_dtype != "auto":
                row.update(quantization=quantization, kv_cache_dtype=kv_cache_dtype)
            rows.append(_add_fit(row, w, kv))
    return rows


# the quantized plans: (--quantization, --kv-cache-dtype) at these tp sizes (W8A8's weights are the weight-only's)
QUANT_PLANS = (("int8", "auto"), ("fp8", "auto"), ("fp8", "fp8_e4m3"))
QUANT_TP_SIZES = (1, 2, 4)
QUANT_TABLE_HEADER = ("| model | --quantization | KV | tp | weights GiB/device | KV MiB per 1k tokens/device "
                      "| v6e KV tokens | v6e batch@4k | H100 KV tokens | H100 batch@4k |")


def quant_plan(models: Sequence[str] = tuple(MODELS), tp_sizes: Sequence[int] = QUANT_TP_SIZES) -> List[dict]:
    """`plan`'s rows for every (--quantization, --kv-cache-dtype) of `QUANT_PLANS`."""
    return [r for q, kv in QUANT_PLANS for r in plan(models, tp_sizes, quantization=q, kv_cache_dtype=kv)]


# the quantized mixture-of-experts plan: --quantization fp8 (experts included), KV in bfloat16, at EP_SIZES
QUANT_MOE_METHOD = "fp8"


def quant_moe_plan(models: Sequence[str] = tuple(MOE_MODELS), ep_sizes: Sequence[int] = EP_SIZES) -> List[dict]:
    """`moe_plan`'s rows with ``--quantization`` `QUANT_MOE_METHOD`."""
    return moe_plan(models, ep_sizes, quantization=QUANT_MOE_METHOD)


def format_quant_table(rows: List[dict]) -> str:
    """`quant_plan`'s rows as a markdown table ("bfloat16" for an ``auto`` KV cache)."""
    lines = [QUANT_TABLE_HEADER, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kv = "bfloat16" if r["kv_cache_dtype"] == "auto" else r["kv_cache_dtype"]
        cells = [r["model"], r["quantization"], kv, str(r["tp"]), f"{r['weight_bytes'] / GIB:.2f}",
                 f"{r['kv_bytes_per_1k'] / MIB:.0f}"]
        lines.append("| " + " | ".join(cells + _fit_cells(r)) + " |")
    return "\n".join(lines)


def _add_fit(row: dict, weight_bytes: int, kv_bytes_per_token: int) -> dict:
    """`row` with ``<dev>_tokens`` (KV pool, tokens) and ``<dev>_batch`` (sequences of `SEQ_LEN` tokens) for each
    device of `DEVICES`, from the per-device weight bytes and KV bytes per token."""
    for dev, hbm in DEVICES.items():
        row[f"{dev}_tokens"] = kv_pool_tokens(hbm, weight_bytes, kv_bytes_per_token)
        row[f"{dev}_batch"] = row[f"{dev}_tokens"] // SEQ_LEN
    return row


def moe_problem(model_config, ep: int) -> Optional[str]:
    """Why the MoE model cannot be built at ``--tp-size ep --ep-size ep`` (one line), or None when it can: the
    experts must divide over ep (`layers.moe.SparseMoeBlock`), and heads, vocabulary and intermediate size over
    tp (`sharding.check_tp`, as the model runner checks them)."""
    from sgl_jax.srt.distributed.sharding import check_tp

    experts = num_experts(model_config.hf_config)
    if experts % ep:
        return f"{experts} experts do not divide over {ep}"
    try:
        check_tp(model_config.num_attention_heads, model_config.num_key_value_heads, model_config.vocab_size,
                 int(model_config.hf_config.intermediate_size), ep)
    except ValueError as e:
        return str(e)
    return None


def moe_plan(models: Sequence[str] = tuple(MOE_MODELS), ep_sizes: Sequence[int] = EP_SIZES,
             quantization: Optional[str] = None) -> List[dict]:
    """One row per (MoE model, ep), the model built at tp = ep with its experts split ep ways: ``ep``, ``tp``,
    ``experts`` (per layer) and ``problem`` (`moe_problem`, None when it builds); when it builds, also
    ``experts_per_device``, ``weight_bytes``, ``expert_bytes`` (the stacked experts' share of it),
    ``attention_bytes`` (the attention layers' share) -- all per device, bytes -- and ``kv_bytes_per_1k`` and the
    device columns as `plan`'s rows. `quantization`: the ``--quantization`` flag (linear layers and stacked
    experts in one byte per value with their scales); rows then carry it."""
    from sgl_jax.srt.distributed.sharding import STACKED_EXPERTS, padded_kv_heads
    from sgl_jax.srt.model_executor.memory_budget import kv_bytes_per_token

    rows = []
    for name in models:
        shapes = {}  # global shapes change with the mesh only through padded_kv_heads: build once per value
        for ep in ep_sizes:
            mc = make_model_config(name, ep_size=ep, quantization=quantization)
            experts = num_experts(mc.hf_config)
            row = {"model": name, "ep": ep, "tp": ep, "experts": experts, "problem": moe_problem(mc, ep)}
            if quantization is not None:
                row["quantization"] = quantization
            rows.append(row)
            if row["problem"] is not None:
                continue
            key = padded_kv_heads(mc.num_key_value_heads, ep)
            if key not in shapes:
                shapes[key] = param_shapes(mc, ep)
            w, kv = weight_bytes_per_device(mc, ep, shapes[key]), kv_bytes_per_token(mc, ep)
            row.update(experts_per_device=experts // ep, weight_bytes=w,
                       expert_bytes=weight_bytes_per_device(mc, ep, shapes[key], only=STACKED_EXPERTS),
                       attention_bytes=weight_bytes_per_device(mc, ep, shapes[key], only=ATTENTION_PARAMS),
                       kv_bytes_per_1k=kv * 1024)
            _add_fit(row, w, kv)
    return rows


DISPATCH_TOKENS = (1, 8, 64, 512, 4096)  # tokens per data-parallel rank in one step (decode batches .. prefill)
DISPATCH_EP = 8


def distinct_devices(num_experts: int, top_k: int, ep: int) -> float:
    """Expected number of the `ep` devices (each holding E / ep experts) that one token's top-k experts fall on,
    for k distinct experts drawn uniformly: ``ep * (1 - C(E - E/ep, k) / C(E, k))``."""
    per = num_experts // ep
    return ep * (1 - math.comb(num_experts - per, top_k) / math.comb(num_experts, top_k))


def dispatch_bytes(tokens: int, hidden: int, num_experts: int, top_k: int, ep: int, itemsize: int = 2) -> dict:
    """Bytes each device sends per MoE layer in one step under DP attention + EP over `ep` devices (dp = ep, tp 1;
    `tokens` per rank, activations of `itemsize` bytes), by dispatch scheme:

    - ``allgather``: the engine's (layers/moe.experts_expert_parallel): all-gather every rank's activations
      ((ep - 1) * tokens rows sent, ring) and reduce-scatter the outputs (again (ep - 1) * tokens rows);
    - ``all_to_all``: each token's row sent once to every other device that holds one of its experts, and the
      partial outputs sent back (2 * tokens * d * (ep - 1) / ep rows, d = `distinct_devices`; routing ids, weights
      and the per-device counts it must exchange first are ignored: a few bytes per token).

    Uniform routing; the ratio all_to_all / allgather is d / ep whatever the step size. Returns ``{"allgather",
    "all_to_all"}`` in bytes.
    """
    row = hidden * itemsize
    d = distinct_devices(num_experts, top_k, ep)
    return {"allgather": 2 * (ep - 1) * tokens * row, "all_to_all": 2 * tokens * d * (ep - 1) / ep * row}


def format_dispatch_table(models: Sequence[str] = tuple(MOE_MODELS), ep: int = DISPATCH_EP) -> str:
    """`dispatch_bytes` per (model, step tokens per rank) as a markdown table (KiB = 2^10 bytes)."""
    lines = ["| model | ep | experts, top-k | devices per token | " + " | ".join(
        f"{t} tok/rank: all-gather / all-to-all KiB" for t in DISPATCH_TOKENS) + " |",
             "|---|---|---|---|" + "---|" * len(DISPATCH_TOKENS)]
    for name in models:
        c = MOE_MODELS[name]
        e, k = c.get("num_experts") or c["num_local_experts"], c["num_experts_per_tok"]
        cells = [name, str(ep), f"{e}, {k}", f"{distinct_devices(e, k, ep):.2f}"]
        for t in DISPATCH_TOKENS:
            b = dispatch_bytes(t, c["hidden_size"], e, k, ep)
            cells.append(f"{b['allgather'] / 1024:,.0f} / {b['all_to_all'] / 1024:,.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fit_cells(r: dict) -> List[str]:
    """The KV tokens and batch@4k cells of a row, per device of `DEVICES` ("does not fit" and 0 without room)."""
    cells = []
    for dev in DEVICES:
        fits = r[f"{dev}_tokens"] > 0
        cells += [f"{r[f'{dev}_tokens']:,}" if fits else "does not fit", str(r[f"{dev}_batch"]) if fits else "0"]
    return cells


def format_table(rows: List[dict]) -> str:
    """`plan`'s rows as a markdown table (GiB = 2^30 bytes, MiB = 2^20 bytes)."""
    lines = [TABLE_HEADER, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r["model"], str(r["tp"]), f"{r['weight_bytes'] / GIB:.2f}", f"{r['kv_bytes_per_1k'] / MIB:.0f}"]
        lines.append("| " + " | ".join(cells + _fit_cells(r)) + " |")
    return "\n".join(lines)


def format_moe_table(rows: List[dict]) -> str:
    """`moe_plan`'s rows as a markdown table (GiB = 2^30 bytes, MiB = 2^20 bytes); a row that cannot be built
    says why in its experts/device cell and has dashes elsewhere."""
    lines = [MOE_TABLE_HEADER, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["problem"] is not None:
            cells = [r["model"], str(r["ep"]), f"— ({r['problem']})"] + ["—"] * (3 + 2 * len(DEVICES))
        else:
            cells = [r["model"], str(r["ep"]), f"{r['experts_per_device']} of {r['experts']}",
                     f"{r['weight_bytes'] / GIB:.2f}", f"{r['expert_bytes'] / GIB:.2f}",
                     f"{r['kv_bytes_per_1k'] / MIB:.0f}"] + _fit_cells(r)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _moe_section(moe_rows: List[dict]) -> str:
    """The report's mixture-of-experts part: how its rows are computed, and `format_moe_table`."""
    return f"""## Mixture-of-experts models under expert parallelism

A row at ep N is the model built at `--tp-size N --ep-size N` (experts over the tensor axis): attention,
embeddings and LM head split N ways as in the table above, each MoE layer's stacked experts `[E, in, out]` split
on E (`param_spec(name, ("tensor",))` = `sharding.EXPERTS`, as the loader places them), the router and
norms replicated. "experts/device" is E / ep per MoE layer; "of which experts" is the stacked experts' share of the
weights per device. KV heads fewer than tp are replicated (`padded_kv_heads`), so KV per device stops shrinking
once tp passes the model's KV heads. A combination the engine cannot build says why.

{format_moe_table(moe_rows)}

### Dispatch: bytes each device sends per MoE layer and step, DP attention + EP at ep {DISPATCH_EP}

With `--dp-size {DISPATCH_EP} --ep-size {DISPATCH_EP}` (tp 1) each device attends to its own rank's tokens and holds
E / {DISPATCH_EP} experts, so every MoE layer moves tokens between devices. The engine all-gathers the ranks'
activations and reduce-scatters the outputs (`layers/moe.experts_expert_parallel`); an all-to-all would send each
token only to the devices holding its experts and back (`dispatch_bytes`: uniform routing, bfloat16 activations).
The all-to-all sends d / ep of the bytes at every step size, d the devices a token's top-k experts fall on; at
small steps both are a few KiB, where a collective's latency, not its bytes, sets its time, and the all-to-all
needs one more exchange (the counts) and ragged sizes (`jax.lax.ragged_all_to_all`, which XLA:CPU does not run).

{format_dispatch_table()}
"""


def _quant_moe_part(rows: List[dict]) -> str:
    """The quantized mixture-of-experts table, when there are rows."""
    if not rows:
        return ""
    return f"""
### Mixture-of-experts models with `--quantization {QUANT_MOE_METHOD}`

The MoE table above with every projection and every stacked expert in float8_e4m3fn (one float32 scale per
expert and output channel, layers/moe.StackedExperts), the embedding table and LM head in int8 with a float32 scale
per group of 128 values (quantization/methods.table_scheme), the router and norms in bfloat16, KV in bfloat16.

{format_moe_table(rows)}
"""


def _quant_section(quant_rows: List[dict], quant_moe_rows: Sequence[dict] = ()) -> str:
    """The report's quantized part: what changes, and `format_quant_table`."""
    return f"""## Quantized weights and KV (`--quantization`, `--kv-cache-dtype`)

The same models with their linear layers quantized (docs/quantization.md): each projection's weight in one byte
(int8 or float8_e4m3fn) plus a float32 scale per output channel, the embedding table and LM head in int8 plus a
float32 scale per group of 128 values (quantization/methods.table_scheme), the norms still in bfloat16; W8A8's
weights are the weight-only method's. KV in bfloat16, or fp8 (one byte per value).

{format_quant_table(quant_rows)}
{_quant_moe_part(quant_moe_rows)}"""


def write_report(path: str, rows: List[dict], command: str, moe_rows: Sequence[dict] = (),
                 quant_rows: Sequence[dict] = (), quant_moe_rows: Sequence[dict] = ()) -> None:
    """Write the generated markdown report (command, date, assumptions, the dense table, and the MoE table when
    `moe_rows` are given) to `path` and its raw rows with the command to the .json beside it
    (`bench_utils.write_report`; notes go in the .notes.md beside them)."""
    import jax

    from sgl_jax.bench_utils import cpu_name, write_report as write_generated

    today = datetime.date.today().isoformat()
    body = f"""Computed from shapes, no device needed: each model is built abstractly (`nnx.eval_shape` over a
`jax.sharding.AbstractMesh` of shape (1, tp), so k/v projections are sized by `padded_kv_heads`), each
parameter's per-device shard taken from `distributed/sharding.py:param_spec` (dimensions on `"tensor"` split
tp ways, the rest replicated), KV bytes per token from `model_runner.kv_bytes_per_token` (K and V, all
layers, the device's KV heads). Shapes from the models' HF `config.json`; bfloat16 weights and KV cache.

Run on {cpu_name()}, jax {jax.__version__}, in under a minute (the machine does not change the numbers).

Assumptions: {MEM_FRACTION} of device memory usable for weights + KV pool (the rest for activations and XLA
workspace; the server's own default `--mem-fraction-static` is 0.8); TPU v6e = 32 GiB HBM per chip, H100 =
80 GiB. "KV tokens" is the KV pool of the whole tp group (every device holds its heads of every token);
"batch@4k" = KV tokens // {SEQ_LEN}. GiB = 2^30 bytes, MiB = 2^20 bytes.

{format_table(rows)}
"""
    if moe_rows:
        body += "\n" + _moe_section(list(moe_rows))
    if quant_rows:
        body += "\n" + _quant_section(list(quant_rows), list(quant_moe_rows))
    title = "tensor and expert parallelism" if moe_rows else "tensor parallelism"
    raw = {"date": today, "rows": rows, "mem_fraction": MEM_FRACTION, "devices_hbm_bytes": DEVICES,
           "seq_len": SEQ_LEN}
    if moe_rows:
        raw["moe_rows"] = list(moe_rows)
    if quant_rows:
        raw["quant_rows"] = list(quant_rows)
    if quant_moe_rows:
        raw["quant_moe_rows"] = list(quant_moe_rows)
    write_generated(path, f"Sharding plan: memory per device under {title} ({today})", command, body, raw)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", default=None, help="write the markdown report here")
    args = p.parse_args(argv)
    rows, moe_rows, quant_rows, quant_moe_rows = plan(), moe_plan(), quant_plan(), quant_moe_plan()
    print(format_table(rows))
    print()
    print(format_moe_table(moe_rows))
    print()
    print(format_dispatch_table())
    print()
    print(format_quant_table(quant_rows))
    print()
    print(format_moe_table(quant_moe_rows))
    if args.output:
        cmd = "python -m sgl_jax.bench_sharding " + " ".join(sys.argv[1:] if argv is None else argv)
        write_report(args.output, rows, cmd.strip(), moe_rows, quant_rows, quant_moe_rows)


if __name__ == "__main__":
    main()
