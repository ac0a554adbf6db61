"""What the host-memory tier of the prefix cache (--enable-hierarchical-cache) buys on a prefix-caching workload
whose prefixes overflow the device KV pool: prompt tokens recomputed and TTFT, tier off against tier on, the same
requests on the same machine in one run.

``python -m sgl_jax.bench_hicache [--model-path PATH] [--groups 4] [--prefix-len 1024] [--suffix-len 64]
[--rounds 4] [--output-len 16] [--max-total-tokens N] [--hicache-ratio 4] [--output-file result.json |
--report NAME.md]``

The workload is bench_serving's prefix_caching shape (a long shared prefix, short distinct suffixes) with
``--groups`` prefixes instead of one: each request is group g's prefix plus its own suffix, sent one at a time,
group after group, ``--rounds`` times over. The device pool (default: room for about two requests) cannot keep
every prefix, so with least-recently-used eviction a prefix is gone from the device by the time its group comes
round again; the host pool (--hicache-ratio x the device pool) keeps them all. Round 1 is cold on both servers;
the table sums rounds 2 and later: prompt tokens, tokens served from the prefix cache (device or host), tokens
recomputed (the difference), the host tier's loaded-back tokens, and TTFT per request. Both servers must end
clean (idle, both pools at rest, no compile after warm-up).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import random
import statistics
from typing import List, Optional

from sgl_jax.bench_serving import RequestSpec, corpus_token_ids, load_tokenizer_for, send_request
from sgl_jax.bench_utils import LaunchedServer, cpu_name, fetch_server_info, publish_result, wait_idle_info


def make_specs(tokenizer, groups: int, prefix_len: int, suffix_len: int, rounds: int, output_len: int,
               seed: int = 0) -> List[tuple]:
    """(round, group, RequestSpec) of every request in sending order: rounds x groups, each group's prefix
    (`prefix_len` corpus tokens) and a new `suffix_len`-token suffix per request."""
    corpus = corpus_token_ids(tokenizer)
    rng = random.Random(f"{seed}-hicache")

    def passage(n: int) -> list:
        start = rng.randrange(0, len(corpus) - n)
        return list(corpus[start:start + n])

    prefixes = [passage(prefix_len) for _ in range(groups)]
    specs = []
    for r in range(rounds):
        for g in range(groups):
            ids = prefixes[g] + passage(suffix_len)
            specs.append((r, g, RequestSpec(tokenizer.decode(ids), len(ids), output_len, None)))
    return specs


async def _run(url: str, specs: List[tuple]) -> list:
    import httpx

    rows = []
    async with httpx.AsyncClient(timeout=3600) as client:
        for r, g, spec in specs:
            res = await send_request(client, url, "sgl-jax", "default", spec)
            if not res.ok:
                raise RuntimeError(f"round {r} group {g}: {res.error}")
            rows.append({"round": r, "group": g, "prompt_tokens": res.prompt_tokens,
                         "cached_tokens": res.cached_tokens or 0, "ttft_ms": round(1000 * res.ttft_s, 2)})
    return rows


def summarize(rows: List[dict], state: dict) -> dict:
    """Rounds 2 and later of one server: token sums, TTFT statistics (ms), the host tier's counts."""
    warm = [x for x in rows if x["round"] > 0]
    ttft = [x["ttft_ms"] for x in warm]
    prompt = sum(x["prompt_tokens"] for x in warm)
    cached = sum(x["cached_tokens"] for x in warm)
    return {"requests": len(warm), "prompt_tokens": prompt, "cached_tokens": cached, "recomputed_tokens": prompt - cached,
            "host_hit_tokens": state.get("host_hit_tokens"), "ttft_mean_ms": round(statistics.mean(ttft), 1),
            "ttft_median_ms": round(statistics.median(ttft), 1), "ttft_max_ms": round(max(ttft), 1)}


def run_benchmark(model_path: Optional[str] = None, tokenizer_path: Optional[str] = None, groups: int = 4,
                  prefix_len: int = 1024, suffix_len: int = 64, rounds: int = 4, output_len: int = 16,
                  max_total_tokens: Optional[int] = None, hicache_ratio: float = 4.0,
                  extra_args: Optional[List[str]] = None, env: Optional[dict] = None,
                  start_timeout: float = 1200.0) -> dict:
    """Both servers over the same requests (module docstring); returns the raw result."""
    from sgl_jax.srt.configs.model_config import resolve_model_path

    resolved = resolve_model_path(model_path)
    tokenizer = load_tokenizer_for(tokenizer_path or model_path)
    specs = make_specs(tokenizer, groups, prefix_len, suffix_len, rounds, output_len)
    per_request = prefix_len + suffix_len + output_len
    kv_tokens = max_total_tokens or int(2.5 * per_request)
    args = ["--model-path", resolved.model_path, "--random-seed", "0", "--log-level", "warning",
            "--max-total-tokens", str(kv_tokens), *(["--tokenizer-path", tokenizer_path] if tokenizer_path else []),
            *(extra_args or [])]
    result = {"date": datetime.date.today().isoformat(), "cpu": cpu_name(), "model": resolved.model_path,
              "groups": groups, "prefix_len": prefix_len, "suffix_len": suffix_len, "rounds": rounds,
              "output_len": output_len, "device_kv_tokens": kv_tokens, "hicache_ratio": hicache_ratio, "servers": {}}
    for name, flags in (("tier off", []),
                        ("tier on", ["--enable-hierarchical-cache", "--hicache-ratio", str(hicache_ratio)])):
        with LaunchedServer(args + flags, start_timeout, env) as server:
            rows = asyncio.run(_run(server.url, specs))
            info = wait_idle_info(lambda: fetch_server_info(server.url))
            state = info["internal_states"][0]
            result["servers"][name] = {"rows": rows, "summary": summarize(rows, state), "server_info": info}
    return result


def format_table(result: dict) -> str:
    """The report's table, computed from the result alone."""
    s = {k: v["summary"] for k, v in result["servers"].items()}
    lines = [f"Model `{result['model']}`: {result['groups']} prefixes of {result['prefix_len']} tokens, a "
             f"{result['suffix_len']}-token suffix and {result['output_len']} output tokens per request, "
             f"{result['rounds']} rounds sent one request at a time; device KV pool {result['device_kv_tokens']} "
             f"tokens, host pool {result['hicache_ratio']} x that. Rounds 2-{result['rounds']} "
             f"({s['tier off']['requests']} requests):", "",
             "| | prompt tokens | from the prefix cache | recomputed | loaded back from host | TTFT mean ms | "
             "TTFT median ms | TTFT max ms |", "|---|---|---|---|---|---|---|---|"]
    for name, x in s.items():
        lines.append(f"| {name} | {x['prompt_tokens']} | {x['cached_tokens']} | {x['recomputed_tokens']} | "
                     f"{x['host_hit_tokens'] if x['host_hit_tokens'] is not None else '-'} | {x['ttft_mean_ms']} | "
                     f"{x['ttft_median_ms']} | {x['ttft_max_ms']} |")
    off, on = s["tier off"], s["tier on"]
    lines += ["", f"Tier on / tier off: recomputed tokens {on['recomputed_tokens'] / max(off['recomputed_tokens'], 1):.3f}"
              f"x, TTFT median {on['ttft_median_ms'] / off['ttft_median_ms']:.3f}x."]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--hicache-ratio", type=float, default=4.0)
    p.add_argument("--output-file", default=None)
    p.add_argument("--report", default=None)
    a = p.parse_args(argv)
    if a.rounds < 2 or a.groups < 1:
        p.error("--rounds must be at least 2 (round 1 is cold) and --groups at least 1")
    result = run_benchmark(a.model_path, a.tokenizer_path, a.groups, a.prefix_len, a.suffix_len, a.rounds,
                           a.output_len, a.max_total_tokens, a.hicache_ratio)
    publish_result("sgl_jax.bench_hicache", argv, result, "Host-memory prefix tier: recomputed tokens and TTFT",
                   format_table, a.output_file, a.report)


if __name__ == "__main__":
    main()
