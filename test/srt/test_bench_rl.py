"""The RL endpoints benchmark (python/sgl_jax/bench_rl.py) at small scale: a tiny random Llama, one round.

- the update, release and resume calls all succeed and report their times;
- the bytes released are the KV pool's (and, with the weights, the weights' too) as the server reports them;
- the greedy output is identical before and after (same weights), and the server ends clean (idle, KV at rest, no
  compile after warm-up).
"""

from __future__ import annotations

from srt_helpers import check_clean_info, save_tiny_llama, server_env
from sgl_jax.bench_rl import format_table, run_benchmark


def test_bench_rl_small(tmp_path_factory):
    model, tokenizer = save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_bench_rl"))
    result = run_benchmark(model, rounds=1, max_total_tokens=4096,
                           extra_args=["--tokenizer-path", tokenizer], env=server_env())
    print(format_table(result))
    (r,) = result["rounds"]
    # every call's wall time, and the server's own time (ms rounded to 0.1: a KV release of ~2 MiB can take under
    # 0.05 ms and read 0.0)
    assert all(r[k] > 0 for k in r if k.endswith("_wall_ms")), r
    assert all(r[k] >= 0 for k in r if k.endswith("_server_ms")), r
    assert {k for k in r if k.endswith("_ms")} == {f"{p}_{s}_ms" for p in ("update", "release_kv", "resume_kv",
                                                                           "release_all", "resume_all")
                                                   for s in ("wall", "server")}, r
    # K and V of 2 layers, [4096 tokens + the padding page, 2 KV heads, head_dim 16] float32
    kv = 2 * 2 * (4096 + 1) * 2 * 16 * 4
    assert r["release_kv_bytes"] == kv
    assert r["release_all_bytes"] == kv + result["weight_bytes_per_device"]
    assert result["outputs_identical"] and "| 1 |" in format_table(result)
    check_clean_info(result["server_info"])
