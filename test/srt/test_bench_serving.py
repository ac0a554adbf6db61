"""bench_serving against a launched server: every workload at small scale, both backends, --compare, the
server's raw /get_server_info saved in the report and the summary's claims (compiles after warm-up, memory
errors, the prefill step budget's fit) read from it, the generated --report pair, and a peer that cuts its
stream short (and has no /get_server_info)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sgl_jax import bench_serving

# Scaled down for CI: about a tenth of the requests, prompts at a quarter, outputs at a sixteenth.
SMALL = ["--num-requests-scale", "0.1", "--prompt-len-scale", "0.25", "--output-len-scale", "0.0625"]


@pytest.fixture(scope="module")
def server(default_server):
    return default_server  # conftest.py: the suite's shared server; radix cache and chunked prefill on


@pytest.fixture(scope="module")
def sgl_report(server, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "sgl.json"
    report = bench_serving.main(["--base-url", server.url, "--backend", "sgl-jax", "--workload", "all",
                                 *SMALL, "--output-file", str(out)])
    return report, out


def _check_sane(m: dict):
    assert m["errors"] == 0, m["error_samples"]
    assert m["completed"] == m["num_requests"] >= 1
    assert m["output_tokens"] == sum(m["requested_output_tokens"])  # exactly what was asked, no more, no less
    assert all(r["output_tokens"] == n for r, n in zip(m["requests"], m["requested_output_tokens"]))
    assert m["ttft_ms_p50"] > 0 and m["ttft_ms_p99"] >= m["ttft_ms_p95"] >= m["ttft_ms_p50"]
    assert m["itl_ms_p50"] > 0 and m["itl_ms_p99"] >= m["itl_ms_p50"]
    assert m["e2e_ms_p50"] >= m["ttft_ms_p50"]
    assert m["output_throughput_tok_s"] > 0 and m["request_throughput_req_s"] > 0
    assert m["input_tokens"] > 0


def test_every_workload_small_scale(sgl_report):
    report, out = sgl_report
    assert list(report["workloads"]) == list(bench_serving.WORKLOADS)
    expected_counts = {"baseline": 1, "continuous_batching": 3, "paged_attention": 5, "chunked_prefill": 5,
                       "prefix_caching": 5, "editing": 1}
    for name, m in report["workloads"].items():
        _check_sane(m)
        assert m["num_requests"] == expected_counts[name]
    # the shared prefix (1024 / 4 tokens) is served from the radix cache after the warm-up requests
    assert report["workloads"]["prefix_caching"]["cached_tokens"] > 0
    saved = json.loads(out.read_text())
    assert saved["workloads"].keys() == report["workloads"].keys()
    assert saved["command"].startswith("python -m sgl_jax.bench_serving --base-url ")


def test_server_claims_come_from_the_saved_server_info(sgl_report, server):
    saved = json.loads(sgl_report[1].read_text())
    start, end = (saved["server_info"][k]["internal_states"] for k in ("start", "end"))
    assert len(start) == len(end) >= 1
    for s, e in zip(start, end):
        assert e["num_compiles_after_warmup"] == s["num_compiles_after_warmup"]  # no compile during the run
        assert e["memory_errors"] == 0
        assert e["prefill_step_budget"]["samples"] > 0  # the budget's fit has seen steps (the run's, at least)
    summary = bench_serving.format_server_summary(saved)
    fit = end[0]["prefill_step_budget"]
    assert (f"num_compiles_after_warmup {end[0]['num_compiles_after_warmup']}, memory_errors 0" in summary
            and f"coefficients {fit['coefficients']}" in summary and f"from {fit['samples']} steps" in summary), summary
    assert "per rank: [0]" in summary
    # the summary follows the saved output, not the server: an edited copy changes it
    edited = json.loads(json.dumps(saved))
    edited["server_info"]["end"]["internal_states"][0]["memory_errors"] = 7
    assert "memory_errors 7" in bench_serving.format_server_summary(edited)


def test_generated_report_pair(server, tmp_path):
    md = tmp_path / "serving.md"
    report = bench_serving.main(["--base-url", server.url, "--workload", "baseline", *SMALL, "--report", str(md)])
    raw = json.loads((tmp_path / "serving.json").read_text())
    text = md.read_text()
    assert raw["command"] in text and bench_serving.report_body(raw) in text  # the .md comes from the .json
    assert raw["workloads"].keys() == report["workloads"].keys() == {"baseline"}
    assert "server_info" in raw and "num_compiles_after_warmup" in text


def test_openai_backend_and_compare(server, sgl_report, tmp_path, capsys):
    out = tmp_path / "openai.json"
    report = bench_serving.main(["--base-url", server.url, "--backend", "openai", "--workload", "prefix_caching",
                                 *SMALL, "--output-file", str(out)])
    m = report["workloads"]["prefix_caching"]
    _check_sane(m)
    assert m["cached_tokens"] > 0  # from usage.prompt_tokens_details
    assert json.loads(out.read_text())["server_info"]["end"]["internal_states"]  # an sgl-jax server: saved too
    capsys.readouterr()
    bench_serving.main(["--compare", str(sgl_report[1]), str(out)])
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| prefix_caching | out tok/s")]
    assert len(rows) == 1 and rows[0].count("|") == 6
    assert "| baseline |" not in table  # only workloads both reports have


def test_workload_shapes_follow_the_spec():
    tok = bench_serving.load_tokenizer_for(None)
    corpus = bench_serving.corpus_token_ids(tok)
    chunked = bench_serving.make_requests(bench_serving.WORKLOADS["chunked_prefill"], tok, corpus, seed=42)
    assert len(chunked) == 48
    long = [s for s in chunked if s.prompt_tokens >= 1024]
    assert all(1024 <= s.prompt_tokens <= 2048 or 64 <= s.prompt_tokens <= 128 for s in chunked)
    assert 24 <= len(long) <= 44  # 75% long in expectation
    arrivals = [s.arrival_s for s in chunked]
    assert arrivals == sorted(arrivals) and 3 < arrivals[-1] < 20  # Poisson at 6 req/s: ~8 s for 48
    prefix = bench_serving.make_requests(bench_serving.WORKLOADS["prefix_caching"], tok, corpus, seed=42)
    head = prefix[0].prompt[:2000]
    assert all(s.prompt.startswith(head) for s in prefix) and prefix[1].arrival_s == pytest.approx(1 / 8)
    assert all(1024 + 32 <= s.prompt_tokens <= 1024 + 128 and s.max_tokens == 256 for s in prefix)
    assert {s.arrival_s for s in bench_serving.make_requests(bench_serving.WORKLOADS["paged_attention"], tok,
                                                             corpus, seed=42)} == {0.0}
    again = bench_serving.make_requests(bench_serving.WORKLOADS["chunked_prefill"], tok, corpus, seed=42)
    assert [s.prompt for s in again] == [s.prompt for s in chunked]  # deterministic per seed
    editing = bench_serving.make_requests(bench_serving.WORKLOADS["editing"], tok, corpus, seed=42)
    assert len(editing) == 5 and all(s.arrival_s is None for s in editing)
    for spec in editing:  # a 300-800-token passage to repeat with one word in capitals; the output as long
        head, passage = spec.prompt.split("\n\n", 1)
        passage = passage.rsplit("\n\nThe passage with that change:", 1)[0]
        word = head.split("'")[1]
        assert head.startswith("Repeat the following passage exactly") and word in passage
        assert head.endswith(f"as '{word.upper()}'.") and 300 <= spec.max_tokens <= 800
        assert abs(len(tok.encode(passage, add_special_tokens=False)) - spec.max_tokens) <= 8


class _ShortStreamPeer(BaseHTTPRequestHandler):
    """An OpenAI-style peer that answers 200 and streams 3 tokens, then ends: without a finish_reason
    for prompts starting with "cut", else with a token-less closing chunk (finish_reason "length") after
    too few tokens."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        cut = body["prompt"].startswith("cut")
        for i in range(3):
            chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if not cut:  # the closing chunk carries no token, as llama-cpp-python sends it
            chunk = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("prompt,error", [("cut here", "without a finish_reason"), ("full", "asked for 8")])
def test_short_stream_with_http_200_is_an_error(prompt, error):
    import asyncio

    import httpx

    peer = ThreadingHTTPServer(("127.0.0.1", 0), _ShortStreamPeer)
    threading.Thread(target=peer.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{peer.server_address[1]}"
        spec = bench_serving.RequestSpec(prompt, 2, 8, 0.0)

        async def go():
            async with httpx.AsyncClient() as client:
                return await bench_serving.send_request(client, url, "openai", "m", spec)

        res = asyncio.run(go())
        assert not res.ok and error in res.error and res.output_tokens == 3
    finally:
        peer.shutdown()


def test_openai_peer_without_server_info_is_recorded(tmp_path):
    """An OpenAI-compatible peer with no /get_server_info: the report says why there is no server output."""
    peer = ThreadingHTTPServer(("127.0.0.1", 0), _ShortStreamPeer)
    threading.Thread(target=peer.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{peer.server_address[1]}"
        report = bench_serving.main(["--base-url", url, "--backend", "openai", "--workload", "baseline", *SMALL,
                                     "--model", "m", "--output-file", str(tmp_path / "peer.json")])
    finally:
        peer.shutdown()
    assert "server_info" not in report and "HTTP" in report["server_info_error"]
    assert bench_serving.format_server_summary(report).startswith("server: no /get_server_info (")
