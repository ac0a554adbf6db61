"""The kernel benchmark at a small scale: both backends (the Pallas one in the interpreter on CPU) on every
model and shape, outputs equal, a report written with its command."""

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
    results = bench.main(["--scale", "0.0625", "--backends", "native", "pallas", "--iters", "1", "--output",
                          str(out)])
    assert len(results) == len(bench.MODELS) * len(bench.SHAPES) * 2
    for r in results:
        assert r.ms > 0 and r.gflops > 0 and r.gbs > 0
        if r.backend == "pallas":
            assert r.max_abs_diff_vs_first_backend is not None and r.max_abs_diff_vs_first_backend < 1e-4, r
    text = out.read_text()
    assert "bench_ragged_paged_attention.py --scale 0.0625" in text and "| Llama-3-8B | prefill |" in text
    raw = json.loads((tmp_path / "report.json").read_text())
    assert raw["peak_gflops"] > 0 and raw["peak_gbs"] > 0 and len(raw["results"]) == len(results)
