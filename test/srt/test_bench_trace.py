"""bench_trace (issue #69): the device's busy share from a decode loop's jax.profiler trace.

A synthetic trace with known intervals (two streams overlapping, events outside the steps' span, a CPU-only trace)
and the committed H200 trace of Qwen3-0.6B's batch-1 loop (reports/h200-2026-12-04/call3), whose numbers the
notes of that run quote.
"""

from __future__ import annotations

import gzip
import json
import os

import pytest

from sgl_jax.bench_trace import find_trace, load_events, markdown, summarize, union_ms

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H200_BS1 = os.path.join(REPO, "reports", "h200-2026-12-04", "call3", "trace", "bs1-in512")


def synthetic(device: bool = True) -> list:
    meta = [{"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 7, "tid": 1, "name": "thread_name", "args": {"name": "python3"}}]
    if device:
        meta += [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
                 {"ph": "M", "pid": 1, "tid": 14, "name": "thread_name", "args": {"name": "Stream #14(Compute)"}},
                 {"ph": "M", "pid": 1, "tid": 15, "name": "thread_name", "args": {"name": "Stream #15(MemcpyH2D)"}}]
    x = lambda pid, tid, ts, dur, name: {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name}
    host = [x(7, 1, 0, 1000, "decode"), x(7, 1, 1000, 1000, "decode"),  # two 1 ms iterations
            x(7, 1, 10, 300, "command_buffer::update"), x(7, 1, 1010, 100, "command_buffer::update"),
            x(7, 1, 400, 50, "cuGraphLaunch (CudaGraph:3)"), x(7, 1, 1400, 70, "cuGraphLaunch (CudaGraph:3)"),
            x(7, 1, 500, 200, "cond.25.clone")]
    kernels = [x(1, 14, 100, 400, "k1"), x(1, 15, 300, 400, "copy"),  # union 100..700: 0.6 ms
               x(1, 14, 1500, 300, "k2"),  # 0.3 ms
               x(1, 14, 1900, 300, "k3"),  # 1900..2200, clipped at the span's end (2000): 0.1 ms
               x(1, 14, 5000, 999, "after")]  # outside the span
    return meta + host + (kernels if device else [])


def test_union_counts_overlapping_work_once():
    assert union_ms([(0, 100), (50, 150), (300, 400)], 0, 1000) == pytest.approx(0.25)
    assert union_ms([(0, 100), (50, 150)], 120, 1000) == pytest.approx(0.03)
    assert union_ms([], 0, 10) == 0.0


def test_summary_of_a_known_trace():
    s = summarize(synthetic())
    assert s["steps"] == 2 and s["iteration ms"] == pytest.approx(1.0)
    assert s["device ms"] == pytest.approx(0.5)  # (0.6 + 0.3 + 0.1) ms over 2 iterations
    assert s["busy %"] == pytest.approx(50.0)
    assert s["device events"] == pytest.approx(2.0)  # the 4 that start inside the span
    assert s["graph update ms"] == pytest.approx(0.2)  # median of 0.3 and 0.1
    assert s["graph launch ms"] == pytest.approx(0.06)
    assert s["conditional ms"] == pytest.approx(0.1)  # median of 0.2 and 0
    assert summarize(synthetic(device=False)) is None
    assert "no device stream" in markdown([("cpu", None)])


def test_the_committed_h200_trace(tmp_path):
    """Qwen3-0.6B, batch 1, 8 steps on an H200: the kernels worked ~1.6 ms of each ~4.3 ms iteration; the host
    spent ~0.9 ms updating the CUDA graph, ~0.8 ms launching it and ~1.5 ms in a conditional (waiting for its
    predicate) per iteration."""
    path = find_trace(H200_BS1)
    s = summarize(load_events(path))
    assert s["steps"] == 8 and 600 < s["device events"] < 660
    assert 1.4 < s["device ms"] < 1.8 and 30 < s["busy %"] < 40 and 4.0 < s["iteration ms"] < 4.7
    assert 0.8 < s["graph update ms"] < 1.1 and 0.6 < s["graph launch ms"] < 0.9 and 1.3 < s["conditional ms"] < 1.6
    plain = tmp_path / "t.trace.json"  # (an uncompressed file reads the same)
    with gzip.open(path, "rt") as f:
        plain.write_text(f.read())
    assert summarize(load_events(str(plain))) == s
    with pytest.raises(FileNotFoundError):
        find_trace(str(tmp_path / "nothing"))


def test_bench_one_batch_report_carries_the_trace_table():
    """bench_one_batch's report gets the trace table for rows with a trace summary (a GPU run with --profile) and
    none for rows without (CPU, or reports written before the table: the committed H200 rows of call 2)."""
    from sgl_jax.bench_one_batch import report_body

    with open(os.path.join(REPO, "reports", "h200-2026-12-04", "call2", "hot-loop-tiny-llama-k1-gpu.json")) as f:
        raw = json.load(f)
    assert "From the jax.profiler trace" not in report_body(raw)
    raw["rows"][0]["trace"] = summarize(synthetic())
    body = report_body(raw)
    assert "From the jax.profiler trace" in body
    assert "| batch 1, input 128 | 2 | 1.000 | 0.500 | 50 | 2 | 0.000 | 0.200 | 0.060 | 0.100 |" in body
