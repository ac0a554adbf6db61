"""bench_retrieval's smoke run (tiny BERT shapes, no decoder row): both servers answer the workloads, their peers
run in turn with them (a timed pair each), the table and the report pair are written, and each server was idle,
exact and compile-free at the end (srt_helpers.check_clean_info on the /get_server_info the benchmark kept)."""

from __future__ import annotations

import json

from sgl_jax import bench_retrieval
from srt_helpers import check_clean_info


def test_tiny_run_writes_the_table_and_the_report(tmp_path):
    report = tmp_path / "retrieval.md"
    bench_retrieval.main(["--tiny", "--repeats", "1", "--no-decoder", "--embed-batch", "20", "--concurrency", "2",
                          "--rerank-buckets", "384", "--embed-buckets", "256", "--embed-pack", "256", "--report",
                          str(report)])
    text = report.read_text()
    assert "| rerank: cross-encoder (MiniLM-L6 shapes) |" in text and "| embeddings: BERT" in text
    raw = json.loads(report.with_suffix(".json").read_text())
    assert f"float32 on {raw['cpu']}, torch on {raw['torch_threads']} threads" in text  # (every field filled in)
    for row, peer, n in (("rerank_cross", "rerank_cross_peer", raw["docs"]), ("embed", "embed_peer", raw["sentences"])):
        assert raw[row]["per_s"] > 0 and raw[peer]["per_s"] > 0 and raw[row]["prompt_tokens"] >= 10 * n
        assert len(raw[row]["seconds"]) == len(raw[peer]["seconds"]) == 1 and raw[row + "_ratio"] > 0
        check_clean_info(raw[row]["server_info"])
    assert "rerank_decoder" not in raw and raw["command"].startswith("python -m sgl_jax.bench_retrieval --tiny")
