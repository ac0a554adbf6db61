"""Benchmark of one ragged paged attention call (one layer) on decode and prefill shapes of real models.

For each model (attention heads of Qwen3-0.6B and Llama-3-8B), batch shape and backend (native pure JAX,
Pallas kernel) it prints the time per call and the achieved FLOP/s and KV bytes/s next to the device's peak,
and writes a markdown report with the command that produced it.

FLOPs count the attention matmuls only, causal pairs only: 4 * H * D per (query, visible key) pair
(QK^T and PV, 2 FLOPs per multiply-add). Bytes count K and V of every visible KV token read once, plus the
queries and the output. Peaks: on TPU/GPU from the vendor's datasheet (dense bf16 matmul, HBM bandwidth);
on CPU measured in the same run (XLA float32 matmul 2048^3, and the bandwidth of summing a 1 GiB array).

    python benchmark/kernels/bench_ragged_paged_attention.py                 # every shape, this device
    python benchmark/kernels/bench_ragged_paged_attention.py --scale 0.125 --backends native pallas
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import sys
from typing import Dict, List, Optional

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from sgl_jax.bench_utils import accelerator_matmul_gflops, cpu_name, datasheet_peaks, timed, xla_matmul_gflops
from sgl_jax.srt.kernels.ragged_paged_attention import ragged_paged_attention

MODELS = {  # num_heads, num_kv_heads, head_dim (from the models' config.json)
    "Qwen3-0.6B": (16, 8, 128),
    "Llama-3-8B": (32, 8, 128),
}


@dataclasses.dataclass(frozen=True)
class Shape:
    """A batch: ``num_seqs`` sequences of ``q_len`` new tokens over ``kv_len`` tokens of context (this
    step's included)."""

    name: str
    num_seqs: int
    q_len: int
    kv_len: int

    @property
    def decode(self) -> bool:
        return self.q_len == 1

    def scaled(self, scale: float) -> "Shape":
        kv = max(int(self.kv_len * scale), 1)
        q = 1 if self.decode else max(min(int(self.q_len * scale), kv), 1)
        return Shape(self.name, self.num_seqs, q, kv)


SHAPES = [
    Shape("decode", 64, 1, 2048),
    Shape("decode", 8, 1, 8192),
    Shape("prefill", 1, 2048, 2048),
    Shape("extend", 4, 512, 1536),  # 1,024 cached tokens per sequence, 512 new
]

def measured_cpu_peaks() -> tuple:
    """(XLA float32 matmul GFLOP/s at 2048^3, GB/s summing a 1 GiB float32 array), best of 5 each."""
    x = jnp.ones((2**28,), jnp.float32)
    s = jax.jit(jnp.sum)
    s(x).block_until_ready()
    tb = min(timed(lambda: s(x).block_until_ready())[1] for _ in range(5))
    return xla_matmul_gflops(), x.nbytes / tb / 1e9


def measured_accelerator_peaks() -> tuple:
    """(XLA bfloat16 matmul GFLOP/s at 8192^3, GB/s of a 1 GiB bfloat16 array copied with +1: bytes read plus
    bytes written), best of 10 each, on the default device."""
    x = jax.random.normal(jax.random.PRNGKey(0), (2**29,), jnp.bfloat16)
    f = jax.jit(lambda a: a + 1)
    f(x).block_until_ready()
    tb = min(timed(lambda: f(x).block_until_ready())[1] for _ in range(10))
    return accelerator_matmul_gflops(), 2 * x.nbytes / tb / 1e9


def device_peaks(device) -> tuple:
    """(peak GFLOP/s, peak GB/s, where the numbers come from): measured in this run (on TPU/GPU the
    datasheet's figures are named beside them)."""
    if device.platform == "cpu":
        flops, bw = measured_cpu_peaks()
        return flops, bw, "measured in this run (XLA f32 matmul 2048^3; sum of 1 GiB)"
    flops, bw = measured_accelerator_peaks()
    src = "measured in this run (XLA bf16 matmul 8192^3; copy of 1 GiB, read + write)"
    sheet = datasheet_peaks(device.device_kind)
    if sheet is not None:
        src += f"; {sheet[0]} datasheet: {sheet[1]:.0f} TFLOP/s dense bf16, {sheet[2]:.0f} GB/s HBM"
    return flops, bw, src


def make_inputs(model: str, shape: Shape, page_size: int, dtype, seed: int = 0):
    """Random q and a paged cache holding exactly the batch's KV (pages shuffled); returns (args, kwargs)."""
    H, KVH, D = MODELS[model]
    rng = np.random.default_rng(seed)
    S = shape.num_seqs
    pages_per_seq = -(-shape.kv_len // page_size)
    num_pages = 1 + S * pages_per_seq
    key = jax.random.PRNGKey(seed)
    kk, kv_, kq = jax.random.split(key, 3)
    k_pages = jax.random.normal(kk, (num_pages, page_size, KVH, D), dtype)
    v_pages = jax.random.normal(kv_, (num_pages, page_size, KVH, D), dtype)
    page_indices = (1 + rng.permutation(S * pages_per_seq)).reshape(S, pages_per_seq).astype(np.int32)
    T = S * shape.q_len
    q = jax.random.normal(kq, (T, H, D), dtype)
    cu = np.arange(S + 1, dtype=np.int32) * shape.q_len
    kv_lens = np.full(S, shape.kv_len, np.int32)
    args = (q, k_pages, v_pages, jnp.asarray(kv_lens), jnp.asarray(page_indices), jnp.asarray(cu),
            jnp.asarray(S, jnp.int32))
    return args, dict(sm_scale=D ** -0.5, decode_only=shape.decode)


def work(model: str, shape: Shape, itemsize: int) -> tuple:
    """(FLOPs, bytes) of one call: causal (query, key) pairs x 4 H D; K/V read once, q and out."""
    H, KVH, D = MODELS[model]
    first = shape.kv_len - shape.q_len  # position of the first new token
    pairs_per_seq = sum(first + i + 1 for i in range(shape.q_len))
    flops = 4 * H * D * pairs_per_seq * shape.num_seqs
    kv_bytes = 2 * shape.kv_len * KVH * D * itemsize * shape.num_seqs
    q_out_bytes = 2 * shape.num_seqs * shape.q_len * H * D * itemsize
    return flops, kv_bytes + q_out_bytes


@dataclasses.dataclass
class Result:
    model: str
    shape: str
    num_seqs: int
    q_len: int
    kv_len: int
    backend: str
    dtype: str
    ms: float
    gflops: float
    gbs: float
    max_abs_diff_vs_first_backend: Optional[float] = None


def bench_one(model, shape, backend, page_size, dtype, iters) -> tuple:
    args, kwargs = make_inputs(model, shape, page_size, dtype)
    fn = jax.jit(lambda *a: ragged_paged_attention(*a, **kwargs, backend=backend))
    out = fn(*args).block_until_ready()
    ms = 1e3 * time_per_call(fn, args, iters)
    flops, nbytes = work(model, shape, jnp.dtype(dtype).itemsize)
    res = Result(model, shape.name, shape.num_seqs, shape.q_len, shape.kv_len, backend, jnp.dtype(dtype).name, ms,
                 flops / ms / 1e6, nbytes / ms / 1e6)
    return res, np.asarray(out.astype(jnp.float32))


def time_per_call(fn, args, iters: int, rounds: int = 3) -> float:
    """Seconds per call: `iters` calls dispatched back to back and waited for once (so an accelerator's launch
    latency overlaps the previous call, as in a model's layer loop), the median over `rounds` rounds."""
    def one_round():
        out = None
        for _ in range(iters):
            out = fn(*args)
        out.block_until_ready()

    return float(np.median([timed(one_round)[1] / iters for _ in range(rounds)]))


def run(models: List[str], shapes: List[Shape], backends: List[str], page_size: int, dtype, iters: int) -> List[Result]:
    results = []
    jobs = [(m, s, b) for m in models for s in shapes for b in backends]
    outs: Dict[tuple, np.ndarray] = {}
    with tqdm(total=len(jobs), desc="ragged paged attention", unit="case") as bar:
        for m, s, b in jobs:
            bar.set_postfix_str(f"{m} {s.name} S={s.num_seqs} q={s.q_len} kv={s.kv_len} {b}")
            res, out = bench_one(m, s, b, page_size, dtype, iters)
            key = (m, s)
            if key in outs:
                res.max_abs_diff_vs_first_backend = float(np.abs(out - outs[key]).max())
            else:
                outs[key] = out
            results.append(res)
            bar.update()
    return results


def table(results: List[Result], peak_gflops: float, peak_gbs: float) -> List[str]:
    lines = ["| model | shape | seqs x (new / context) | backend | dtype | ms/call | GFLOP/s | % peak FLOP/s | GB/s "
             "| % peak GB/s | max diff vs first backend |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        diff = "" if r.max_abs_diff_vs_first_backend is None else f"{r.max_abs_diff_vs_first_backend:.2e}"
        lines.append(f"| {r.model} | {r.shape} | {r.num_seqs} x ({r.q_len} / {r.kv_len}) | {r.backend} | {r.dtype} | "
                     f"{r.ms:.2f} | {r.gflops:.1f} | {100 * r.gflops / peak_gflops:.1f} | {r.gbs:.1f} | "
                     f"{100 * r.gbs / peak_gbs:.1f} | {diff} |")
    return lines


def machine(device) -> str:
    name = cpu_name() if device.platform == "cpu" else f"{device.device_kind} ({device.platform})"
    return f"{name}; jax {jax.__version__}"


def main(argv: Optional[List[str]] = None) -> List[Result]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--backends", nargs="+", default=None, choices=["native", "pallas"],
                   help="default: native and pallas on TPU/GPU, native on CPU (pallas there is the interpreter)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="default: bfloat16 on TPU/GPU, float32 on CPU")
    p.add_argument("--scale", type=float, default=1.0, help="multiply context and new-token lengths (smoke runs)")
    p.add_argument("--iters", type=int, default=None,
                   help="calls per timed round (3 rounds, median reported); default 5 on CPU, 50 on TPU/GPU")
    p.add_argument("--output", default=None, help="markdown report path (default: reports/ragged-paged-attention-"
                                                  "<platform>-<date>.md); a .json with the raw numbers beside it")
    args = p.parse_args(argv)
    device = jax.devices()[0]
    on_cpu = device.platform == "cpu"
    backends = args.backends or (["native"] if on_cpu else ["native", "pallas"])
    dtype = jnp.dtype(args.dtype or ("float32" if on_cpu else "bfloat16"))
    shapes = [s.scaled(args.scale) for s in SHAPES]
    args.iters = args.iters or (5 if on_cpu else 50)
    peak_gflops, peak_gbs, peak_src = device_peaks(device)
    results = run(args.models, shapes, backends, args.page_size, dtype, args.iters)
    date = datetime.date.today().isoformat()
    output = args.output or f"reports/ragged-paged-attention-{device.platform}-{date}.md"
    cli = sys.argv[1:] if argv is None else argv
    command = " ".join(["python benchmark/kernels/bench_ragged_paged_attention.py", shlex.join(cli)]).strip()
    lines = [f"# Ragged paged attention, one layer per call ({date})", "",
             f"Device: {machine(device)}. Page size {args.page_size}, {dtype.name}; per call: the median of 3 "
             f"rounds of {args.iters} back-to-back calls, after one warm-up call.", "",
             f"Peaks: {peak_gflops:.1f} GFLOP/s, {peak_gbs:.1f} GB/s ({peak_src}).", "",
             "```bash", command, "```", "", *table(results, peak_gflops, peak_gbs), ""]
    print("\n".join(lines))
    os.makedirs(os.path.dirname(output) or ".", exist_ok=True)
    with open(output, "w") as f:
        f.write("\n".join(lines))
    with open(os.path.splitext(output)[0] + ".json", "w") as f:
        json.dump({"command": command, "machine": machine(device), "peak_gflops": peak_gflops, "peak_gbs": peak_gbs,
                   "peak_source": peak_src, "results": [dataclasses.asdict(r) for r in results]}, f, indent=1)
    print(f"wrote {output}")
    return results


if __name__ == "__main__":
    main()
