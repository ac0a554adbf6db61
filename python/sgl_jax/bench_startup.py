"""Start-up time: a server started with an empty compilation cache, then restarted on the cache it filled, each
timed to its first /health 200 and its first chat answer, with the phases the server says its start-up spent
(issue #70).

``python -m sgl_jax.bench_startup [--restarts 2] [--cache-dir DIR] [--report NAME.md] [--output-file F.json]
[-- SERVER_FLAGS...]``

1. ``python -m sgl_jax.launch_server SERVER_FLAGS --compilation-cache-dir DIR`` with DIR empty (a fresh temporary
   directory unless --cache-dir names one, which must then be empty or absent): /health is polled every 0.1 s from
   the launch; then one /v1/chat/completions ("Hi", 8 tokens) is answered. "ready" = launch to the chat answer.
2. The same server stopped and started again --restarts times on the same DIR (every program now comes from the
   persistent compilation cache).
3. For every start, /get_server_info's ``startup_phases``: the scheduler process's phases (process start and
   imports, JAX set-up, model config and tokenizer, weights, scheduler set-up, tracing, compiling, KV cache
   allocation, grammar warm-up, ...) and the HTTP process's (`sgl_jax.srt.startup_phases`), and the warm-up's compile counts.

The goals in the table are issue #70's for the default model and flags on a 2-core machine: ready within 45 s
cold and 10 s on restart.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import List, Optional

import httpx

from sgl_jax.bench_utils import LaunchedServer, cpu_name, fetch_server_info, publish_result

GOAL_COLD_S = 45.0
GOAL_RESTART_S = 10.0
CHAT = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}


def one_start(flags: List[str], cache_dir: str, name: str, timeout: float) -> dict:
    """Launch, time /health 200 and the first chat answer (seconds from the launch), read the start-up phases and
    the warm-up counts, stop (checked: exit 0, no process left). Raises RuntimeError when the server fails to
    start or to stop, httpx.HTTPStatusError when the chat fails."""
    print(f"[bench_startup] {name}: starting", file=sys.stderr, flush=True)
    with LaunchedServer([*flags, "--compilation-cache-dir", cache_dir], timeout, poll_s=0.1) as server:
        health_s = server.ready_s
        r = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=120)
        r.raise_for_status()
        chat_s = time.perf_counter() - server.started_at
        info = fetch_server_info(server.url)
    phases = info["scheduler_info"].get("startup_phases") or {}
    state = info["internal_states"][0]
    print(f"[bench_startup] {name}: health {health_s:.1f} s, chat {chat_s:.1f} s", file=sys.stderr, flush=True)
    return {"name": name, "health_s": round(health_s, 3), "chat_s": round(chat_s, 3),
            "answer": r.json()["choices"][0]["message"]["content"], "startup_phases": phases,
            "warmup": state.get("warmup", {}), "num_compiles_after_warmup": state.get("num_compiles_after_warmup")}


def run(flags: List[str], restarts: int, cache_dir: Optional[str], timeout: float = 1800.0) -> dict:
    """The cold start and `restarts` restarts on one compilation cache directory (`one_start` each).

    Raises:
        ValueError: `cache_dir` exists and is not empty (the cold start would not be cold)."""
    if cache_dir and os.path.isdir(cache_dir) and os.listdir(cache_dir):
        raise ValueError(f"--cache-dir {cache_dir} is not empty: the first start would not be a cold one")
    load_at_start = os.getloadavg()[0]
    tmp = None if cache_dir else tempfile.mkdtemp(prefix="sgl_jax_bench_startup_cache_")
    cache = cache_dir or tmp
    try:
        starts = [one_start(flags, cache, "cold", timeout)]
        starts += [one_start(flags, cache, f"restart {i + 1}", timeout) for i in range(restarts)]
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "cpu_count": os.cpu_count(),
            "load_average_at_start": load_at_start, "server_flags": flags, "starts": starts}


def _phase_seconds(start: dict, process: str) -> dict:
    return {p["name"]: p["seconds"] for p in start["startup_phases"].get(process, {}).get("phases", [])}


def format_table(result: dict) -> str:
    """Markdown: one row per start (health, chat, goal), then each process's phases (rows) by start (columns)."""
    starts = result["starts"]
    lines = [f"- {result['cpu']}, {result['cpu_count']} CPUs, load average {result['load_average_at_start']:.2f} at "
             f"the start; server flags: `{' '.join(result['server_flags']) or '(defaults)'}`", "",
             "| start | /health 200 s | chat answered s | goal s (#70, default model) | programs | compiled | "
             "loaded from cache | compiles after warm-up |", "|---|---|---|---|---|---|---|---|"]
    for s in starts:
        goal = GOAL_COLD_S if s["name"] == "cold" else GOAL_RESTART_S
        w = s["warmup"]
        lines.append(f"| {s['name']} | {s['health_s']:.1f} | {s['chat_s']:.1f} | {goal:.0f} "
                     f"({'met' if s['chat_s'] <= goal else 'not met'}) | {w.get('programs', '-')} | "
                     f"{w.get('compiled', '-')} | {w.get('loaded_from_cache', '-')} | "
                     f"{s['num_compiles_after_warmup']} |")
    for process in ("scheduler", "server"):
        seconds = [_phase_seconds(s, process) for s in starts]
        names = list(dict.fromkeys(n for per_start in seconds for n in per_start))  # (in order, once each)
        lines += ["", f"{process} process phases (s):", "",
                  "| phase | " + " | ".join(s["name"] for s in starts) + " |", "|---" * (len(starts) + 1) + "|"]
        for n in names:
            lines.append(f"| {n} | " + " | ".join(f"{per_start[n]:.1f}" if n in per_start else "-"
                                                  for per_start in seconds) + " |")
        lines.append("| total | " + " | ".join(
            f"{s['startup_phases'].get(process, {}).get('total_s', float('nan')):.1f}" for s in starts) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    flags = args[args.index("--") + 1:] if "--" in args else []
    own = args[:args.index("--")] if "--" in args else args
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--restarts", type=int, default=2)
    p.add_argument("--cache-dir", default=None, help="an empty or absent directory for the compilation cache "
                                                     "(kept); default: a temporary one, removed at the end")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a start may take")
    p.add_argument("--output-file", default=None)
    p.add_argument("--report", default=None, help="write a generated report pair NAME.md / NAME.json")
    a = p.parse_args(own)
    result = run(flags, a.restarts, a.cache_dir, a.timeout)
    publish_result("sgl_jax.bench_startup", argv, result, "Start-up time: cold and restarted", format_table,
                   a.output_file, a.report)


if __name__ == "__main__":
    main()
