"""Benchmark: multi-item scoring (/v1/score) -- serial, packed and prefill_extend, beside transformers.

One workload (a query of Q tokens, N items of L tokens each, two labels, real English text from Python's
own `pydoc_data.topics`), scored by:

- serial with the radix cache off (every item recomputes the query; as the seed report ran it, in
  waves of --multi-item-extend-batch-size = 32) -- on a subset of the items, since its cost per item is
  constant -- and serial with the radix cache on (the query's KV is reused from the prefix cache);
- packed (one sequence, segment mask) and prefill_extend (scoring-cache handle), on every item;
- transformers (PyTorch CPU) as users would write it: batched query+item forward passes, and the query's
  KV computed once and reused for every item batch (past_key_values) -- in float32 and in bfloat16,
  on a subset of the items (items/s for the reused-KV baseline counts its query once for all N items).

It prints a table (items/s, ms per item, total seconds, speedups) and writes a generated report, NAME.md and
NAME.json (bench_utils.write_report; notes go in NAME.notes.md, never in these two): the command, the machine, the
machine rates measured in the same run (bench_utils.measure_machine_rates; the matmul in the engine's weight
dtype, the fraction of it that prefill_extend achieves), and, raw in the .json, every row, the agreement and the
engine's internal state after the runs (compiles after warm-up, memory errors), from which the .md's claims come.

    # CI shape (default): query 200, 32 items of 20 tokens (transformers baselines on fewer items, CI)
    pytest -q -s test/srt/test_bench_multi_item_score.py
    # the headline shape, report under reports/
    python test/srt/test_bench_multi_item_score.py --query-tokens 2000 --num-items 500 --item-tokens 20 \\
        --report reports/multi-item-score-cpu.md
    # on an accelerator: Qwen3-0.6B's shapes with random weights (its config.json in benchmark/configs),
    # SmolLM2's tokenizer (its ids are valid Qwen3 ids); no transformers baselines for random weights
    JAX_PLATFORMS=cuda python test/srt/test_bench_multi_item_score.py --query-tokens 2000 --num-items 500 \
        --item-tokens 20 --model-path benchmark/configs/Qwen3-0.6B --load-format dummy --dtype bfloat16 \
        --tokenizer-path <SmolLM2's HF dir> --report reports/multi-item-score-h100.md
Environment variables SGL_JAX_BENCH_{QUERY_TOKENS,NUM_ITEMS,ITEM_TOKENS,SERIAL_ITEMS,HF_ITEMS,HF_BATCH,REPORT}
set the same values for the pytest form.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import os
import platform
import random
import shlex
import sys
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from sgl_jax.bench_utils import (MachineRates, cpu_name, format_server_claims, measure_machine_rates, timed,
                                 write_report)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SMALL = dict(query_tokens=200, num_items=32, item_tokens=20, serial_items=8, hf_items=4)
# The pytest form (CI): the transformers baselines, which take most of its time (bfloat16 matmuls are slow
# on CPUs without bfloat16 units), on fewer items: batched query+item on 2, reused query KV on 8. Both
# float32 baselines are still checked against the engine.
CI = dict(SMALL, hf_items=2, hf_batch=8)


@dataclasses.dataclass
class BenchConfig:
    query_tokens: int = SMALL["query_tokens"]
    num_items: int = SMALL["num_items"]
    item_tokens: int = SMALL["item_tokens"]
    serial_items: int = SMALL["serial_items"]  # items scored by serial with the radix cache off
    hf_items: int = SMALL["hf_items"]  # items scored by each transformers baseline
    hf_batch: int = 32  # items per transformers forward pass with reused query KV
    report: Optional[str] = None
    full: bool = False  # engine settings for long sequences (default buckets, chunk 2048); else the test suite's
    seed: int = 0
    dtype: str = "auto"  # the engine's --dtype (auto: float32 on CPU)
    kv_cache_dtype: str = "auto"  # the engine's --kv-cache-dtype
    # another model (an HF directory; with --load-format dummy only its config.json is read) and its tokenizer:
    # the transformers baselines need SmolLM2's real weights, so they run only on the default model
    model_path: Optional[str] = None
    tokenizer_path: Optional[str] = None
    load_format: str = "auto"
    attention_backend: str = "auto"

    @property
    def default_model(self) -> bool:
        return self.model_path is None and self.load_format != "dummy"


@dataclasses.dataclass
class Row:
    name: str
    items: int
    seconds: float
    note: str = ""
    items_per_s: Optional[float] = None

    def __post_init__(self):
        if self.items_per_s is None:
            self.items_per_s = self.items / self.seconds


def workload(tokenizer, cfg: BenchConfig):
    """(query ids, item id lists, label ids) from Python's pydoc topics text (offline, public domain)."""
    import pydoc_data.topics

    text = " ".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(cfg.seed)
    query = ids[:cfg.query_tokens]
    items = []
    for _ in range(cfg.num_items):
        o = rng.randrange(cfg.query_tokens, len(ids) - cfg.item_tokens)
        items.append(ids[o:o + cfg.item_tokens])
    labels = [tokenizer.encode(w, add_special_tokens=False)[0] for w in (" yes", " no")]
    return query, items, labels


def engine_args(cfg: BenchConfig, radix: bool) -> dict:
    from srt_helpers import SMALL_ENGINE_ARGS

    if cfg.full:
        args = dict(max_running_requests=128, precompile_bs_paddings=[1, 4, 16, 64, 128], random_seed=0,
                    max_total_tokens=65536)
    else:  # the test suite's shapes, so the persistent compilation cache is shared; scoring never decodes, so
        # of the decode buckets only the largest (it sets the extend buckets' batch padding) is compiled
        args = dict(SMALL_ENGINE_ARGS, precompile_bs_paddings=SMALL_ENGINE_ARGS["precompile_bs_paddings"][-1:])
    extra = {k: getattr(cfg, k) for k in ("dtype", "kv_cache_dtype", "load_format", "attention_backend")
             if getattr(cfg, k) != "auto"}
    extra.update({k: getattr(cfg, k) for k in ("model_path", "tokenizer_path") if getattr(cfg, k) is not None})
    return dict(args, disable_radix_cache=not radix, enable_scoring_cache=True, log_level="warning", **extra)


def model_flops(mc, query_tokens: int, num_items: int, item_tokens: int) -> float:
    """FLOPs prefill_extend needs: linear layers for every computed token, attention over the keys each
    token sees, and the LM head for each scored position."""
    h, layers = mc.hidden_size, mc.num_hidden_layers
    inter = mc.hf_config.intermediate_size
    qd, kvd = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    linear = 2 * layers * (h * (qd + 2 * kvd) + qd * h + 3 * h * inter)
    tokens = query_tokens + num_items * item_tokens
    keys_seen = query_tokens * (query_tokens + 1) / 2 + num_items * (
        item_tokens * query_tokens + item_tokens * (item_tokens + 1) / 2)
    attention = 4 * layers * qd * keys_seen
    head = 2 * h * mc.vocab_size * num_items
    return linear * tokens + attention + head


def run_engine_modes(cfg: BenchConfig, query, items, labels) -> Tuple[List[Row], Dict[str, list], dict]:
    """(rows, scores per mode, the radix-cache engine's raw state after its runs: ``{"internal_states": [...]}``,
    one entry per DP rank, as /get_server_info gives them). Each engine is checked as every test engine is
    (`srt_helpers.checked_engine`: clean at the end, no child process left)."""
    from srt_helpers import checked_engine  # sgl_jax.Engine, its processes without the test extras' torch

    rows, scores = [], {}
    sub = items[:cfg.serial_items]
    with checked_engine(**engine_args(cfg, radix=False)) as eng:
        eng.score(query, sub[:2], labels, algorithm="serial")  # warm the path
        scores["serial-nocache"], t = timed(lambda: eng.score(query, sub, labels, algorithm="serial"))
        rows.append(Row("serial, radix cache off", len(sub), t, f"subset of {len(sub)} items"))
    with checked_engine(**engine_args(cfg, radix=True)) as eng:
        eng.score(query[:50], items[:2], labels, algorithm="packed")
        for mode, name in (("serial", "serial, radix cache on"), ("packed", "packed"),
                           ("prefill_extend", "prefill_extend")):
            eng._run(eng.tokenizer_manager.flush_cache())  # every mode starts with nothing cached
            scores[mode], t = timed(lambda m=mode: eng.score(query, items, labels, algorithm=m))
            rows.append(Row(name, len(items), t))
        info = {"internal_states": eng.get_server_info()["internal_states"]}
    return rows, scores, info


def hf_baselines(cfg: BenchConfig, query, items, labels, base=None) -> Tuple[List[Row], Dict[str, list]]:
    """`base`: the float32 transformers model (srt_helpers.load_hf_reference; loaded here if None). It is not
    modified: the bfloat16 baselines run on a copy."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # the engine is gone: torch gets every core
    try:
        return _hf_baselines(cfg, query, items, labels, base)
    finally:
        torch.set_num_threads(threads)


def _hf_baselines(cfg, query, items, labels, base):
    import torch

    from srt_helpers import load_hf_reference

    rows, scores = [], {}
    if base is None:
        base = load_hf_reference()
    sub = items[:cfg.hf_items]
    reuse_n = min(len(items), max(cfg.hf_batch, cfg.hf_items))
    for dtype, dname in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        model = base if dtype == torch.float32 else copy.deepcopy(base).to(dtype)
        with torch.no_grad():
            def batched(model=model, sub=sub):
                out = []
                for i in range(0, len(sub), 4):
                    x = torch.tensor([query + it for it in sub[i:i + 4]])
                    out.append(torch.log_softmax(model(x).logits[:, -1].float(), -1)[:, labels])
                return torch.cat(out).tolist()

            batched(sub=sub[:1])  # warm-up (first-call allocations): one query+item sequence
            scores[f"hf-batched-{dname}"], t = timed(batched)
            rows.append(Row(f"transformers batched query+item ({dname})", len(sub), t,
                            f"subset of {len(sub)} items, batches of 4"))

            def reused(model=model):
                res = model(torch.tensor([query]), use_cache=True)
                t_query = time.perf_counter()
                cache = res.past_key_values
                out = []
                for i in range(0, reuse_n, cfg.hf_batch):
                    batch = items[i:i + cfg.hf_batch]
                    c = copy.deepcopy(cache)  # the query's KV, repeated for each item of the batch
                    c.batch_repeat_interleave(len(batch))
                    logits = model(torch.tensor(batch), past_key_values=c, use_cache=True).logits[:, -1]
                    out.append(torch.log_softmax(logits.float(), -1)[:, labels])
                return torch.cat(out).tolist(), t_query

            t0 = time.perf_counter()
            (lp, t_query_end) = reused()
            t_total = time.perf_counter() - t0
            t_query = t_query_end - t0
            per_item = (t_total - t_query) / reuse_n
            full = t_query + per_item * len(items)
            scores[f"hf-reused-{dname}"] = lp
            rows.append(Row(f"transformers reused query KV ({dname})", len(items), full,
                            f"query {t_query:.1f} s once + {per_item * 1e3:.1f} ms/item measured on "
                            f"{reuse_n} items, batches of {cfg.hf_batch}"))
    return rows, scores


def max_logprob_diff(a, b, apply_log: bool) -> float:
    a = np.log(np.asarray(a, np.float64)) if apply_log else np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.abs(a[:len(b)] - b[:len(a)]).max())


def machine(with_torch: bool) -> str:
    """The machine and the versions that ran; torch's when the transformers baselines ran (`with_torch`): the
    accelerator form with random weights runs none and needs no torch."""
    import jax
    import transformers

    dev = jax.devices()[0]
    accel = "" if dev.platform == "cpu" else f"{dev.device_kind} ({dev.platform}); host "
    versions = f"jax {jax.__version__}"
    if with_torch:
        import torch

        versions += f", torch {torch.__version__}"
    return (f"{accel}{cpu_name()}, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB; "
            f"Python {platform.python_version()}, {versions}, transformers {transformers.__version__}")


def run(cfg: BenchConfig, command: str, hf_model=None) -> str:
    """Run the benchmark, write the report (if cfg.report) and check the agreement; returns the report's body.
    `hf_model`: the float32 transformers reference, if the caller has it loaded already."""
    from sgl_jax.srt.configs.model_config import ModelConfig, load_tokenizer
    from sgl_jax.srt.server_args import ServerArgs

    sa = ServerArgs(log_level="warning", model_path=cfg.model_path, tokenizer_path=cfg.tokenizer_path,
                    load_format=cfg.load_format)
    tokenizer = load_tokenizer(sa)
    query, items, labels = workload(tokenizer, cfg)
    t_start = time.time()
    # the engines run first: on an accelerator JAX in this process would take the device memory they need
    rows, scores, engine_info = run_engine_modes(cfg, query, items, labels)
    import jax

    device = jax.devices()[0]
    weights = {"auto": "float32" if device.platform == "cpu" else "bfloat16"}.get(cfg.dtype, cfg.dtype)
    rates = measure_machine_rates(weights)
    mc = ModelConfig.from_server_args(sa, device.platform)
    pe = next(r for r in rows if r.name == "prefill_extend")
    achieved = model_flops(mc, cfg.query_tokens, cfg.num_items, cfg.item_tokens) / pe.seconds / 1e9
    if cfg.default_model:
        hf_rows, hf_scores = hf_baselines(cfg, query, items, labels, hf_model)
        rows += hf_rows
    wall = time.time() - t_start

    # agreement: every mode against serial (log-probabilities), transformers float32 against serial
    ref = np.log(np.asarray(scores["serial"], np.float64))
    agree = {m: max_logprob_diff(scores[m], ref, True) for m in ("serial-nocache", "packed", "prefill_extend")}
    if cfg.default_model:
        agree["transformers float32 (batched)"] = max_logprob_diff(ref, hf_scores["hf-batched-float32"], False)
        agree["transformers float32 (reused KV)"] = max_logprob_diff(ref, hf_scores["hf-reused-float32"], False)
    raw = {"date": datetime.date.today().isoformat(), "config": dataclasses.asdict(cfg), "weights_dtype": weights,
           "platform": device.platform, "machine": machine(cfg.default_model), "engine_flags": engine_args(cfg, True),
           "rates": rates.to_json(), "prefill_extend_model_gflops": achieved,
           "rows": [dataclasses.asdict(r) for r in rows], "agreement": agree, "wall_s": wall,
           "engine_server_info": engine_info}
    raw = json.loads(json.dumps(raw))  # the body is computed from exactly what the .json holds
    body = report_body(raw)
    print("\n" + body)
    if cfg.report:
        write_report(cfg.report, f"Multi-item scoring benchmark ({raw['date']})", command, body, raw)
        print(f"report written to {cfg.report} (+ .json)")
    check_run(raw)
    return body


def report_body(raw: dict) -> str:
    """The report's markdown body, computed from `raw` only (what `run` saves in the .json)."""
    cfg = raw["config"]
    rates = raw["rates"]
    model = ("SmolLM2-135M-Instruct (GGUF Q4_1 dequantized)" if cfg["model_path"] is None else
             os.path.basename(os.path.normpath(cfg["model_path"]))) + (
        ", random (dummy) weights" if cfg["load_format"] == "dummy" else "")
    rows = [Row(**r) for r in raw["rows"]]
    lines = [f"Workload: query {cfg['query_tokens']} tokens, {cfg['num_items']} items x {cfg['item_tokens']} tokens, "
             f"2 labels; {model}, engine weights {raw['weights_dtype']}, KV cache "
             f"{cfg['kv_cache_dtype'] if cfg['kv_cache_dtype'] != 'auto' else 'as the weights'}, "
             f"{raw['platform'].upper()}.", "", f"Machine: {raw['machine']}", "",
             f"Engine flags: {raw['engine_flags']} (radix off for the first row)", "",
             "| mode | items timed | items/s | ms/item | total s | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.name} | {r.items} | {r.items_per_s:.2f} | {1e3 / r.items_per_s:.1f} | "
                     f"{r.items / r.items_per_s:.1f} | {r.note} |")
    pe_rate = next(r for r in rows if r.name == "prefill_extend").items_per_s
    lines += ["", "Speedups of prefill_extend:", ""]
    lines += [f"- vs {r.name}: {pe_rate / r.items_per_s:.1f}x" for r in rows if r.name != "prefill_extend"]
    achieved, sheet = raw["prefill_extend_model_gflops"], rates["datasheet"]
    lines += ["", f"Machine rates {MachineRates.from_json(rates).describe()}; prefill_extend achieves "
                  f"{achieved:.1f} GFLOP/s of model "
                  f"FLOPs ({100 * achieved / rates['matmul_gflops']:.1f}% of the measured matmul rate)"
                  + (f", MFU {100 * achieved / (sheet['bf16_tflops'] * 1e3):.2f}% of the datasheet's "
                     f"{sheet['bf16_tflops']:.0f} TFLOP/s dense bfloat16" if sheet else "") + ".", "",
              "Engine state after the radix-cache engine's runs (its raw internal state in the .json):", "",
              format_server_claims(raw["engine_server_info"]), "",
              "Agreement (max |delta log-probability| vs serial with the radix cache on, over the items "
              "both scored):", ""]
    lines += [f"- {k}: {v:.2e}" for k, v in raw["agreement"].items()]
    lines += ["", f"Benchmark wall time: {raw['wall_s']:.0f} s."]
    return "\n".join(lines)


def check_run(raw: dict) -> None:
    """The benchmark's assertions, on its raw output: no compile after warm-up and no memory error in the engine,
    and every mode (and transformers float32) agreeing with serial."""
    for st in raw["engine_server_info"]["internal_states"]:
        assert st["num_compiles_after_warmup"] == 0 and st["memory_errors"] == 0, st
    agree = raw["agreement"]
    # bfloat16 weights round differently with each batch's composition and differ from the float32 reference:
    # measured at the headline shape (reports/multi-item-score-bf16-cpu-2026-11-24.md) up to 0.32 between
    # modes and 0.096 from transformers float32; a wrong item order or mask is off by whole nats
    modes_tol, ref_tol = (1e-4, 1e-3) if raw["weights_dtype"] == "float32" else (0.5, 0.2)
    assert max(agree[m] for m in ("packed", "prefill_extend", "serial-nocache")) < modes_tol, agree
    for k in ("transformers float32 (batched)", "transformers float32 (reused KV)"):
        if k in agree:
            assert agree[k] < ref_tol, agree


def config_from_env() -> BenchConfig:
    cfg = BenchConfig(**CI)
    for f in ("query_tokens", "num_items", "item_tokens", "serial_items", "hf_items", "hf_batch"):
        v = os.environ.get(f"SGL_JAX_BENCH_{f.upper()}")
        if v:
            setattr(cfg, f, int(v))
    cfg.report = os.environ.get("SGL_JAX_BENCH_REPORT")
    cfg.full = cfg.query_tokens + cfg.item_tokens > 1024
    return cfg


def test_bench_multi_item_score(tmp_path, hf_smollm2):
    cfg = config_from_env()
    if cfg.report is None:
        cfg.report = str(tmp_path / "multi-item-score.md")
    env = " ".join(f"{k}={v}" for k, v in os.environ.items() if k.startswith("SGL_JAX_BENCH_"))
    command = f"{env} pytest -q -s test/srt/test_bench_multi_item_score.py".strip()
    body = run(cfg, command, hf_model=hf_smollm2)
    # the generated pair: the .md is its command and a body computed from the .json alone
    raw = json.loads(open(os.path.splitext(cfg.report)[0] + ".json").read())
    md = open(cfg.report).read()
    assert raw["command"] == command and f"```bash\n{command}\n```" in md
    assert report_body(raw) == body and body in md
    assert raw["rates"]["matmul_gflops"] > 0 and raw["rates"]["memory_gbps"] > 0
    assert "num_compiles_after_warmup 0, memory_errors 0" in md


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in dataclasses.fields(BenchConfig):
        if f.name == "full":
            p.add_argument("--engine", choices=["auto", "full", "small"], default="auto",
                           help="engine shapes: full (chunk 2048, default buckets), small (the test suite's), "
                                "auto (full for sequences over 1024 tokens)")
            continue
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default) if f.default is not None else str,
                       default=f.default)
    args = vars(p.parse_args(argv))
    engine = args.pop("engine")
    cfg = BenchConfig(**args)
    cfg.full = engine == "full" or (engine == "auto" and cfg.query_tokens + cfg.item_tokens > 1024)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # JAX_PLATFORMS=cuda (or tpu) to run on an accelerator
    run(cfg, "python " + " ".join(shlex.quote(a) for a in [sys.argv[0]] + sys.argv[1:]))


if __name__ == "__main__":
    main()
