"""What a server adds to the decode step: bench_one_batch's overlapped step beside the same model served over HTTP,
measured in one run (issue #69).

``python -m sgl_jax.bench_hot_loop [--model-path benchmark/configs/tiny-llama-vocab512] [--load-format dummy]
[--tokenizer-path DIR] [--input-len 192] [--batch-size 1 16] [--server-tokens 32 160] [--repeats 3]
[--instances 1] [--report NAME.md] [-- SERVER_FLAGS...]``

1. ``python -m sgl_jax.bench_one_batch`` (a subprocess) with the server flags and --batch-size, decoding what the
   server's step below decodes: greedy (--temperature 0), at the same contexts: prompts of --input-len + N1 tokens,
   N2 - N1 decode steps (a step's device time grows with its context: at batch 1 on a 2-core CPU, 0.16 ms over
   contexts 192-256 against 0.24-0.25 ms over 288-352 in two runs); each row's step with the overlap loop
   (``decode_overlap_median_ms``) and without, and the device's own time.
2. A server of the same model and flags (``python -m sgl_jax.launch_server``). For each batch size B: B concurrent
   requests of --input-len random ``input_ids`` (seeded; ``ignore_eos``) sent as one batch ``/generate`` (so that
   both runs admit them in the same steps), first with max_new_tokens N1,
   then N2 (--server-tokens); a step's time is (wall(N2) - wall(N1)) / (N2 - N1), so prefill, the HTTP round trip
   and request set-up cancel out. Median over --repeats, each repeat with fresh prompts (no prefix cache hit); each
   batch starts on an idle server whose idle-time KV check is done (`settle`).
   Measured twice: non-streaming requests (the scheduler sends nothing until a request finishes) and streaming ones
   (every token goes through the detokenizer and the HTTP process as an SSE event; this client splits the
   stream's bytes and parses each event with orjson, since it shares the machine's cores with the server).
3. ``x bench`` = the server's step / bench_one_batch's overlapped step; the server's own step histograms
   (scheduler/step_stats.py) are summarised beside it.
4. With ``--instances N``, steps 1 and 2 run N times, one after the other (bench, server, bench, server...), each
   time a new process: on a 2-core CPU the same code's batch-1 step differs by 10-25% from one process to the next
   while the repeats inside one agree within a few percent (reports/hot-loop-cpu-2026-12-07l.notes.md), so one
   process per side measures that process more than the code. Each time is then the median over the instances'
   medians, and the table lists every instance's ``x bench``.

Without --tokenizer-path the server uses SmolLM2's tokenizer (the default model's), whose ids below a small vocabulary
are valid for any model.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

import httpx
import numpy as np
import orjson

from sgl_jax.bench_utils import LaunchedServer, cpu_name, fetch_server_info, publish_result, wait_idle_info

DEFAULT_MODEL = "benchmark/configs/tiny-llama-vocab512"


def bench_contexts(input_len: int, server_tokens) -> tuple:
    """(input_len, output_len) of the bench_one_batch run whose decode steps see the contexts of the server's
    differential step: prompts of `input_len` + N1 tokens, N2 - N1 steps (`server_tokens` = (N1, N2))."""
    n1, n2 = server_tokens
    return input_len + n1, n2 - n1


def bench_rows(args, server_flags: List[str], input_len: int, output_len: int) -> List[dict]:
    """bench_one_batch's rows (a subprocess, its JSONL) of `input_len`-token prompts decoded `output_len` steps,
    greedy (`bench_contexts` gives the server's)."""
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = os.path.join(tmp, "rows.jsonl")
        cmd = [sys.executable, "-m", "sgl_jax.bench_one_batch", "--model-path", args.model_path, "--load-format",
               args.load_format, "--batch-size", *map(str, args.batch_size), "--input-len", str(input_len),
               "--output-len", str(output_len), "--temperature", "0", "--warmup-steps", "4", "--result-filename", jsonl,
               *server_flags]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"bench_one_batch failed:\n{proc.stderr[-3000:]}")
        with open(jsonl) as f:
            return [json.loads(line) for line in f]


def generate_batch(url: str, prompts: List[List[int]], n: int, stream: bool) -> None:
    """One /generate of every prompt (a batch: SGLang's list of ``input_ids``), `n` tokens each."""
    body = {"input_ids": prompts, "stream": stream,
            "sampling_params": {"max_new_tokens": n, "ignore_eos": True, "temperature": 0}}
    if not stream:
        r = httpx.post(url + "/generate", json=body, timeout=600)
        r.raise_for_status()
        assert [x["meta_info"]["completion_tokens"] for x in r.json()] == [n] * len(prompts)
        return
    done, buf = {}, b""
    with httpx.stream("POST", url + "/generate", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for chunk in resp.iter_bytes():  # (split and parsed here with orjson: this client shares the machine)
            buf += chunk
            *events, buf = buf.split(b"\n\n")
            for e in events:
                if e.startswith(b"data: {"):
                    event = orjson.loads(e[6:])
                    done[event.get("index", 0)] = event["meta_info"]["completion_tokens"]
    assert done == {i: n for i in range(len(prompts))}


def timed_batch(url: str, prompts: List[List[int]], n: int, stream: bool) -> float:
    """Seconds for len(prompts) concurrent requests of `n` tokens each (one batch /generate) to all finish."""
    t0 = time.perf_counter()
    generate_batch(url, prompts, n, stream)
    return time.perf_counter() - t0


def settle(url: str) -> None:
    """Return once the server is idle and its idle-time KV check (scheduler/rank.py `on_idle`, tens of ms on a
    large pool) is done: the scheduler answers a second /get_server_info only after the iteration that ran it, so
    the check never lands inside a timed batch."""
    wait_idle_info(lambda: fetch_server_info(url))
    fetch_server_info(url)


def server_step_ms(url: str, bs: int, input_len: int, vocab: int, tokens: tuple, repeats: int, stream: bool,
                   rng: np.random.Generator) -> dict:
    """The differential step time of `bs` concurrent requests (module docstring): median ms and every repeat."""
    n1, n2 = tokens
    steps = []
    for _ in range(repeats):
        walls = []
        for n in (n1, n2):
            prompts = rng.integers(1, vocab, size=(bs, input_len)).tolist()
            settle(url)
            walls.append(timed_batch(url, prompts, n, stream))
        steps.append(1e3 * (walls[1] - walls[0]) / (n2 - n1))
    return {"median_ms": float(np.median(steps)), "repeats_ms": [round(s, 4) for s in steps]}


def histogram_median(h: dict) -> Optional[float]:
    """The upper bound of the bucket holding the median observation of a step_stats histogram (None: empty)."""
    total = sum(h["counts"])
    if not total:
        return None
    seen = 0
    for bound, count in zip(h["buckets"], h["counts"]):
        seen += count
        if seen * 2 >= total:
            return bound
    return None


def server_entries(args, server_flags: List[str], rng: np.random.Generator) -> dict:
    """One server instance (step 2 of the module docstring): {"server": per batch size its plain and streaming
    step times, "step_stats": the server's step histograms, "compiles_after_warmup": programs compiled after its
    warm-up}."""
    from sgl_jax.srt.configs.model_config import resolve_model_path

    tokenizer = args.tokenizer_path or resolve_model_path(None).hf_dir
    serve = ["--model-path", args.model_path, "--load-format", args.load_format, "--tokenizer-path", tokenizer,
             "--random-seed", "0", "--log-level", "warning", *server_flags]
    out = {"server": []}
    with LaunchedServer(serve, 1800) as server:
        info = fetch_server_info(server.url)
        vocab = min(info["scheduler_info"]["vocab_size"], 512)
        timed_batch(server.url, rng.integers(1, vocab, size=(max(args.batch_size), args.input_len)).tolist(), 8,
                    False)  # (first requests: nothing timed)
        for bs in args.batch_size:
            entry = {"batch_size": bs}
            for stream in (False, True):
                entry["stream" if stream else "plain"] = server_step_ms(
                    server.url, bs, args.input_len, vocab, args.server_tokens, args.repeats, stream, rng)
            out["server"].append(entry)
        final = wait_idle_info(lambda: fetch_server_info(server.url))
        out["step_stats"] = final["internal_states"][0]["step_stats"]
        out["compiles_after_warmup"] = final["internal_states"][0]["num_compiles_after_warmup"]
    return out


ROW_TIMES = ("decode_overlap_median_ms", "decode_median_ms", "decode_device_ms")


def combine_instances(instances: List[dict]) -> dict:
    """The result's rows over `instances` (each {"bench_rows", "server"} of one bench_one_batch process and one
    server): each bench row's times (`ROW_TIMES`) and each server step's ``median_ms`` the median over the
    instances' values (a row's other fields are the first instance's; an overlap time that is None anywhere stays
    None). Raises ValueError when the instances' batch sizes differ."""
    if len({tuple(r["batch_size"] for r in i["bench_rows"]) for i in instances}) != 1 or len(
            {tuple(e["batch_size"] for e in i["server"]) for i in instances}) != 1:
        raise ValueError("the instances measured different batch sizes")
    rows = []
    for k, row in enumerate(instances[0]["bench_rows"]):
        row = dict(row)
        for key in ROW_TIMES:
            vals = [i["bench_rows"][k].get(key) for i in instances]
            row[key] = None if any(v is None for v in vals) else float(np.median(vals))
        rows.append(row)
    server = []
    for k, entry in enumerate(instances[0]["server"]):
        entry = {"batch_size": entry["batch_size"]}
        for mode in ("plain", "stream"):
            meds = [i["server"][k][mode]["median_ms"] for i in instances]
            entry[mode] = {"median_ms": float(np.median(meds)), "instance_medians_ms": meds}
        server.append(entry)
    return {"bench_rows": rows, "server": server}


def run_benchmark(args, server_flags: List[str]) -> dict:
    bench_in, bench_out = bench_contexts(args.input_len, args.server_tokens)
    result = {"date": datetime.date.today().isoformat(), "cpu": cpu_name(), "model": args.model_path,
              "input_len": args.input_len, "server_tokens": list(args.server_tokens), "server_flags": server_flags,
              "bench_input_len": bench_in, "bench_output_len": bench_out}
    rng = np.random.default_rng(0)
    instances = []
    for n in range(args.instances):
        if args.instances > 1:
            print(f"instance {n + 1} of {args.instances}: bench_one_batch, then a server", flush=True)
        inst = {"bench_rows": bench_rows(args, server_flags, bench_in, bench_out)}
        inst.update(server_entries(args, server_flags, rng))
        instances.append(inst)
    if args.instances == 1:
        result.update(instances[0])
        return result
    result.update(combine_instances(instances))
    result["step_stats"] = instances[-1]["step_stats"]  # (the last server's: one server's histograms)
    result["compiles_after_warmup"] = max(i["compiles_after_warmup"] for i in instances)
    result["instances"] = instances
    return result


def bench_ref_ms(row: dict) -> float:
    """The bench step a server step is compared with (``x bench``): a bench row's overlapped step, or its step
    without overlap when the row has none."""
    return row["decode_overlap_median_ms"] or row["decode_median_ms"]


def instance_ratios(result: dict) -> List[str]:
    """Lines giving every instance's ``x bench`` per batch size (plain / streaming), for a result with
    ``instances``; [] for one instance."""
    if "instances" not in result:
        return []
    lines = [f"Each time above is the median over {len(result['instances'])} instances (a bench_one_batch process "
             "and a server each, one after the other); each instance's x bench (plain / streaming):", ""]
    for k, entry in enumerate(result["server"]):
        cells = []
        for inst in result["instances"]:
            ref = bench_ref_ms(inst["bench_rows"][k])
            s = inst["server"][k]
            cells.append(f"{s['plain']['median_ms'] / ref:.2f} / {s['stream']['median_ms'] / ref:.2f}")
        lines.append(f"- B = {entry['batch_size']}: " + ", ".join(cells))
    return lines + [""]


def format_table(result: dict) -> str:
    """The report's table, computed from the result alone."""
    by_bs = {r["batch_size"]: r for r in result["bench_rows"]}
    bench_in, bench_out = result["bench_input_len"], result["bench_output_len"]
    lines = [f"Model `{result['model']}`, {result['input_len']}-token prompts (random ids), greedy, ignore_eos; "
             f"server flags `{' '.join(result['server_flags']) or '(defaults)'}`; {result['cpu']}. Server step = "
             f"(wall(N2) - wall(N1)) / (N2 - N1) of B concurrent requests, N = {result['server_tokens']}: its "
             f"contexts are {bench_in}-{bench_in + bench_out} tokens, and bench_one_batch's rows decode there "
             f"too, greedy (--input-len {bench_in} --output-len {bench_out} --temperature 0).", "",
             "| B | bench step ms (overlap) | bench step ms (no overlap) | device ms | server step ms | x bench | "
             "server step ms (streaming) | x bench |", "|---|---|---|---|---|---|---|---|"]
    for s in result["server"]:
        b = by_bs[s["batch_size"]]
        ref = bench_ref_ms(b)
        plain, stream = s["plain"]["median_ms"], s["stream"]["median_ms"]
        lines.append(f"| {s['batch_size']} | {ref:.3f} | {b['decode_median_ms']:.3f} | {b['decode_device_ms']:.3f} | "
                     f"{plain:.3f} | {plain / ref:.2f} | {stream:.3f} | {stream / ref:.2f} |")
    st = result["step_stats"]
    med = {k: histogram_median(st[k]) for k in ("host_seconds", "device_wait_seconds", "steps_per_second")}
    run = "the last instance's run" if "instances" in result else "the whole run"
    lines += ["", *instance_ratios(result), f"Server loop over {run} (scheduler/step_stats.py, the bucket holding the "
              f"median): host <= {med['host_seconds']} s, device wait <= {med['device_wait_seconds']} s a step, <= "
              f"{med['steps_per_second']} steps/s; programs compiled after warm-up: {result['compiles_after_warmup']}."]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, server_flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=DEFAULT_MODEL)
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--input-len", type=int, default=192)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 16])
    p.add_argument("--server-tokens", type=int, nargs=2, default=[32, 160], metavar=("N1", "N2"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--instances", type=int, default=1,
                   help="bench_one_batch processes and servers, one after the other; times are medians over them")
    p.add_argument("--output-file", default=None)
    p.add_argument("--report", default=None)
    a = p.parse_args(ours)
    if a.instances < 1:
        p.error("--instances: at least 1")
    result = run_benchmark(a, server_flags)
    publish_result("sgl_jax.bench_hot_loop", argv, result, "The hot loop: bench_one_batch beside the server",
                   format_table, a.output_file, a.report)


if __name__ == "__main__":
    main()
