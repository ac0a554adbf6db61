"""The sliding-window KV memory benchmark (python/sgl_jax/bench_swa_memory.py) at small scale: a tiny random
Gemma 3 (window 16 on 2 of 3 layers), a 1,024-token budget, 256-token requests, both real servers.

- (a) bytes per token from the config: one pool 3 layers x K,V x 2 KV heads x 16 x 4 bytes; hybrid 1 layer in
  the full pool, 2 in the SWA pool; both servers' pools take the same memory (the budget);
- (b) one pool admits exactly the requests whose full length fits the budget (1,024 / 256 = 4); hybrid at
  ratio 0.25 (full pool 2,048 tokens, SWA pool 512) admits at least twice as many, with no memory error;
- every row's claims (pools, peak, retractions, memory errors) are read from the raw /get_server_info it keeps;
- both servers end as every test server must (`srt_helpers.check_clean_info` on the saved end state: idle =
  free + cached in both pools, no memory error under the exact check, no compile after warm-up), exit 0 and
  leave no process behind (the benchmark's `bench_utils.LaunchedServer` checks that).
"""

from __future__ import annotations

import pytest

from srt_helpers import check_clean_info, save_tiny_gemma3, server_env
from sgl_jax.bench_swa_memory import TABLE_HEADER, format_table, run_benchmark

BUDGET, REQUEST_LEN = 1024, 256
BYTES_PER_LAYER_TOKEN = 2 * 2 * 16 * 4  # K and V, 2 KV heads, head_dim 16, float32


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    model, tokenizer = save_tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3_bench"), window=16)
    return run_benchmark(model, tokenizer, max_total_tokens=BUDGET, swa_full_tokens_ratio=0.25,
                         chunked_prefill_size=32, request_len=REQUEST_LEN, new_tokens=64, num_requests_one_pool=6,
                         num_requests_hybrid=12, max_running_requests=16, env=server_env())


def test_kv_bytes_per_token(result):
    one, hybrid = result["rows"]
    assert one["full_bytes_per_token"] == 3 * BYTES_PER_LAYER_TOKEN and one["swa_tokens"] == 0
    assert (hybrid["full_bytes_per_token"], hybrid["swa_bytes_per_token"]) == (BYTES_PER_LAYER_TOKEN,
                                                                                2 * BYTES_PER_LAYER_TOKEN)
    assert (hybrid["full_tokens"], hybrid["swa_tokens"]) == (2048, 512)
    assert one["pool_bytes"] == hybrid["pool_bytes"] == BUDGET * 3 * BYTES_PER_LAYER_TOKEN
    # a decoding request keeps SWA KV for at most the window plus two pages
    assert hybrid["request_bytes"] == REQUEST_LEN * BYTES_PER_LAYER_TOKEN + 18 * 2 * BYTES_PER_LAYER_TOKEN


def test_concurrent_requests(result):
    one, hybrid = result["rows"]
    print(format_table(result))
    assert one["peak_running_reqs"] == BUDGET // REQUEST_LEN
    assert hybrid["peak_running_reqs"] >= 2 * one["peak_running_reqs"]
    assert one["memory_errors"] == hybrid["memory_errors"] == 0
    assert TABLE_HEADER in format_table(result)


def test_claims_come_from_the_raw_server_info(result):
    table = format_table(result)
    for r in result["rows"]:
        start, end = (r["server_info"][k]["internal_states"][0] for k in ("start", "end"))
        assert (r["full_tokens"], r["peak_running_reqs"], r["retracted"], r["memory_errors"]) == (
            start["kv_tokens_total"], end["peak_running_reqs"], end["num_retracted_reqs"], end["memory_errors"])
        assert r["swa_tokens"] == start.get("swa_tokens_total", 0)
    assert table.count("memory_errors 0") == 2


def test_both_servers_end_clean(result):
    """The teardown checks of every test server, on the end state each run saved (its servers ran with the exact
    page-ownership check; the benchmark itself checked that each stopped with exit 0 and left no process)."""
    for r in result["rows"]:
        check_clean_info(r["server_info"]["end"])
