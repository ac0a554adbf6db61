"""Tile sizes of the flash-decoding Pallas GPU kernel (`gpu_decode`) against XLA's attention, one layer per call.

For each model (attention heads), decode shape and page size it times XLA's attention (the native backend: `ref`
compiled by XLA) and the kernel at every (block_kv, split_tokens) pair asked for, and prints the time per call, the
KV read rate next to the memory read rate measured in the same run, the speedup over XLA and the largest difference
from XLA's output. The table in `gpu_decode.GPU_DECODE_TABLE` comes from this report.

    python benchmark/kernels/tune_flash_decode.py                      # on a GPU
    python benchmark/kernels/tune_flash_decode.py --shapes 4:1:300 --block-kv 16 --split-tokens 64 --iters 1 \
        --output /tmp/tune.md                                          # a smoke run on CPU (the interpreter)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import shlex
import sys
from typing import List, Optional

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ragged_paged_attention import MODELS, Shape, machine, make_inputs, time_per_call, work  # noqa: E402

from sgl_jax.bench_utils import measure_machine_rates, write_report  # noqa: E402
from sgl_jax.srt.kernels.ragged_paged_attention import ragged_paged_attention  # noqa: E402
from sgl_jax.srt.kernels.ragged_paged_attention.flash_decode import (  # noqa: E402
    DecodeBlocks, num_splits,
)
from sgl_jax.srt.kernels.ragged_paged_attention.gpu_decode import decode_attention_gpu  # noqa: E402


@dataclasses.dataclass
class Row:
    model: str
    num_seqs: int
    kv_len: int
    page_size: int
    impl: str  # "xla" or "kernel"
    block_kv: Optional[int]
    split_tokens: Optional[int]
    programs: Optional[int]
    ms: float
    gbs: float
    speedup_vs_xla: float
    max_abs_diff_vs_xla: float


def run(models, shapes, page_sizes, block_kvs, splits, dtype, iters, interpret) -> List[Row]:
    rows: List[Row] = []
    jobs = [(m, s, ps) for m in models for s in shapes for ps in page_sizes]
    per_job = 1 + sum(1 for b in block_kvs for t in splits if t % b == 0)
    with tqdm(total=len(jobs) * per_job, desc="flash decode tiles", unit="case") as bar:
        for m, s, ps in jobs:
            args, kwargs = make_inputs(m, s, ps, dtype)
            _, nbytes = work(m, s, jnp.dtype(dtype).itemsize)
            xla = jax.jit(lambda *a: ragged_paged_attention(*a, **kwargs, backend="native"))
            ref = np.asarray(xla(*args).astype(jnp.float32))
            base = time_per_call(xla, args, iters)
            rows.append(Row(m, s.num_seqs, s.kv_len, ps, "xla", None, None, None, 1e3 * base, nbytes / base / 1e9,
                            1.0, 0.0))
            bar.update()
            q, kp, vp, kl, pi, _, n = args
            for bkv in block_kvs:
                for st in splits:
                    if st % bkv:
                        continue
                    bar.set_postfix_str(f"{m} {s.num_seqs}x{s.kv_len} page {ps} block_kv {bkv} split {st}")
                    fn = jax.jit(lambda *a, b=DecodeBlocks(bkv, st): decode_attention_gpu(
                        *a, sm_scale=kwargs["sm_scale"], blocks=b, interpret=interpret))
                    kargs = (q, kp, vp, kl, pi, n)
                    out = np.asarray(fn(*kargs).astype(jnp.float32))
                    t = time_per_call(fn, kargs, iters)
                    programs = s.num_seqs * MODELS[m][1] * num_splits(pi.shape[1], ps, st)
                    rows.append(Row(m, s.num_seqs, s.kv_len, ps, "kernel", bkv, st, programs, 1e3 * t,
                                    nbytes / t / 1e9, base / t, float(np.abs(out - ref).max())))
                    bar.update()
    return rows


def table(rows: List[Row], memory_gbps: float) -> List[str]:
    lines = ["| model | seqs x context | page | impl | block_kv | split_tokens | programs | ms/call | GB/s | "
             "% measured GB/s | speedup vs XLA | max diff vs XLA |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.model} | {r.num_seqs} x {r.kv_len} | {r.page_size} | {r.impl} | {r.block_kv or ''} | "
                     f"{r.split_tokens or ''} | {r.programs or ''} | {r.ms:.3f} | {r.gbs:.1f} | "
                     f"{100 * r.gbs / memory_gbps:.1f} | {r.speedup_vs_xla:.2f} | {r.max_abs_diff_vs_xla:.2e} |")
    return lines


def main(argv: Optional[List[str]] = None) -> List[Row]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["Qwen3-0.6B"], choices=list(MODELS))
    p.add_argument("--shapes", nargs="+", type=Shape.parse, default=None,
                   help="S:1:KV decode shapes (default 64:1:2048 and 8:1:8192, the issue's)")
    p.add_argument("--page-size", type=int, nargs="+", default=[16])
    p.add_argument("--block-kv", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--split-tokens", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--iters", type=int, default=50, help="calls per timed round (3 rounds, median reported)")
    p.add_argument("--output", default=None, help="markdown report (default reports/flash-decode-tiles-<platform>-"
                                                  "<date>.md); a .json with the raw numbers beside it")
    args = p.parse_args(argv)
    device = jax.devices()[0]
    shapes = args.shapes or [Shape.parse("64:1:2048"), Shape.parse("8:1:8192")]
    if any(not s.decode for s in shapes):
        p.error("--shapes: decode shapes only (S:1:KV)")
    dtype = jnp.dtype(args.dtype)
    rates = measure_machine_rates(dtype.name)
    rows = run(args.models, shapes, args.page_size, args.block_kv, args.split_tokens, dtype, args.iters,
               interpret=device.platform == "cpu")
    date = datetime.date.today().isoformat()
    output = args.output or f"reports/flash-decode-tiles-{device.platform}-{date}.md"
    cli = sys.argv[1:] if argv is None else argv
    command = " ".join(["python benchmark/kernels/tune_flash_decode.py", shlex.join(cli)]).strip()
    body = "\n".join([
        f"Device: {machine(device)}. {dtype.name}; per call: the median of 3 rounds of {args.iters} back-to-back "
        f"calls, after one warm-up call. GB/s: K and V of every token read once plus the queries and the output, "
        f"per second.", "", f"Peaks: {rates.describe()}.", "", *table(rows, rates.memory_gbps)])
    write_report(output, f"Flash-decoding kernel tiles against XLA's attention ({date})", command, body,
                 {"machine": machine(device), "date": date, "rates": rates.to_json(),
                  "rows": [dataclasses.asdict(r) for r in rows]})
    print(body)
    print(f"wrote {output} (+ .json)")
    return rows


if __name__ == "__main__":
    main()
