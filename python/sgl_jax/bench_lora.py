"""The cost of LoRA: output tokens/s of a batch mixing adapters against the base model alone, and what one
adapter costs to load and to hold.

``python -m sgl_jax.bench_lora [--model-path PATH] [--num-adapters 4] [--rank 16] [--batch 16] [--input-len 128]
[--output-len 128] [--rounds 3] [--output-file result.json | --report NAME.md]``

Writes `num_adapters` random PEFT adapters of rank `rank` on every projection (q/k/v/o/gate/up/down; A and B
normal(0, 0.02), PEFT's file layout) for the model's shapes, then starts two real servers:
- ``base``: the model alone (no --enable-lora);
- ``lora``: the same with the adapters (--lora-paths, --max-loras-per-batch `num_adapters`).
Each timed round sends `batch` concurrent requests of `input-len` random prompt ids and `output-len` generated
tokens (ignore_eos) to each server in turn (base first, then lora, so that the pair runs under the same machine
conditions); on the lora server request i uses adapter i % num_adapters. A warm-up round runs first (it puts the
adapters in their slots). The table gives each round's output tokens/s and the ratio lora / base (the issue's
goal: >= 0.8).

Then one more adapter is loaded at run time: the wall time of ``/load_lora_adapter`` (reading the files), of the
first request that uses it (its weights written into a slot: ``lora_last_slot_write_ms`` from the server), the
adapter's file size and the device bytes of one slot (``lora_slot_bytes``). Last, the batched update alone
(layers/lora.lora_delta, in this process) for both ``--lora-backend`` values at a decode and a prefill size,
beside the base matmul of the same layer.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import tempfile
import time
from typing import List, Optional

import httpx
import numpy as np

from sgl_jax.bench_utils import LaunchedServer, cpu_name, fetch_server_info, publish_result, wait_idle_info

PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def model_shapes(hf_dir: str) -> dict:
    """(in, out) features of each projection and the layer count, from the model's config.json."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or hidden // heads)
    return {"layers": int(cfg["num_hidden_layers"]),
            "q_proj": (hidden, heads * hd), "k_proj": (hidden, kv * hd), "v_proj": (hidden, kv * hd),
            "o_proj": (heads * hd, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def write_adapter(path: str, shapes: dict, rank: int, seed: int) -> str:
    """A random PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) for `shapes`."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(shapes["layers"]):
        for proj, parent in PROJECTIONS.items():
            n_in, n_out = shapes[proj]
            key = f"base_model.model.model.layers.{layer}.{parent}.{proj}"
            tensors[key + ".lora_A.weight"] = (rng.standard_normal((rank, n_in)) * 0.02).astype(np.float32)
            tensors[key + ".lora_B.weight"] = (rng.standard_normal((n_out, rank)) * 0.02).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS),
                   "bias": "none", "use_rslora": False}, f)
    return path


def timed_round(url: str, prompts: List[List[int]], output_len: int, adapters: List[Optional[str]]) -> dict:
    """`len(prompts)` concurrent requests (request i with adapter ``adapters[i % len]``): tokens/s and wall s."""
    def one(i):
        body = {"input_ids": prompts[i], "lora_path": adapters[i % len(adapters)],
                "sampling_params": {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}}
        r = httpx.post(url + "/generate", json=body, timeout=1800)
        r.raise_for_status()
        return len(r.json()["output_ids"])

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        tokens = sum(pool.map(one, range(len(prompts))))
    wall = time.perf_counter() - t0
    return {"output_tokens": tokens, "seconds": round(wall, 3), "tokens_per_s": round(tokens / wall, 2)}


def op_timings(shapes: dict, num_slots: int, rank: int, sizes=(16, 2048), repeats: int = 20) -> List[dict]:
    """ms of the batched LoRA update (both backends) and of the base matmul, per projection kind and token count
    (tokens spread over the slots and the base)."""
    import jax
    import jax.numpy as jnp

    from sgl_jax.srt.layers.lora import LORA_BACKENDS, lora_delta

    rows = []
    rng = np.random.default_rng(0)
    for proj in ("q_proj", "down_proj"):
        n_in, n_out = shapes[proj]
        a = jnp.asarray(rng.standard_normal((num_slots, rank, n_in)), jnp.float32)
        b = jnp.asarray(rng.standard_normal((num_slots, rank, n_out)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((n_out, n_in)), jnp.float32)
        for t in sizes:
            x = jnp.asarray(rng.standard_normal((t, n_in)), jnp.float32)
            ids = jnp.asarray(np.arange(t) % (num_slots + 1) - 1, jnp.int32)  # (-1: the base's tokens)
            fns = {"base matmul": jax.jit(lambda x: x @ w.T)}
            fns.update({f"lora {be}": jax.jit(lambda x, ids, be=be: lora_delta(x, a, b, ids, be))
                        for be in LORA_BACKENDS})
            row = {"projection": proj, "in": n_in, "out": n_out, "tokens": t}
            for name, fn in fns.items():
                args = (x,) if name == "base matmul" else (x, ids)
                jax.block_until_ready(fn(*args))
                t0 = time.perf_counter()
                for _ in range(repeats):
                    out = fn(*args)
                jax.block_until_ready(out)
                row[name] = round(1000 * (time.perf_counter() - t0) / repeats, 4)
            rows.append(row)
    return rows


def run_benchmark(model_path: Optional[str] = None, tokenizer_path: Optional[str] = None, num_adapters: int = 4,
                  rank: int = 16, batch: int = 16, input_len: int = 128, output_len: int = 128, rounds: int = 3,
                  extra_args: Optional[List[str]] = None, env: Optional[dict] = None,
                  start_timeout: float = 1200.0) -> dict:
    """Both servers, the timed rounds, the run-time load and the op timings (module docstring)."""
    from sgl_jax.srt.configs.model_config import resolve_model_path

    resolved = resolve_model_path(model_path)
    shapes = model_shapes(resolved.hf_dir)
    work = tempfile.mkdtemp(prefix="sgl_jax_bench_lora_")
    dirs = [write_adapter(os.path.join(work, f"a{i}"), shapes, rank, seed=i) for i in range(num_adapters + 1)]
    names = [f"a{i}" for i in range(num_adapters)]
    common = ["--model-path", resolved.model_path, "--max-running-requests", str(batch), "--random-seed", "0",
              "--precompile-bs-paddings", str(batch), "--log-level", "warning", *(extra_args or [])]
    if tokenizer_path:
        common += ["--tokenizer-path", tokenizer_path]
    lora_args = common + ["--lora-paths", *[f"{n}={d}" for n, d in zip(names, dirs)], "--max-loras-per-batch",
                          str(num_adapters), "--max-lora-rank", str(rank), "--lora-target-modules", "all"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, size=input_len).tolist() for _ in range(batch)]
    result = {"date": datetime.date.today().isoformat(), "cpu": cpu_name(), "model": resolved.model_path,
              "num_adapters": num_adapters, "rank": rank, "batch": batch, "input_len": input_len,
              "output_len": output_len, "rounds": []}
    with LaunchedServer(common, start_timeout, env) as base, LaunchedServer(lora_args, start_timeout, env) as lora:
        timed_round(base.url, prompts, 8, [None])  # warm-up (and the adapters into their slots)
        timed_round(lora.url, prompts, 8, names)
        for _ in range(rounds):
            b = timed_round(base.url, prompts, output_len, [None])
            lo = timed_round(lora.url, prompts, output_len, names)
            result["rounds"].append({"base": b, "lora": lo, "ratio": round(lo["tokens_per_s"] / b["tokens_per_s"], 3)})
        t0 = time.perf_counter()
        r = httpx.post(lora.url + "/load_lora_adapter", json={"lora_name": "late", "lora_path": dirs[-1]},
                       timeout=600)
        r.raise_for_status()
        load_ms = 1000 * (time.perf_counter() - t0)
        t0 = time.perf_counter()
        timed_round(lora.url, prompts[:1], 1, ["late"])
        first_ms = 1000 * (time.perf_counter() - t0)
        info = wait_idle_info(lambda: fetch_server_info(lora.url))
        result["load"] = {"load_request_ms": round(load_ms, 1), "first_request_ms": round(first_ms, 1),
                          "slot_write_ms": info["internal_states"][0]["lora_last_slot_write_ms"],
                          "adapter_file_bytes": os.path.getsize(os.path.join(dirs[-1], "adapter_model.safetensors")),
                          "slot_bytes": info["scheduler_info"]["lora_slot_bytes"],
                          "weight_bytes_base": fetch_server_info(base.url)["scheduler_info"]["weight_bytes_per_device"],
                          "weight_bytes_lora": info["scheduler_info"]["weight_bytes_per_device"]}
        result["server_info"] = {"base": wait_idle_info(lambda: fetch_server_info(base.url)), "lora": info}
    result["ops"] = op_timings(shapes, num_adapters, rank)
    ratios = [r["ratio"] for r in result["rounds"]]
    result["ratio_median"] = float(np.median(ratios))
    return result


def format_table(result: dict) -> str:
    """The report's tables, computed from the result alone."""
    lines = [f"{result['model']}, {result['date']}, {result['cpu']}: batch {result['batch']} x ({result['input_len']} "
             f"prompt + {result['output_len']} output tokens); lora: {result['num_adapters']} rank-{result['rank']} "
             "adapters on every projection, mixed (request i uses adapter i % n)", "",
             "| round | base tokens/s | lora tokens/s | lora / base |", "|---|---|---|---|"]
    for i, r in enumerate(result["rounds"]):
        lines.append(f"| {i + 1} | {r['base']['tokens_per_s']} | {r['lora']['tokens_per_s']} | {r['ratio']} |")
    lines += ["", f"median lora / base: {result['ratio_median']:.3f} (goal >= 0.8)", ""]
    ld = result["load"]
    lines += ["| one more adapter | value |", "|---|---|",
              f"| /load_lora_adapter (read the files) | {ld['load_request_ms']} ms |",
              f"| first request using it (slot write + 1 token) | {ld['first_request_ms']} ms |",
              f"| slot write on the device | {ld['slot_write_ms']} ms |",
              f"| adapter file | {ld['adapter_file_bytes'] / 2**20:.2f} MiB |",
              f"| one device slot | {ld['slot_bytes'] / 2**20:.2f} MiB |",
              f"| weights per device, base / with {result['num_adapters']} slots | "
              f"{ld['weight_bytes_base'] / 2**20:.1f} / {ld['weight_bytes_lora'] / 2**20:.1f} MiB |", ""]
    lines += ["| layer | tokens | base matmul ms | lora dense ms | lora ragged ms |", "|---|---|---|---|---|"]
    for o in result["ops"]:
        lines.append(f"| {o['projection']} {o['in']}->{o['out']} | {o['tokens']} | {o['base matmul']} | "
                     f"{o['lora dense']} | {o['lora ragged']} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output-file", default=None)
    p.add_argument("--report", default=None)
    a = p.parse_args(argv)
    result = run_benchmark(a.model_path, a.tokenizer_path, a.num_adapters, a.rank, a.batch, a.input_len,
                           a.output_len, a.rounds)
    publish_result("sgl_jax.bench_lora", argv, result, "LoRA serving cost", format_table, a.output_file, a.report)


if __name__ == "__main__":
    main()
