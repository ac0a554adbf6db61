"""Extend token buckets: what each costs at start-up and per step, and what fewer buckets would cost serving.

Every extend token bucket T (``--precompile-token-paddings``) is one program compiled at start-up (and loaded back
from the compilation cache on a restart). An extend batch of n tokens runs the smallest bucket >= n, so fewer
buckets mean fewer programs but more padding: the matmuls run on T tokens, attention only on the real ones
(ragged). This benchmark measures, for each bucket (--precompile-token-paddings; without it every power of two
from 64 to the default buckets' largest), one at a time on this machine::

    JAX_PLATFORMS=cpu python -m sgl_jax.bench_buckets --report reports/buckets-cpu-2026-12-05.md

- ``trace s``: tracing and lowering its forward program (Python, one thread);
- ``XLA s``: compiling it with an empty compilation cache (a fresh directory per run);
- ``load s``: loading it back from that cache after JAX's in-memory caches are cleared (a restart's cost; the
  run fails if a bucket is not read back from the cache);
- ``HLO instr``, ``attention %``, ``YNN fusions``: what a load rebuilds (`program_composition`). XLA's CPU
  executable in the cache holds the whole optimized HLO module beside its machine code, and loading it rebuilds
  the module and one thunk per kernel; the YNN (YNNPACK) fusion thunks' loader finds each one's instruction by
  scanning the module, so the load grows with instructions x YNN fusions, not with T
  (reports/buckets-cpu-2026-12-06.notes.md). On CPU the extend attention is the C++ kernel's one custom call per
  layer (``attention %`` about 2); ``SGL_JAX_CPU_EXTEND_KERNEL=0`` measures the pure-JAX loops it replaced
  (68%, reports/extend-kernel-cpu-2026-12-06.notes.md);
- ``step ms``: the device time of one all-padding step of the bucket (forward and sampling;
  `device_timing.device_seconds_per_step`, the median of ``--repeats`` blocks): the padded part of an extend step,
  which is what the bucket choice changes (the real tokens' attention is the same in every choice).

Then, for candidate sets of buckets (each ending with the largest, which the chunk needs), the start-up cost
(programs, trace + XLA seconds, load seconds: sums over the set's buckets; warm-up runs them on as many threads as
there are cores) beside the step cost of serving: for each extend batch size n the set's step time over the
full set's padded one, averaged over n uniform in 1..max and over n log-uniform (more short extends: chat turns,
scoring items), and its worst case; both padded (one step of the smallest bucket >= n) and cut (the scheduler's
`ShapeBuckets.extend_cut`: a smaller bucket's worth of tokens now, the rest next step, where that computes
fewer tokens). Every ServerArgs flag works (``--model-path``, ``--dtype``, ``--chunked-prefill-size``
...); the default model and flags are the start-up issue's (#70) case. ``--report NAME.md`` writes NAME.md and
NAME.json (`bench_utils.write_report`); notes go in NAME.notes.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

import jax
from tqdm import tqdm

from sgl_jax.bench_utils import cpu_name, git_commit, write_report
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.forward_batch import ForwardMode
from sgl_jax.srt.mem_cache.kv_memory import kv_spec_for
from sgl_jax.srt.model_executor.buckets import ShapeBuckets, derive_limits, powers_of_two
from sgl_jax.srt.model_executor.compile_stats import compile_counts
from sgl_jax.srt.model_executor.device_timing import device_seconds_per_step
from sgl_jax.srt.model_executor.memory_budget import compute_max_total_tokens
from sgl_jax.srt.model_executor.model_runner import ModelRunner, setup_jax
from sgl_jax.srt.model_executor.warmup import as_lowered
from sgl_jax.srt.server_args import ServerArgs
from sgl_jax.srt.utils import configure_logging

COLUMNS = ["T", "trace s", "XLA s", "load s", "HLO instr", "attention %", "YNN fusions", "step ms"]
_INSTRUCTION_LINE = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+ = .*$", re.MULTILINE)
_OP_NAME = re.compile(r'op_name="([^"]*)"')
SET_COLUMNS = ["buckets", "programs", "trace + XLA s", "load s", "padded: uniform / log-uniform", "padded: worst",
               "cut: uniform / log-uniform", "cut: worst"]


def candidate_sets(tokens: Sequence[int]) -> List[Tuple[int, ...]]:
    """Candidate bucket sets drawn from `tokens` (sorted powers of two): all of them, every other one (powers of
    four from the smallest), every third, the smallest with the largest, and the largest alone; each ends with the
    largest bucket. Duplicates are dropped, order kept."""
    largest = tokens[-1]
    picks = [tuple(tokens), tuple(tokens[::2]), tuple(tokens[::3]), (tokens[0],), ()]
    out: List[Tuple[int, ...]] = []
    for p in picks:
        s = tuple(sorted(set(p) | {largest}))
        if s not in out:
            out.append(s)
    return out


def padded_ms(buckets: Sequence[int], step_ms: Dict[int, float]) -> List[float]:
    """[n] -> ms of an extend batch of n tokens (index 0 unused) run as one step of the smallest bucket >= n (the
    scheduler before `ShapeBuckets.extend_cut`)."""
    shapes = ShapeBuckets(tuple(buckets), (1,))
    return [0.0] + [step_ms[shapes.extend_shape(n, 1)[0]] for n in range(1, buckets[-1] + 1)]


def cut_ms(buckets: Sequence[int], step_ms: Dict[int, float]) -> List[float]:
    """[n] -> ms of an extend batch of n tokens run as the scheduler runs it: cut at a smaller bucket while
    `ShapeBuckets.extend_cut` says so, the rest in one padded step."""
    shapes = ShapeBuckets(tuple(buckets), (1,))
    out = [0.0]
    for n in range(1, buckets[-1] + 1):
        ms, left = 0.0, n
        while (cut := shapes.extend_cut(left)) is not None:
            ms, left = ms + step_ms[shapes.extend_shape(cut, 1)[0]], left - cut
        out.append(ms + step_ms[shapes.extend_shape(left, 1)[0]])
    return out


def relative_cost(cost: List[float], reference: List[float]) -> dict:
    """`cost` over `reference` for extend batches of n = 1..max tokens: {"uniform", "log_uniform" (means of the
    ratio with n weighted 1 and 1/n), "worst", "worst_n"}."""
    ratios = [(n, cost[n] / reference[n]) for n in range(1, len(reference))]
    weights = [1.0 / n for n, _ in ratios]
    worst_n, worst = max(ratios, key=lambda r: r[1])
    return {"uniform": statistics.fmean(r for _, r in ratios),
            "log_uniform": sum(w * r for w, (_, r) in zip(weights, ratios)) / sum(weights),
            "worst": worst, "worst_n": worst_n}


def program_composition(hlo_text: str) -> dict:
    """What a compiled program's optimized HLO (``compiled.as_text()``) is made of: {"instructions": instruction
    lines in every computation, fused ones included; "attention_instructions": those whose op_name metadata runs
    through ``ragged_paged_attention`` (the kernel's named call); "named_instructions": those with any op_name (a
    fused computation's parameters have none: the attention share is of these); "ynn_fusions": fusions XLA's CPU
    backend hands to YNNPACK (backend_config kind ``__ynn_fusion``)}."""
    lines = _INSTRUCTION_LINE.findall(hlo_text)
    names = [m.group(1) for m in map(_OP_NAME.search, lines) if m]
    return {"instructions": len(lines), "named_instructions": len(names),
            "attention_instructions": sum("ragged_paged_attention" in n for n in names),
            "ynn_fusions": sum('"kind":"__ynn_fusion"' in line for line in lines)}


def measure_bucket(runner: ModelRunner, name: str, lower, t: int, s: int, repeats: int) -> dict:
    """One extend bucket: trace, compile (empty cache), load (from the cache) and step time. See the module doc."""
    t0 = time.perf_counter()
    lowered = as_lowered(lower())
    traced = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = lowered.compile()
    xla = time.perf_counter() - t0
    composition = program_composition(compiled.as_text())
    jax.clear_caches()  # the next compile of the same program is a restart's: read back from the persistent cache
    t0, before = time.perf_counter(), compile_counts()
    as_lowered(lower()).compile()
    load = time.perf_counter() - t0
    loaded = (compile_counts() - before).cache_hits
    batch = runner.dummy_batch(ForwardMode.EXTEND, t, s)
    device_seconds_per_step(runner, batch, 1)  # the call path's own first run
    step = statistics.median(device_seconds_per_step(runner, batch, 2) for _ in range(repeats))
    return {"name": name, "T": t, "S": s, "trace_s": traced, "xla_s": xla, "load_s": load, "step_ms": 1e3 * step,
            "loaded_from_cache": loaded, **composition}


def set_rows(buckets: List[dict]) -> List[dict]:
    """The candidate sets' rows (see the module doc) from the measured `buckets` rows."""
    by_t = {b["T"]: b for b in buckets}
    full = sorted(by_t)
    step_ms = {t: b["step_ms"] for t, b in by_t.items()}
    today = padded_ms(full, step_ms)
    rows = []
    for cand in candidate_sets(full):
        rows.append({"buckets": list(cand), "programs": len(cand),
                     "compile_s": sum(by_t[t]["trace_s"] + by_t[t]["xla_s"] for t in cand),
                     "load_s": sum(by_t[t]["load_s"] for t in cand),
                     "padded": relative_cost(padded_ms(cand, step_ms), today),
                     "cut": relative_cost(cut_ms(cand, step_ms), today)})
    return rows


def bucket_row(b: dict) -> str:
    """One bucket's row of the first table (COLUMNS)."""
    share = 100 * b["attention_instructions"] / max(b["named_instructions"], 1)
    return (f"| {b['T']} | {b['trace_s']:.2f} | {b['xla_s']:.1f} | {b['load_s']:.2f} | {b['instructions']} | "
            f"{share:.0f} | {b['ynn_fusions']} | {b['step_ms']:.1f} |")


def report_body(raw: dict) -> str:
    """The report's markdown, computed from `raw` (the .json) alone."""
    lines = [f"- {h}" for h in raw["header"]] + ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += [bucket_row(b) for b in raw["buckets"]]
    lines += ["", "Candidate sets: start-up cost (sums over their buckets) and step cost, the time of an extend "
              "batch of n tokens over that of the first set padded (every bucket, one step of the smallest bucket >= "
              "n), averaged over n = 1..max uniform and log-uniform, and its worst n. Padded: one step of the "
              "smallest bucket >= n; cut: as the scheduler runs it, cut at smaller buckets while "
              "ShapeBuckets.extend_cut says so:", "",
              "| " + " | ".join(SET_COLUMNS) + " |", "|" + "---|" * len(SET_COLUMNS)]
    for r in set_rows(raw["buckets"]):
        pad, cut = r["padded"], r["cut"]
        lines.append(f"| {', '.join(map(str, r['buckets']))} | {r['programs']} | {r['compile_s']:.1f} | "
                     f"{r['load_s']:.1f} | {pad['uniform']:.2f}x / {pad['log_uniform']:.2f}x | "
                     f"{pad['worst']:.2f}x (n={pad['worst_n']}) | {cut['uniform']:.2f}x / {cut['log_uniform']:.2f}x | "
                     f"{cut['worst']:.2f}x (n={cut['worst_n']}) |")
    lines += ["", f"Commit {raw['commit']}, {raw['date']}, {raw['cpus']}, jax {raw['jax']}."]
    return "\n".join(lines)


def parse_args(argv: List[str]) -> Tuple[ServerArgs, argparse.Namespace]:
    """Every ServerArgs flag plus the benchmark's own."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--repeats", type=int, default=3, help="blocks of 2 steps timed per bucket (median)")
    parser.add_argument("--report", help="generated report NAME.md and NAME.json to write")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    try:
        return ServerArgs.from_cli_args(args), args
    except ValueError as e:
        parser.error(str(e))


def main(argv: Optional[List[str]] = None) -> None:
    """Measure every default extend bucket, print both tables, write the report."""
    argv = sys.argv[1:] if argv is None else argv
    sa, args = parse_args(argv)
    configure_logging(sa.log_level, "bench_buckets")
    cache = tempfile.mkdtemp(prefix="sgl_jax_bench_buckets_")  # empty: every first compile is XLA's own
    sa = dataclasses.replace(sa, compilation_cache_dir=cache)
    platform = setup_jax(sa)
    mc = ModelConfig.from_server_args(sa, platform)
    if sa.precompile_token_paddings is None:  # every power of two up to the chunk: the sets are drawn from them
        _, defaults, _, _ = derive_limits(sa, mc, platform)
        sa = dataclasses.replace(sa, precompile_token_paddings=powers_of_two(64, defaults.max_tokens))
    max_running, buckets, _, _ = derive_limits(sa, mc, platform)
    runner = ModelRunner(sa, mc, buckets=buckets, max_context_len=mc.context_len, num_request_slots=max_running,
                         kv_spec_fn=lambda wb: kv_spec_for(sa, mc, compute_max_total_tokens(sa, mc, wb, platform)))
    extends = [(name, lower) for name, lower in runner.warmup_programs() if name.startswith("extend ")]
    header = [f"model {mc.architecture} ({os.path.basename(mc.model_path)}, {mc.dtype}), "
              f"{jax.devices()[0].device_kind}, {cpu_name()}",
              f"extend buckets measured {list(buckets.token_paddings)} (without --precompile-token-paddings: powers "
              f"of two from 64 to the default buckets' largest); one at a time, nothing else compiling"]
    print("\n".join(header + ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]), flush=True)
    rows = []
    for (name, lower), t in tqdm(list(zip(extends, buckets.token_paddings)), desc="bench_buckets", unit="bucket"):
        rows.append(measure_bucket(runner, name, lower, t, buckets.extend_bs(t), args.repeats))
        tqdm.write(bucket_row(rows[-1]))
    shutil.rmtree(cache, ignore_errors=True)
    if any(r["loaded_from_cache"] != 1 for r in rows):
        sys.exit(f"a bucket was not read back from the compilation cache: {[r['loaded_from_cache'] for r in rows]}")
    raw = {"header": header, "commit": git_commit(), "jax": jax.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "cpus": f"{os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} usable)", "buckets": rows}
    body = report_body(raw)
    print("\n" + body.split("\n\n", 2)[-1], flush=True)
    if args.report:
        env = " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in ("JAX_PLATFORMS", "XLA_FLAGS") if k in os.environ)
        command = (env + " " if env else "") + "python -m sgl_jax.bench_buckets " + shlex.join(argv)
        write_report(args.report, "Extend token buckets: start-up cost against step cost", command, body, raw)


if __name__ == "__main__":
    main()
