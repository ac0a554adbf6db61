"""Accuracy, weight memory and speed of every ``--quantization`` method beside float32 and bfloat16, one model.

::

    JAX_PLATFORMS=cpu python -m sgl_jax.bench_quantization --report reports/quantization-cpu-DATE.md
    JAX_PLATFORMS=cpu python -m sgl_jax.bench_quantization --model-path gemma-3-270m.gguf --skip-speed

Every ServerArgs flag works (``--model-path``, ``--page-size`` ...); the rows differ in ``--dtype`` (float32,
bfloat16), ``--quantization`` (over ``--dtype`` float32 on CPU, bfloat16 elsewhere: ``--base-dtype``; the ``gguf``
row, for a .gguf model only, keeps its Q8_0 / Q4_0 / Q4_1 blocks) or, in the ``kv_fp8_e4m3`` / ``kv_fp8_e5m2``
rows, ``--kv-cache-dtype`` (float32 weights).

- **Accuracy**: an offline Engine (the real scheduler and model runner) scores a fixed natural text (``--text-file``,
  default the GPL-3.0 text shipped in ``benchmark/data``), tokenized and cut into ``--windows`` windows of
  ``--window-len`` tokens, each scored from its start: the logprob of the text's next token and the greedy (top-1)
  token at every position. Against the float32 row: top-1 agreement and mean / max |delta logprob|; perplexity
  ``exp(-mean logprob)`` and its change against the bfloat16 row (``ppl vs bf16``).
- **Memory**: ``/get_server_info``'s ``weight_bytes_per_device`` (the weights as stored, scales included) and its
  ratio to bfloat16's.
- **Speed**: ``bench_one_batch`` in a subprocess per row: batch 1 with a ``--prefill-len``-token prompt (the
  prefill's seconds and batch-1 decode), then batch ``--decode-batch`` with 128-token prompts (decode); medians of
  ``--output-len`` steps, compilation excluded.

``--report NAME.md`` writes the generated report pair (bench_utils.write_report); notes go in NAME.notes.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
from typing import List, Optional

import numpy as np

from sgl_jax.bench_utils import git_commit, write_report
from sgl_jax.srt.server_args import QUANTIZATION_METHODS, ServerArgs
from sgl_jax.srt.utils import configure_logging

KV_ROWS = ("kv_fp8_e4m3", "kv_fp8_e5m2")  # float32 weights, --kv-cache-dtype fp8_e4m3 / fp8_e5m2
GGUF_ROW = "gguf"  # --quantization gguf: a .gguf model's own blocks kept (its float32 rows dequantize them)
ROWS = ("float32", "bfloat16") + QUANTIZATION_METHODS + (GGUF_ROW,) + KV_ROWS
DEFAULT_TEXT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmark", "data", "GPL-3.0.txt")
COLUMNS = ("row", "ppl", "ppl vs bf16", "top-1 agree", "mean abs dlp", "max abs dlp", "weight MB", "x bf16 bytes",
           "prefill s", "decode b1 ms", "decode bN ms")


def row_overrides(row: str, base_dtype: str) -> dict:
    """The ServerArgs fields a row sets: ``dtype`` = row for float32 / bfloat16; float32 weights and an fp8
    ``kv_cache_dtype`` for a ``kv_*`` row; else ``quantization`` = row over `base_dtype` weights."""
    if row in ("float32", "bfloat16"):
        return {"dtype": row, "quantization": None}
    if row in KV_ROWS:
        return {"dtype": "float32", "quantization": None, "kv_cache_dtype": row[len("kv_"):]}
    return {"dtype": base_dtype, "quantization": row}


def text_windows(tokenizer, path: str, windows: int, window_len: int) -> List[List[int]]:
    """The text at `path` tokenized (no special tokens) and cut into `windows` consecutive windows of `window_len`
    token ids.

    Raises:
        ValueError: the text has fewer than windows x window_len tokens."""
    with open(path) as f:
        ids = tokenizer.encode(f.read(), add_special_tokens=False)
    if len(ids) < windows * window_len:
        raise ValueError(f"{path} has {len(ids)} tokens, fewer than --windows x --window-len")
    return [ids[w * window_len:(w + 1) * window_len] for w in range(windows)]


def accuracy_server_args(sa: ServerArgs, window_len: int) -> ServerArgs:
    """`sa` for the accuracy pass: one extend bucket holding a whole window, one request at a time, a small pool, no
    grammar backend (no structured output: llguidance's tokenizer for Gemma 3's 262,144 tokens takes ~5 s to build)."""
    pad = 1 << (window_len - 1).bit_length()
    return dataclasses.replace(sa, precompile_token_paddings=[pad], precompile_bs_paddings=[1], max_running_requests=1,
                               chunked_prefill_size=pad, max_prefill_tokens=pad, log_level="warning",
                               max_total_tokens=sa.max_total_tokens or 4 * pad, grammar_backend="none")


def score_text(engine, path: str, windows: int, window_len: int) -> dict:
    """One row's accuracy inputs and memory through a running offline Engine (`accuracy_server_args`): {"logprobs":
    the next token's logprob at each position (float list), "top1": the greedy token there, "weight_bytes": per
    device}."""
    chunks = text_windows(engine.tokenizer_manager.tokenizer, path, windows, window_len)
    logprobs, top1 = [], []
    for chunk in chunks:
        out = engine.generate(input_ids=chunk, sampling_params={"max_new_tokens": 1, "temperature": 0},
                              return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
        meta = out["meta_info"]
        logprobs += [float(lp) for lp, _, _ in meta["input_token_logprobs"][1:]]
        top1 += [int(top[0][1]) for top in meta["input_top_logprobs"][1:]]
    info = engine.get_server_info()
    return {"logprobs": logprobs, "top1": top1,
            "weight_bytes": int(info["scheduler_info"]["weight_bytes_per_device"])}


def bench_speed(argv: List[str], args) -> dict:
    """bench_one_batch rows for one row's flags (`argv`), each in its own subprocess: {"prefill_s", "decode_b1_ms",
    "decode_bN_ms"} from (batch 1, --prefill-len) and (batch --decode-batch, 128-token prompts)."""
    out = {}
    runs = (([1], args.prefill_len, ("prefill_s", "prefill_latency_s"), ("decode_b1_ms", "decode_median_ms")),
            ([args.decode_batch], 128, None, ("decode_bN_ms", "decode_median_ms")))
    for batch, input_len, *fields in runs:
        with tempfile.TemporaryDirectory() as tmp:
            result = os.path.join(tmp, "rows.jsonl")
            pad = 1 << (max(input_len, 2048) - 1).bit_length()  # the buckets these shapes need, no more
            cmd = [sys.executable, "-m", "sgl_jax.bench_one_batch", *argv, "--batch-size", *map(str, batch),
                   "--input-len", str(input_len), "--output-len", str(args.output_len),
                   "--precompile-bs-paddings", *map(str, batch), "--precompile-token-paddings", str(pad),
                   "--chunked-prefill-size", str(pad), "--log-level", "warning",
                   "--disable-overlap-schedule", "--result-filename", result]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            with open(result) as f:
                row = json.loads(f.readline())
        for field in fields:
            if field is not None:
                out[field[0]] = float(row[field[1]])
    return out


def summarize(rows: dict) -> List[dict]:
    """Per row: perplexity, its ratio to bfloat16's, top-1 agreement and |delta logprob| against float32, weight
    bytes and their ratio to bfloat16's, and the speed fields when measured."""
    ref, bf16 = rows["float32"], rows.get("bfloat16")
    out = []
    for name, r in rows.items():
        lp, ref_lp = np.asarray(r["logprobs"]), np.asarray(ref["logprobs"])
        diff = np.abs(lp - ref_lp)
        ppl = float(np.exp(-lp.mean()))
        s = {"row": name, "ppl": ppl, "positions": len(lp),
             "top1_agreement": float(np.mean(np.asarray(r["top1"]) == np.asarray(ref["top1"]))),
             "mean_abs_dlogprob": float(diff.mean()), "max_abs_dlogprob": float(diff.max()),
             "weight_bytes": r["weight_bytes"]}
        if bf16 is not None:
            s["ppl_vs_bf16"] = ppl / float(np.exp(-np.mean(bf16["logprobs"]))) - 1
            s["bytes_vs_bf16"] = r["weight_bytes"] / bf16["weight_bytes"]
        s.update({k: r[k] for k in ("prefill_s", "decode_b1_ms", "decode_bN_ms") if k in r})
        out.append(s)
    return out


def format_row(s: dict) -> str:
    """One markdown table row of a `summarize` entry ("-" for what was not measured)."""
    def get(key, fmt):
        return format(s[key], fmt) if key in s else "-"
    cells = [s["row"], f"{s['ppl']:.3f}", get("ppl_vs_bf16", "+.2%"), f"{s['top1_agreement']:.4f}",
             f"{s['mean_abs_dlogprob']:.4f}", f"{s['max_abs_dlogprob']:.3f}", f"{s['weight_bytes'] / 1e6:.1f}",
             get("bytes_vs_bf16", ".3f"), get("prefill_s", ".3f"), get("decode_b1_ms", ".2f"),
             get("decode_bN_ms", ".2f")]
    return "| " + " | ".join(cells) + " |"


def report_body(raw: dict) -> str:
    """The report's markdown body, computed from `raw` alone (the .json of `write_report`)."""
    table = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    table += [format_row(s) for s in summarize(raw["rows"])]
    return "\n".join([*[f"- {h}" for h in raw["header"]], "", *table, "",
                      f"Commit {raw['commit']}, {raw['date']}, {raw['cpus']}."])


def parse_args(argv: List[str]):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--rows", nargs="+", default=None, choices=ROWS,
                        help="float32 must be one (default: every row; gguf for a .gguf model only)")
    parser.add_argument("--base-dtype", default=None, help="the quantized rows' --dtype (default: float32 on CPU, "
                                                           "bfloat16 elsewhere)")
    parser.add_argument("--text-file", default=DEFAULT_TEXT)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--window-len", type=int, default=1000, help="tokens per window")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--prefill-len", type=int, default=2000)
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--report", help="generated report NAME.md (+ NAME.json)")
    args = parser.parse_args(argv)
    if args.rows is None:
        gguf = str(args.model_path or "").endswith(".gguf") or args.model_path is None  # (default: SmolLM2's GGUF)
        args.rows = [r for r in ROWS if gguf or r != GGUF_ROW]
    if "float32" not in args.rows:
        parser.error("--rows must include float32 (the reference)")
    return ServerArgs.from_cli_args(args), args


def _flags(argv: List[str], row: str, base_dtype: str) -> List[str]:
    """`argv` without this script's own flags and the ones a row sets, plus the row's (`row_overrides`)."""
    overrides = row_overrides(row, base_dtype)
    own = {"--rows", "--base-dtype", "--text-file", "--windows", "--window-len", "--prefill-len", "--decode-batch",
           "--output-len", "--report", "--skip-speed", "--log-level"} | {_flag(k) for k in overrides}
    kept, skip = [], False
    for a in argv:
        if a.startswith("--"):
            skip = a.split("=")[0] in own
        if not skip:
            kept.append(a)
    return kept + [x for k, v in overrides.items() if v is not None for x in (_flag(k), str(v))]


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def main(argv: Optional[List[str]] = None) -> None:
    """Measure every row, print the table, write the report."""
    from sgl_jax.srt.entrypoints.engine import Engine

    argv = sys.argv[1:] if argv is None else argv
    sa, args = parse_args(argv)
    configure_logging("warning" if sa.log_level == "info" else sa.log_level, "bench_quantization")
    commit = git_commit()  # the code that runs: read before the rows, which take minutes
    platform = os.environ.get("JAX_PLATFORMS", "") or "auto"
    base = args.base_dtype or ("float32" if platform == "cpu" else "bfloat16")
    rows = {}
    for row in ["float32"] + [r for r in args.rows if r != "float32"]:
        rsa = dataclasses.replace(sa, **row_overrides(row, base))
        with Engine(**dataclasses.asdict(accuracy_server_args(rsa, args.window_len))) as engine:
            rows[row] = score_text(engine, args.text_file, args.windows, args.window_len)
        if not args.skip_speed:
            rows[row].update(bench_speed(_flags(argv, row, base), args))
        print(format_row(summarize({"float32": rows["float32"], row: rows[row]})[-1]), flush=True)
    header = [f"model {os.path.basename(sa.model_path) if sa.model_path else 'default (SmolLM2-135M-Instruct GGUF)'}"
              f"; quantized rows over {base} weights",
              f"accuracy: {args.windows} windows of {args.window_len} tokens of {os.path.basename(args.text_file)}, "
              f"each scored from its start; top-1 agreement and |delta logprob| (of the text's next token) against "
              f"float32; ppl vs bf16 = ppl / ppl(bfloat16) - 1",
              "weight MB: /get_server_info weight_bytes_per_device (as stored, scales included)",
              "speed: not measured (--skip-speed)" if args.skip_speed else
              f"speed: bench_one_batch, prefill of {args.prefill_len} tokens at batch 1, decode medians of "
              f"{args.output_len} steps at batch 1 and {args.decode_batch} (128-token prompts)"]
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    raw = {"header": header, "commit": commit, "date": now,
           "cpus": f"{os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} usable)", "rows": rows}
    print("\n" + report_body(raw))
    if args.report:
        env = " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in ("JAX_PLATFORMS", "XLA_FLAGS") if k in os.environ)
        command = (env + " " if env else "") + "python -m sgl_jax.bench_quantization " + shlex.join(argv)
        write_report(args.report, "Quantization: accuracy, weight bytes and speed", command, report_body(raw), raw)


if __name__ == "__main__":
    main()
