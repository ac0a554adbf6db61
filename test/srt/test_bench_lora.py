"""The LoRA cost benchmark (python/sgl_jax/bench_lora.py) at small scale: a tiny random Llama, 2 rank-8 adapters,
both real servers.

- every round serves all its output tokens on both servers, and the ratio is lora / base of the round's rates;
- the run-time load reports its times, and the slot bytes equal the adapter's float32 weights (all 7 projections
  of every layer, rank 8); the LoRA server's weights are the base's plus its 2 slots;
- the op timings cover both backends;
- both servers end as every test server must (`check_clean_info` on the saved end states: idle, KV at rest, no
  compile after warm-up).
"""

from __future__ import annotations

import pytest

from srt_helpers import check_clean_info, save_tiny_llama, server_env
from sgl_jax.bench_lora import format_table, run_benchmark

RANK, ADAPTERS = 8, 2


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    model, tokenizer = save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_bench_lora"))
    return run_benchmark(model, tokenizer, num_adapters=ADAPTERS, rank=RANK, batch=4, input_len=16, output_len=8,
                         rounds=1, env=server_env())


def test_rounds_and_table(result):
    print(format_table(result))
    (r,) = result["rounds"]
    for side in ("base", "lora"):
        assert r[side]["output_tokens"] == 4 * 8 and r[side]["tokens_per_s"] > 0
    assert r["ratio"] == round(r["lora"]["tokens_per_s"] / r["base"]["tokens_per_s"], 3)
    assert "| 1 |" in format_table(result) and {o["tokens"] for o in result["ops"]} == {16, 2048}
    assert all(o["lora dense"] > 0 and o["lora ragged"] > 0 for o in result["ops"])


def test_load_and_memory(result):
    ld = result["load"]
    # tiny Llama: 2 layers; q 64->64, k/v 64->32, o 64->64, gate/up 64->128, down 128->64; A [8, in] + B [8, out]
    per_layer = sum(i + o for i, o in ((64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)))
    assert ld["slot_bytes"] == 2 * per_layer * RANK * 4
    assert ld["weight_bytes_lora"] == ld["weight_bytes_base"] + ADAPTERS * ld["slot_bytes"]
    assert ld["load_request_ms"] > 0 and ld["slot_write_ms"] > 0


def test_servers_end_clean(result):
    for side in ("base", "lora"):
        check_clean_info(result["server_info"][side])
