"""bench_one_batch (python -m sgl_jax.bench_one_batch) at small scale on a tiny random Llama: every row is
measured through the real ModelRunner and scheduler structures, the floors are computed from the model's
shapes and the machine rates measured in the same run (bench_utils.measure_machine_rates, never a constant),
nothing compiles after warm-up, no KV page leaks (the script asserts it), and the generated report (.md and
.json) holds the table, computed from its raw rows, and the command that reproduces it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sgl_jax.bench_one_batch import report_body
from srt_helpers import save_tiny_llama, server_env

# tiny Llama: 2 layers, hidden 64, 4 heads of 16, 2 KV heads, MLP 128, tied 49,152 x 64 embedding
LAYER_PARAMS = 4 * 64 * 64 // 1 - 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64  # q,o 64x64; k,v 64x32; MLP; 2 norms
TOKEN_PARAMS = 2 * LAYER_PARAMS + 64  # + final norm
KV_BYTES = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, float32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("model"))


def run_bench(tiny, tmp_path, *args: str) -> list:
    """``python -m sgl_jax.bench_one_batch`` on the tiny model with `args`, its JSONL in tmp_path/rows.jsonl and its
    report tmp_path/report.md; returns the rows."""
    model, tok = tiny
    jsonl = tmp_path / "rows.jsonl"
    args = ["--model-path", model, "--tokenizer-path", tok, "--context-length", "256", "--chunked-prefill-size", "64",
            "--result-filename", str(jsonl), "--report", str(tmp_path / "report.md"), *args]
    proc = subprocess.run([sys.executable, "-m", "sgl_jax.bench_one_batch", *args], capture_output=True, text=True,
                          env=server_env({"JAX_PLATFORMS": "cpu"}), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in jsonl.read_text().splitlines()]


def test_bench_one_batch_tiny(tiny, tmp_path):
    report = tmp_path / "report.md"
    rows = run_bench(tiny, tmp_path, "--precompile-token-paddings", "64", "128", "--batch-size", "1", "3",
                     "--input-len", "40", "--output-len", "3", "--warmup-steps", "1", "--decode-repeats", "2",
                     "--compilation-cache-dir", str(tmp_path / "cache"))
    assert [(r["batch_size"], r["input_len"]) for r in rows] == [(1, 40), (3, 40)]
    one, three = rows
    assert one["prefill_steps"] == 1 and three["prefill_steps"] == 2  # 120 prompt tokens, 64 per step
    for r in rows:
        assert r["compiles_after_warmup"] == 0
        assert r["prefill_latency_s"] > 0 and r["decode_median_ms"] > 0 and r["decode_p90_ms"] >= r["decode_median_ms"]
        assert r["decode_x_floor"] == pytest.approx(r["decode_median_ms"] / r["decode_floor_ms"], rel=1e-9)
        # the device's own time per step, without the host's share: positive, and the loop's share of it
        assert 0 < r["decode_device_ms"] and r["decode_busy_share"] > 0
        assert r["decode_busy_share"] == pytest.approx(r["decode_device_ms"] / r["decode_median_ms"], rel=1e-9)
        assert r["decode_host_gap_ms"] == pytest.approx(r["decode_median_ms"] - r["decode_device_ms"], rel=1e-9)
        assert r["decode_bound"] == "B" and r["kv_dtype"] == "float32"
        # the overlap scheduler's loop over the same row: the same tokens, its own step time and busy share
        assert r["tokens_identical"] is True and r["decode_overlap_median_ms"] > 0
        # two passes of each loop: 3 timed launches without overlap, 2 with (its first launch applies nothing)
        assert (r["decode_repeats"], r["decode_iterations_timed"], r["overlap_iterations_timed"]) == (2, 6, 4)
        assert r["overlap_speedup"] == pytest.approx(r["decode_median_ms"] / r["decode_overlap_median_ms"], rel=1e-9)
        assert r["decode_busy_share_overlap"] == pytest.approx(r["decode_device_ms"] / r["decode_overlap_median_ms"],
                                                               rel=1e-9)
    # decode floor: weights read once (the tied embedding is the lm-head) + per sequence its KV after the step
    # (context c) read and 1 token written; FLOPs 2 x token params + 2 x lm-head + attention 4 x heads x dim x c
    # per layer. The median timed step follows prefill (40 tokens) and 1 warm-up step: c is 42 to 44.
    weights = (49152 * 64 + TOKEN_PARAMS) * 4
    kv_one = one["decode_step_bytes"] - weights
    assert kv_one % KV_BYTES == 0 and 43 <= kv_one // KV_BYTES <= 45, kv_one
    c = kv_one // KV_BYTES - 1
    assert three["decode_step_bytes"] - weights == 3 * kv_one
    assert one["decode_step_flops"] == 2 * TOKEN_PARAMS + 2 * 49152 * 64 + 2 * 4 * 4 * 16 * c
    # the floors use the rates measured in this run: max(FLOPs / matmul rate, bytes / memory rate)
    rates = one["rates"]
    assert rates["matmul_gflops"] > 0 and rates["memory_gbps"] > 0 and "float32" in rates["matmul_probe"]
    assert all(r["rates"] == rates for r in rows)
    for r in rows:
        t_flop = r["decode_step_flops"] / (rates["matmul_gflops"] * 1e9)
        t_byte = r["decode_step_bytes"] / (rates["memory_gbps"] * 1e9)
        assert r["decode_floor_ms"] == pytest.approx(1e3 * max(t_flop, t_byte), rel=1e-12)
    text = report.read_text()
    assert "python -m sgl_jax.bench_one_batch " in text and "--batch-size 1 3" in text
    assert text.count("\n| 1 | 40 | 3 |") == 1 and text.count("\n| 3 | 40 | 3 |") == 1
    assert f"{rates['matmul_gflops']:.1f} GFLOP/s" in text and f"{rates['memory_gbps']:.1f} GB/s" in text
    raw = json.loads((tmp_path / "report.json").read_text())
    assert raw["rows"] == rows and raw["command"] in text
    assert report_body(raw) in text  # the .md is computed from its .json alone
    assert "Programs compiled after warm-up, over every row (the runner's count): 0." in text


def test_disable_precompile_reports_compiles_as_not_counted(tiny, tmp_path):
    """--disable-precompile runs no warm-up, so the runner counts no compiles: every row says null and the report
    "not counted", never a 0 that would claim nothing compiled."""
    rows = run_bench(tiny, tmp_path, "--disable-precompile", "--batch-size", "1", "--input-len", "8",
                     "--output-len", "1", "--warmup-steps", "0")
    assert rows and all(r["compiles_after_warmup"] is None for r in rows), rows
    text = (tmp_path / "report.md").read_text()
    assert "Programs compiled after warm-up, over every row (the runner's count): not counted" in text, text


def test_moe_floors_count_active_parameters(tmp_path):
    """A mixture of experts' floors: each token multiplies k of the E experts' weights (FLOPs), and a step reads
    the expert weights its tokens are expected to reach (bytes), under --moe-backend ragged_dot."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from sgl_jax.srt.configs.model_config import resolve_model_path
    from srt_helpers import default_model_path

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=49152, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                         num_experts_per_tok=2, tie_word_embeddings=False, max_position_embeddings=512)
    Qwen3MoeForCausalLM(cfg).save_pretrained(tmp_path / "moe")
    tiny = (str(tmp_path / "moe"), resolve_model_path(default_model_path()).hf_dir)
    one, = run_bench(tiny, tmp_path, "--precompile-token-paddings", "64", "--batch-size", "1", "--input-len", "20",
                     "--output-len", "2", "--warmup-steps", "1", "--moe-backend", "ragged_dot")
    attention, norms, router, experts = 2 * 64 * 64 + 2 * 64 * 32, 2 * 64 + 2 * 16, 8 * 64, 3 * 8 * 64 * 32
    active = 2 * (attention + norms + router + experts * 2 // 8) + 64
    for c in range(20, 26):  # the context the median step attends over (prefill + warm-up + its position)
        if one["decode_step_flops"] == 2 * active + 2 * 49152 * 64 + 2 * 4 * 4 * 16 * c:
            break
    else:
        pytest.fail(f"decode FLOPs {one['decode_step_flops']} are not those of {active} active parameters")
    reached = 1 - (1 - 1 / 8) ** 2  # one token, top 2 of 8
    weights = (2 * (attention + norms + router) + 64 + 49152 * 64) * 4 + 2 * experts * 4 * reached
    step_bytes = one["decode_step_bytes"]  # the weights' share plus the KV read (c tokens) and written (1)
    assert step_bytes - weights == pytest.approx(2 * 2 * 2 * 16 * 4 * (c + 1), abs=1.0), (step_bytes, weights)


def test_sampling_flags_are_checked(capsys):
    """--temperature, --top-p and --top-k are checked when the flags are read: a value out of range exits with
    argparse's error naming the flags; valid ones reach every request's sampling."""
    from sgl_jax.bench_one_batch import parse_args

    for bad in (["--temperature", "-1"], ["--temperature", "inf"], ["--top-p", "0"], ["--top-p", "1.5"],
                ["--top-k", "-2"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
        assert "--temperature must be a finite value >= 0, --top-p in (0, 1]" in capsys.readouterr().err
    _, args = parse_args(["--temperature", "0.8", "--top-p", "0.95", "--top-k", "20"])
    assert (args.temperature, args.top_p, args.top_k) == (0.8, 0.95, 20)
