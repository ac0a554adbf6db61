"""The kernel benchmark at a small scale: its three backends (native, with the C++ decode kernel on CPU; pure
JAX; Pallas in the interpreter on CPU) on every default model and shape, outputs equal, a generated report (.md
and .json) with its command, and its peaks the machine rates measured in the run
(bench_utils.measure_machine_rates), never a constant."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_bench():
    path = os.path.join(REPO, "benchmark", "kernels", "bench_ragged_paged_attention.py")
    spec = importlib.util.spec_from_file_location("bench_ragged_paged_attention", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_bench_small_scale(tmp_path):
    bench = load_bench()
    out = tmp_path / "report.md"
    results = bench.main(["--scale", "0.0625", "--backends", "native", "jax", "pallas", "--iters", "1", "--output",
                          str(out)])
    assert len(results) == 2 * len(bench.SHAPES) * 3
    for r in results:
        assert r.ms > 0 and r.gflops > 0 and r.gbs > 0
        if r.backend == "jax":
            assert r.max_abs_diff_vs_first_backend is not None and r.max_abs_diff_vs_first_backend < 1e-5, r
        if r.backend == "pallas":
            assert r.max_abs_diff_vs_first_backend is not None and r.max_abs_diff_vs_first_backend < 1e-4, r
    text = out.read_text()
    assert "bench_ragged_paged_attention.py --scale 0.0625" in text and "| Llama-3-8B | prefill |" in text
    raw = json.loads((tmp_path / "report.json").read_text())
    assert raw["command"] in text and len(raw["results"]) == len(results)
    rates = raw["rates"]
    assert rates["matmul_gflops"] > 0 and rates["memory_gbps"] > 0 and "float32" in rates["matmul_probe"]
    assert f"{rates['matmul_gflops']:.1f} GFLOP/s" in text and f"{rates['memory_gbps']:.1f} GB/s" in text
    # every "% peak" cell is the row's rate over the measured one
    row = next(line for line in text.splitlines() if line.startswith("| Qwen3-0.6B | decode |"))
    r = raw["results"][0]
    assert row.split("|")[9].strip() == f"{100 * r['gflops'] / rates['matmul_gflops']:.1f}"
    assert row.split("|")[11].strip() == f"{100 * r['gbs'] / rates['memory_gbps']:.1f}"
