"""The streaming-session benchmark (python/sgl_jax/bench_sessions.py) at small scale: a tiny random Gemma 3
(window 16 on 2 of 3 layers), an SWA pool of 139 tokens under pressure, 6 turns.

The session's turn t prefills only its new ids and the previous turn's last token; the stateless request of
the same history prefills more once the radix cache has evicted its window's SWA KV (at least the new ids plus
a window from turn 3 on); both generate the same tokens; no memory error (read from the raw /get_server_info the
result saves), and that end state passes every test server's teardown checks (`srt_helpers.check_clean_info`: the
server ran with the exact page-ownership check; the benchmark checks its exit 0 and that no process is left).
Floors use the machine rates measured in the run (never a constant). (TTFT is printed, not
asserted: on a model this small it is mostly fixed per-request cost.)
"""

from __future__ import annotations

from sgl_jax.bench_sessions import TABLE_HEADER, format_table, prefill_floor_ms, run_benchmark
from sgl_jax.bench_utils import MachineRates
from srt_helpers import check_clean_info, save_tiny_gemma3, server_env

W, TURN = 16, 20


def test_session_turns_prefill_only_new_tokens(tmp_path):
    model, tokenizer = save_tiny_gemma3(tmp_path / "tiny_gemma3_bench_sessions", window=W)
    result = run_benchmark(model, tokenizer, turns=6, first_turn_tokens=100, turn_tokens=TURN, new_tokens=6,
                           max_total_tokens=1024, swa_full_tokens_ratio=0.05, chunked_prefill_size=32,
                           context_length=1024, pressure_requests=4, pressure_tokens=60,
                           extra_server_args=["--precompile-token-paddings", "32"], env=server_env())
    table = format_table(result)
    print(table)
    assert TABLE_HEADER in table and result["memory_errors"] == 0 and result["swa_tokens_total"] == 139
    rows = result["rows"]
    assert all(r["same_tokens"] for r in rows)
    for r in rows[1:]:
        assert r["session_prefilled"] == TURN + 1, r
    for r in rows[2:]:
        assert r["stateless_prefilled"] >= TURN + W, r
    # the claims come from the saved raw server output; the floors from the rates measured in the run
    end = result["server_info"]["end"]["internal_states"]
    assert result["memory_errors"] == sum(st["memory_errors"] for st in end) == 0
    check_clean_info(result["server_info"]["end"])  # every test server's teardown checks, on the saved end state
    assert result["server_info"]["start"]["internal_states"][0]["swa_tokens_total"] == 139
    assert "memory_errors 0" in table and "GB/s" in table
    rates = MachineRates.from_json(result["rates"])
    assert rates.matmul_gflops > 0 and rates.memory_gbps > 0
    for r in rows:
        assert r["session_floor_ms"] == prefill_floor_ms(rates, result["nonembedding_params"],
                                                         result["lm_head_params"], r["session_prefilled"], 32)
    for r in rows[2:]:  # more tokens prefilled, a higher floor
        assert 0 < r["session_floor_ms"] < r["stateless_floor_ms"], r
