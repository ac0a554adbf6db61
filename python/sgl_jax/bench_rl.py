"""What the RL endpoints cost on a real server: updating the weights from disk, and releasing and resuming the
device memory (KV buffers and weights).

``python -m sgl_jax.bench_rl [--model-path PATH] [--rounds 3] [--max-total-tokens N] [--output-file result.json |
--report NAME.md]``

Starts one server (the default model unless --model-path), generates a greedy reference, then per round:
- ``/update_weights_from_disk`` with the served checkpoint itself (the whole read, placement and swap; the
  server's own ``seconds`` beside the request's wall time);
- ``/release_memory_occupation`` then ``/resume_memory_occupation`` of the KV buffers alone, then of both KV
  and weights (wall time, the server's seconds, and the device bytes released as the server counts them).
After the rounds the greedy reference is generated again and must be identical (same weights), and the server
must be clean (idle, KV at rest, no compile after warm-up).
"""

from __future__ import annotations

import argparse
import datetime
import time
from typing import List, Optional

import httpx

from sgl_jax.bench_utils import LaunchedServer, cpu_name, fetch_server_info, publish_result, wait_idle_info

PROMPT = "List three uses of a radix tree:"


def _post(url: str, path: str, body: dict) -> tuple:
    t0 = time.perf_counter()
    r = httpx.post(url + path, json=body, timeout=3600)
    wall_ms = 1000 * (time.perf_counter() - t0)
    if r.status_code != 200:
        raise RuntimeError(f"{path}: {r.status_code} {r.text}")
    return r.json(), wall_ms


def _greedy(url: str) -> list:
    r = httpx.post(url + "/generate", json={"text": PROMPT, "sampling_params": {"temperature": 0,
                                                                                "max_new_tokens": 16}}, timeout=600)
    r.raise_for_status()
    return r.json()["output_ids"]


def run_benchmark(model_path: Optional[str] = None, rounds: int = 3, max_total_tokens: Optional[int] = None,
                  extra_args: Optional[List[str]] = None, env: Optional[dict] = None,
                  start_timeout: float = 1200.0) -> dict:
    """The server, the reference, the rounds (module docstring)."""
    from sgl_jax.srt.configs.model_config import resolve_model_path

    resolved = resolve_model_path(model_path)
    args = ["--model-path", resolved.model_path, "--random-seed", "0", "--log-level", "warning",
            *(["--max-total-tokens", str(max_total_tokens)] if max_total_tokens else []), *(extra_args or [])]
    result = {"date": datetime.date.today().isoformat(), "cpu": cpu_name(), "model": resolved.model_path,
              "rounds": []}
    with LaunchedServer(args, start_timeout, env) as server:
        url = server.url
        before = _greedy(url)
        for _ in range(rounds):
            row = {}
            out, row["update_wall_ms"] = _post(url, "/update_weights_from_disk", {"model_path": resolved.model_path})
            row["update_server_ms"] = round(1000 * out["seconds"], 1)
            for name, tags in (("kv", ["kv_cache"]), ("all", ["kv_cache", "weights"])):
                out, row[f"release_{name}_wall_ms"] = _post(url, "/release_memory_occupation", {"tags": tags})
                row[f"release_{name}_server_ms"] = round(1000 * out["seconds"], 1)
                row[f"release_{name}_bytes"] = out["bytes_released"]
                out, row[f"resume_{name}_wall_ms"] = _post(url, "/resume_memory_occupation", {"tags": tags})
                row[f"resume_{name}_server_ms"] = round(1000 * out["seconds"], 1)
            result["rounds"].append({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()})
        after = _greedy(url)
        result["outputs_identical"] = before == after
        info = wait_idle_info(lambda: fetch_server_info(url))
        result["server_info"] = info
        result["weight_bytes_per_device"] = info["scheduler_info"]["weight_bytes_per_device"]
        result["kv_tokens"] = info["scheduler_info"]["max_total_tokens"]
    return result


def format_table(result: dict) -> str:
    """The report's table, computed from the result alone."""
    mib = 2**20
    rows = result["rounds"]
    lines = [f"Model `{result['model']}`; weights {result['weight_bytes_per_device'] / mib:.1f} MiB per device, KV "
             f"pool {result['kv_tokens']} tokens. Greedy output identical before and after: "
             f"{result['outputs_identical']}.", "",
             "| round | update from disk (wall / server ms) | release KV (wall / server ms, MiB) | resume KV "
             "(wall / server ms) | release KV + weights (wall / server ms, MiB) | resume KV + weights "
             "(wall / server ms) |", "|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        lines.append(f"| {i} | {r['update_wall_ms']} / {r['update_server_ms']} | {r['release_kv_wall_ms']} / "
                     f"{r['release_kv_server_ms']}, {r['release_kv_bytes'] / mib:.1f} | {r['resume_kv_wall_ms']} / "
                     f"{r['resume_kv_server_ms']} | {r['release_all_wall_ms']} / {r['release_all_server_ms']}, "
                     f"{r['release_all_bytes'] / mib:.1f} | {r['resume_all_wall_ms']} / {r['resume_all_server_ms']} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--output-file", default=None)
    p.add_argument("--report", default=None)
    a = p.parse_args(argv)
    result = run_benchmark(a.model_path, a.rounds, a.max_total_tokens)
    if not result["outputs_identical"]:
        raise SystemExit("the greedy output changed across updates and memory cycles of the same weights")
    publish_result("sgl_jax.bench_rl", argv, result, "RL endpoints: weight update and memory release cost",
                   format_table, a.output_file, a.report)


if __name__ == "__main__":
    main()
