"""bench_buckets (python -m sgl_jax.bench_buckets): the cost models of candidate bucket sets against hand-computed
values, and one run on a tiny random Llama whose default buckets (powers of two up to a 128-token chunk: 64, 128)
are each compiled with an empty cache, loaded back from it and timed, into a generated report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sgl_jax.bench_buckets import candidate_sets, padded_ms, relative_cost, report_body, split_ms
from srt_helpers import save_tiny_llama, server_env


def test_candidate_sets_end_with_the_largest_bucket():
    tokens = [64, 128, 256, 512, 1024, 2048]
    assert candidate_sets(tokens) == [tuple(tokens), (64, 256, 1024, 2048), (64, 512, 2048), (64, 2048), (2048,)]
    assert candidate_sets([64, 128]) == [(64, 128), (128,)]


def test_padded_and_split_costs():
    step = {2: 10.0, 4: 12.0, 8: 30.0}
    # one padded step: n = 1..2 -> 2, 3..4 -> 4, 5..8 -> 8
    assert padded_ms([2, 4, 8], step) == [0.0, 10, 10, 12, 12, 30, 30, 30, 30]
    assert padded_ms([8], step)[1:] == [30.0] * 8
    # split: 5..6 tokens as 4 + 2 (22 ms) beat one 8 step (30); 7..8 as 4 + 4 (24)
    assert split_ms([2, 4, 8], step) == [0.0, 10, 10, 12, 12, 22, 22, 24, 24]
    rel = relative_cost(padded_ms([8], step), padded_ms([2, 4, 8], step))
    ratios = [3.0, 3.0, 2.5, 2.5, 1.0, 1.0, 1.0, 1.0]
    assert rel["uniform"] == pytest.approx(sum(ratios) / 8)
    weights = [1 / n for n in range(1, 9)]
    assert rel["log_uniform"] == pytest.approx(sum(w * r for w, r in zip(weights, ratios)) / sum(weights))
    assert (rel["worst"], rel["worst_n"]) == (3.0, 1)


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
    md = report.read_text()
    assert "python -m sgl_jax.bench_buckets" in md and report_body(raw) in md
    assert "| 64, 128 | 2 |" in md and "| 128 | 1 |" in md
    assert "| 64 |" in proc.stdout and "| 128 |" in proc.stdout
