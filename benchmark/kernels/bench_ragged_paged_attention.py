"""Benchmark of one ragged paged attention call (one layer) on decode and prefill shapes of real models.

For each model (attention heads of SmolLM2-135M, Qwen3-0.6B and Llama-3-8B), batch shape, page size and backend
(native: what the server runs, which on CPU is the C++ decode kernel for decode batches and pure JAX otherwise;
jax: the pure-JAX path everywhere, `ref`; pallas: the Pallas kernel) it prints the time per call and the achieved
FLOP/s and KV bytes/s next to the device's peak, and writes a markdown report with the command that produced it.

FLOPs count the attention matmuls only, causal pairs only: 4 * H * D per (query, visible key) pair
(QK^T and PV, 2 FLOPs per multiply-add). Bytes count K and V of every visible KV token read once, plus the
queries and the output. Peaks: the machine's matmul and memory read rates measured in the same run
(`bench_utils.measure_machine_rates`, the matmul in the benchmark's dtype); on TPU/GPU the datasheet's figures are
printed beside them, never used. The .md and its .json (the command, the measured rates, every result) are
generated together (`bench_utils.write_report`); notes go in the .notes.md beside them.

    python benchmark/kernels/bench_ragged_paged_attention.py                 # every shape, this device
    python benchmark/kernels/bench_ragged_paged_attention.py --scale 0.125 --backends native pallas
    python benchmark/kernels/bench_ragged_paged_attention.py --models SmolLM2-135M --shapes 64:1:1500 1:1:1500 \
        --page-size 1 16 64                                                 # the CPU decode kernel vs pure JAX
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import shlex
import sys
from typing import Dict, List, Optional

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from sgl_jax.bench_utils import MachineRates, cpu_name, measure_machine_rates, timed, write_report
from sgl_jax.srt.kernels.ragged_paged_attention import ragged_paged_attention, ref

MODELS = {  # num_heads, num_kv_heads, head_dim (from the models' config.json)
    "SmolLM2-135M": (9, 3, 64),
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

    @classmethod
    def parse(cls, text: str) -> "Shape":
        """'S:Q:KV' (sequences, new tokens each, context each): a decode shape when Q is 1, else extend."""
        s, q, kv = (int(x) for x in text.split(":"))
        return cls("decode" if q == 1 else ("prefill" if q == kv else "extend"), s, q, kv)

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
    page_size: int = 16
    max_abs_diff_vs_first_backend: Optional[float] = None


def bench_one(model, shape, backend, page_size, dtype, iters) -> tuple:
    args, kwargs = make_inputs(model, shape, page_size, dtype)
    if backend == "jax":
        fn = jax.jit(lambda *a: ref.ragged_paged_attention(*a, **kwargs))
    else:
        fn = jax.jit(lambda *a: ragged_paged_attention(*a, **kwargs, backend=backend))
    out = fn(*args).block_until_ready()
    ms = 1e3 * time_per_call(fn, args, iters)
    flops, nbytes = work(model, shape, jnp.dtype(dtype).itemsize)
    res = Result(model, shape.name, shape.num_seqs, shape.q_len, shape.kv_len, backend, jnp.dtype(dtype).name, ms,
                 flops / ms / 1e6, nbytes / ms / 1e6, page_size)
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


def run(models: List[str], shapes: List[Shape], backends: List[str], page_sizes: List[int], dtype,
        iters: int) -> List[Result]:
    results = []
    jobs = [(m, s, ps, b) for m in models for s in shapes for ps in page_sizes for b in backends]
    outs: Dict[tuple, np.ndarray] = {}
    with tqdm(total=len(jobs), desc="ragged paged attention", unit="case") as bar:
        for m, s, page_size, b in jobs:
            bar.set_postfix_str(f"{m} {s.name} S={s.num_seqs} q={s.q_len} kv={s.kv_len} page {page_size} {b}")
            res, out = bench_one(m, s, b, page_size, dtype, iters)
            key = (m, s, page_size)  # the same inputs: one model, shape and page size
            if key in outs:
                res.max_abs_diff_vs_first_backend = float(np.abs(out - outs[key]).max())
            else:
                outs[key] = out
            results.append(res)
            bar.update()
    return results


def table(results: List[Result], rates: MachineRates) -> List[str]:
    """Markdown rows of `results`, each rate also as a percentage of the measured machine rate."""
    peak_gflops, peak_gbs = rates.matmul_gflops, rates.memory_gbps
    lines = ["| model | shape | seqs x (new / context) | page | backend | dtype | ms/call | GFLOP/s | % peak FLOP/s "
             "| GB/s | % peak GB/s | max diff vs first backend |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        diff = "" if r.max_abs_diff_vs_first_backend is None else f"{r.max_abs_diff_vs_first_backend:.2e}"
        lines.append(f"| {r.model} | {r.shape} | {r.num_seqs} x ({r.q_len} / {r.kv_len}) | {r.page_size} | "
                     f"{r.backend} | {r.dtype} | "
                     f"{r.ms:.2f} | {r.gflops:.1f} | {100 * r.gflops / peak_gflops:.1f} | {r.gbs:.1f} | "
                     f"{100 * r.gbs / peak_gbs:.1f} | {diff} |")
    return lines


def machine(device) -> str:
    name = cpu_name() if device.platform == "cpu" else f"{device.device_kind} ({device.platform})"
    return f"{name}; jax {jax.__version__}"


def main(argv: Optional[List[str]] = None) -> List[Result]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["Qwen3-0.6B", "Llama-3-8B"], choices=list(MODELS))
    p.add_argument("--shapes", nargs="+", type=Shape.parse, default=None,
                   help="S:Q:KV batch shapes (default: decode 64:1:2048 and 8:1:8192, prefill 1:2048:2048, "
                        "extend 4:512:1536)")
    p.add_argument("--backends", nargs="+", default=None, choices=["native", "jax", "pallas"],
                   help="default: native and pallas on TPU/GPU, native and jax on CPU (pallas there is the "
                        "interpreter)")
    p.add_argument("--page-size", type=int, nargs="+", default=[16])
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
    backends = args.backends or (["native", "jax"] if on_cpu else ["native", "pallas"])
    dtype = jnp.dtype(args.dtype or ("float32" if on_cpu else "bfloat16"))
    shapes = [s.scaled(args.scale) for s in (args.shapes or SHAPES)]
    args.iters = args.iters or (5 if on_cpu else 50)
    rates = measure_machine_rates(dtype.name)
    results = run(args.models, shapes, backends, args.page_size, dtype, args.iters)
    date = datetime.date.today().isoformat()
    output = args.output or f"reports/ragged-paged-attention-{device.platform}-{date}.md"
    cli = sys.argv[1:] if argv is None else argv
    command = " ".join(["python benchmark/kernels/bench_ragged_paged_attention.py", shlex.join(cli)]).strip()
    body = "\n".join([
        f"Device: {machine(device)}. Page sizes {args.page_size}, {dtype.name}; per call: the median of 3 rounds of "
        f"{args.iters} back-to-back calls, after one warm-up call.", "",
        f"Peaks: {rates.describe()}.", "", *table(results, rates)])
    write_report(output, f"Ragged paged attention, one layer per call ({date})", command, body,
                 {"machine": machine(device), "date": date, "rates": rates.to_json(),
                  "results": [dataclasses.asdict(r) for r in results]})
    print(body)
    print(f"wrote {output} (+ .json)")
    return results


if __name__ == "__main__":
    main()
