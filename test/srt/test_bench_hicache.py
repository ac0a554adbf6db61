"""The host-tier benchmark (python/sgl_jax/bench_hicache.py) at small scale: a tiny random Llama, 3 prefixes of 256
tokens over a device pool that holds about two requests, 2 rounds.

- tier off recomputes every repeated prefix (least-recently-used eviction has dropped each by the time its group
  comes round); tier on loads them back from the host pool and recomputes that many tokens fewer;
- both servers end clean (idle, both pools at rest, no compile after warm-up) and the table renders.
"""

from __future__ import annotations

from srt_helpers import check_clean_info, save_tiny_llama, server_env
from sgl_jax.bench_hicache import format_table, run_benchmark

GROUPS, PREFIX = 3, 256


def test_bench_hicache_small(tmp_path_factory):
    model, tokenizer = save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_bench_hicache"), init_std=0.2)
    result = run_benchmark(model, tokenizer, groups=GROUPS, prefix_len=PREFIX, suffix_len=16, rounds=2, output_len=4,
                           extra_args=["--precompile-token-paddings", "64", "512", "--chunked-prefill-size", "512",
                                       "--precompile-bs-paddings", "1", "4", "--max-running-requests", "4",
                                       "--disable-precompile"],  # (two servers: the shapes used compile on use)
                           env=server_env())
    table = format_table(result)
    print(table)
    off, on = (result["servers"][k]["summary"] for k in ("tier off", "tier on"))
    assert off["requests"] == on["requests"] == GROUPS and off["prompt_tokens"] == on["prompt_tokens"]
    assert off["cached_tokens"] < PREFIX and off["host_hit_tokens"] is None  # (round 2 finds no prefix on device)
    assert on["host_hit_tokens"] >= (GROUPS - 1) * (PREFIX - 8), on  # (the prefix less a few boundary tokens)
    assert on["cached_tokens"] >= on["host_hit_tokens"]  # (loaded back = served from the cache, not recomputed)
    assert off["recomputed_tokens"] - on["recomputed_tokens"] >= on["host_hit_tokens"] - off["cached_tokens"]
    assert "| tier on |" in table and "Tier on / tier off" in table
    for server in result["servers"].values():
        check_clean_info(server["server_info"])
