"""bench_buckets (python -m sgl_jax.bench_buckets): the cost models of candidate bucket sets against hand-computed
values, and one run on a tiny random Llama whose default buckets (powers of two up to a 128-token chunk: 64, 128)
are each compiled with an empty cache, loaded back from it and timed, into a generated report."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest

from sgl_jax.bench_buckets import candidate_sets, cut_ms, padded_ms, program_composition, relative_cost, report_body
from sgl_jax.srt.model_executor.buckets import powers_of_two
from srt_helpers import save_tiny_llama, server_env


def test_candidate_sets_end_with_the_largest_bucket():
    tokens = [64, 128, 256, 512, 1024, 2048]
    assert candidate_sets(tokens) == [tuple(tokens), (64, 256, 1024, 2048), (64, 512, 2048), (64, 2048), (2048,)]
    assert candidate_sets([64, 128]) == [(64, 128), (128,)]
    assert powers_of_two(64, 2048) == tokens and powers_of_two(64, 100) == [64, 128]


def test_padded_and_cut_costs():
    step = {2: 10.0, 4: 12.0, 8: 30.0}
    # one padded step: n = 1..2 -> 2, 3..4 -> 4, 5..8 -> 8
    assert padded_ms([2, 4, 8], step) == [0.0, 10, 10, 12, 12, 30, 30, 30, 30]
    assert padded_ms([8], step)[1:] == [30.0] * 8
    # cut as the scheduler cuts (ShapeBuckets.extend_cut: more than the smallest bucket's tokens saved)
    cut = cut_ms([4, 16, 64], {4: 10.0, 16: 12.0, 64: 30.0})
    assert cut[3] == 10 and cut[16] == 12 and cut[64] == 30  # fits a bucket: one step
    assert cut[5] == 20  # 4 + 1 (8 tokens computed, not 16)
    assert cut[17] == 22 and cut[20] == 22  # 16 + the rest in 4 (20 tokens, not 64)
    assert cut[21] == 32  # 16, then 5 as 4 + 1
    assert cut[30] == 24  # 16 + 14 in a 16 step
    assert cut[33] == 30  # 16 + 17 would need a 64 step again: one 64 step
    rel = relative_cost(padded_ms([8], step), padded_ms([2, 4, 8], step))
    ratios = [3.0, 3.0, 2.5, 2.5, 1.0, 1.0, 1.0, 1.0]
    assert rel["uniform"] == pytest.approx(sum(ratios) / 8)
    weights = [1 / n for n in range(1, 9)]
    assert rel["log_uniform"] == pytest.approx(sum(w * r for w, r in zip(weights, ratios)) / sum(weights))
    assert (rel["worst"], rel["worst_n"]) == (3.0, 1)


def test_program_composition_counts_the_attention_and_the_ynn_fusions():
    """A compiled program with a named ``ragged_paged_attention`` call: its instructions counted in every computation
    (fused ones too), the attention's by their op_name, the matmuls in YNNPACK fusions (XLA's CPU default)."""
    import jax
    import jax.numpy as jnp

    @functools.partial(jax.named_call, name="ragged_paged_attention")
    def attention(q, k):
        return jax.nn.softmax(q @ k.T) @ k

    def program(x, w, k, attend: bool):
        h = jnp.tanh(x @ w)
        return (attention(h, k) if attend else h).sum()

    args = (jnp.ones((8, 16)), jnp.ones((16, 16)), jnp.ones((8, 16)))
    with_attention, without = (program_composition(jax.jit(program, static_argnums=3).lower(*args, a).compile()
                                                   .as_text()) for a in (True, False))
    assert with_attention["instructions"] > with_attention["named_instructions"] > with_attention[
        "attention_instructions"] > 0
    assert without["attention_instructions"] == 0 and 0 < without["instructions"] < with_attention["instructions"]
    assert with_attention["ynn_fusions"] > without["ynn_fusions"] > 0  # (the attention's two matmuls add theirs)


def test_bench_buckets_tiny(tmp_path_factory, tmp_path):
    model, tok = save_tiny_llama(tmp_path_factory.mktemp("model"))
    report = tmp_path / "buckets.md"
    proc = subprocess.run([sys.executable, "-m", "sgl_jax.bench_buckets", "--model-path", model, "--tokenizer-path",
                           tok, "--context-length", "256", "--chunked-prefill-size", "128", "--max-total-tokens", "1024",
                           "--max-running-requests", "4", "--repeats", "1", "--report", str(report)],
                          capture_output=True, text=True, env=server_env({"JAX_PLATFORMS": "cpu"}), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    raw = json.loads(report.with_suffix(".json").read_text())
    rows = raw["buckets"]
    assert [(r["T"], r["S"]) for r in rows] == [(64, 4), (128, 4)]
    for r in rows:
        assert r["xla_s"] > 0 and r["load_s"] > 0 and r["trace_s"] > 0 and r["step_ms"] > 0
        assert r["loaded_from_cache"] == 1
        assert r["instructions"] > r["named_instructions"] > r["attention_instructions"] > 0 and r["ynn_fusions"] > 0
    md = report.read_text()
    assert "python -m sgl_jax.bench_buckets" in md and report_body(raw) in md
    assert "| 64, 128 | 2 |" in md and "| 128 | 1 |" in md
    assert "| 64 |" in proc.stdout and "| 128 |" in proc.stdout
