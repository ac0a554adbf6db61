"""Sharding-plan benchmark: per-device weight and KV-cache memory under tensor parallelism, from shapes alone.

``python -m sgl_jax.bench_sharding [--output reports/sharding-plan-2026-11-23.md]``

For Llama-3-8B, Qwen3-8B and Qwen3-32B (bfloat16) and tp 1, 4, 8: builds the abstract model with
``nnx.eval_shape`` over a ``jax.sharding.AbstractMesh`` of shape (1, tp) (no weights, no devices: the k/v
projections come out sized by `padded_kv_heads`, as on a real mesh), sizes each parameter's shard from its
`param_spec`, and takes the KV bytes per token from `kv_bytes_per_token`. From those: the largest KV pool
(tokens) and batch of 4k-token sequences that fit in a TPU v6e chip (32 GiB HBM) or an H100 (80 GiB) per
device, with `MEM_FRACTION` of device memory usable. Runs in seconds on any machine.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence, Tuple

GIB = 2 ** 30
MIB = 2 ** 20
MEM_FRACTION = 0.9  # share of device memory for weights + KV pool; the rest: activations, XLA workspace
DEVICES = {"v6e": 32 * GIB, "H100": 80 * GIB}  # HBM per chip: TPU v6e (Trillium) 32 GiB, H100 SXM 80 GiB
SEQ_LEN = 4096  # tokens per sequence for the "batch@4k" column
TP_SIZES = (1, 4, 8)
TABLE_HEADER = ("| model | tp | weights GiB/device | KV MiB per 1k tokens/device | v6e KV tokens | v6e batch@4k "
                "| H100 KV tokens | H100 batch@4k |")

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


def make_model_config(name: str, dtype: str = "bfloat16"):
    """A `ModelConfig` for ``MODELS[name]`` with a plain-namespace ``hf_config`` (no transformers, no files).

    Args:
        name: a key of `MODELS`.
        dtype: "bfloat16" or "float32" (parameter and KV-cache dtype).
    """
    from sgl_jax.srt.configs.model_config import ModelConfig, ResolvedModel

    c = MODELS[name]
    return ModelConfig(
        resolved=ResolvedModel(model_path=f"{name} (shapes only)", hf_dir="", gguf_file=None),
        hf_config=SimpleNamespace(**c), architecture=c["architectures"][0], dtype=dtype,
        context_len=c["max_position_embeddings"], vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"], head_dim=c["head_dim"], eos_token_ids=[],
        rope_parameters=dict(c["rope_parameters"]))


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
    abstract = nnx.eval_shape(lambda: cls(model_config, dtype=dtype, rngs=nnx.Rngs(0), mesh=mesh))
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        v = var.get_value()
        out[".".join(str(p) for p in path)] = (tuple(v.shape), v.dtype.itemsize)
    return out


def weight_bytes_per_device(model_config, tp: int, shapes: Optional[dict] = None) -> int:
    """Bytes of parameters on each of the `tp` devices: every dimension that `param_spec` puts on ``"tensor"``
    is split `tp` ways (rounded up, as GSPMD pads), every other one is held whole (replicated). `shapes`:
    `param_shapes(model_config, tp)` if already computed."""
    from sgl_jax.srt.distributed.sharding import param_spec

    total = 0
    for name, (shape, itemsize) in (shapes or param_shapes(model_config, tp)).items():
        spec = tuple(param_spec(name)) + (None,) * len(shape)
        total += itemsize * math.prod(-(-d // tp) if ax == "tensor" else d for d, ax in zip(shape, spec))
    return total


def kv_pool_tokens(hbm_bytes: int, weight_bytes: int, kv_bytes_per_token: int,
                   fraction: float = MEM_FRACTION) -> int:
    """Tokens of KV cache one device can hold (and so the whole tp group: each device keeps its heads of every
    token) after its weights, in ``fraction * hbm_bytes``; 0 when the weights alone do not fit."""
    return max(0, int(fraction * hbm_bytes) - weight_bytes) // kv_bytes_per_token


def plan(models: Sequence[str] = tuple(MODELS), tp_sizes: Sequence[int] = TP_SIZES) -> List[dict]:
    """One row per (model, tp): ``weight_bytes`` (per device, bytes), ``kv_bytes_per_1k`` (per device, bytes
    per 1024 tokens), and for each device of `DEVICES` ``<dev>_tokens`` (KV pool, tokens) and ``<dev>_batch``
    (sequences of `SEQ_LEN` tokens)."""
    from sgl_jax.srt.distributed.sharding import check_tp, padded_kv_heads
    from sgl_jax.srt.model_executor.model_runner import kv_bytes_per_token

    rows = []
    for name in models:
        mc = make_model_config(name)
        shapes = {}  # the mesh changes the model's shapes only through padded_kv_heads: build once per value
        for tp in tp_sizes:
            check_tp(mc.num_attention_heads, mc.num_key_value_heads, mc.vocab_size,
                     int(mc.hf_config.intermediate_size), tp)
            key = padded_kv_heads(mc.num_key_value_heads, tp)
            if key not in shapes:
                shapes[key] = param_shapes(mc, tp)
            w, kv = weight_bytes_per_device(mc, tp, shapes[key]), kv_bytes_per_token(mc, tp)
            row = {"model": name, "tp": tp, "weight_bytes": w, "kv_bytes_per_1k": kv * 1024}
            for dev, hbm in DEVICES.items():
                row[f"{dev}_tokens"] = kv_pool_tokens(hbm, w, kv)
                row[f"{dev}_batch"] = row[f"{dev}_tokens"] // SEQ_LEN
            rows.append(row)
    return rows


def format_table(rows: List[dict]) -> str:
    """`plan`'s rows as a markdown table (GiB = 2^30 bytes, MiB = 2^20 bytes)."""
    lines = [TABLE_HEADER, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r["model"], str(r["tp"]), f"{r['weight_bytes'] / GIB:.2f}", f"{r['kv_bytes_per_1k'] / MIB:.0f}"]
        for dev in DEVICES:
            fits = r[f"{dev}_tokens"] > 0
            cells += [f"{r[f'{dev}_tokens']:,}" if fits else "does not fit", str(r[f"{dev}_batch"]) if fits else "0"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_report(path: str, rows: List[dict], command: str) -> None:
    """Write the generated markdown report (command, date, assumptions, table) to `path` and its raw rows with the
    command to the .json beside it (`bench_utils.write_report`; notes go in the .notes.md beside them)."""
    import jax

    from sgl_jax.bench_utils import cpu_name, write_report as write_generated

    today = datetime.date.today().isoformat()
    body = f"""Computed from shapes, no device needed: each model is built abstractly (`nnx.eval_shape` over a
`jax.sharding.AbstractMesh` of shape (1, tp), so k/v projections are sized by `padded_kv_heads`), each
parameter's per-device shard taken from `distributed/sharding.py:param_spec` (dimensions on `"tensor"` split
tp ways, the rest replicated), KV bytes per token from `model_runner.kv_bytes_per_token` (K and V, all
layers, the device's KV heads). Shapes from the models' HF `config.json`; bfloat16 weights and KV cache.

Run on {cpu_name()}, jax {jax.__version__}, in seconds (the machine does not change the numbers).

Assumptions: {MEM_FRACTION} of device memory usable for weights + KV pool (the rest for activations and XLA
workspace; the server's own default `--mem-fraction-static` is 0.8); TPU v6e = 32 GiB HBM per chip, H100 =
80 GiB. "KV tokens" is the KV pool of the whole tp group (every device holds its heads of every token);
"batch@4k" = KV tokens // {SEQ_LEN}. GiB = 2^30 bytes, MiB = 2^20 bytes.

{format_table(rows)}
"""
    write_generated(path, f"Sharding plan: memory per device under tensor parallelism ({today})", command, body,
                    {"date": today, "rows": rows, "mem_fraction": MEM_FRACTION, "devices_hbm_bytes": DEVICES,
                     "seq_len": SEQ_LEN})


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", default=None, help="write the markdown report here")
    args = p.parse_args(argv)
    rows = plan()
    print(format_table(rows))
    if args.output:
        cmd = "python -m sgl_jax.bench_sharding " + " ".join(sys.argv[1:] if argv is None else argv)
        write_report(args.output, rows, cmd.strip())


if __name__ == "__main__":
    main()
