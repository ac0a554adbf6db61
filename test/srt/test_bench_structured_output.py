"""The structured-output benchmark (python -m sgl_jax.bench_structured_output) at small scale against the suite's
shared server: every constrained output validates, both passes generate the same tokens, the machine rates beside
the rows are measured in the run (never a constant), and the generated report pair holds the command, the result
and the server's raw /get_server_info, from which its claims (compiles after warm-up, memory errors) come."""

from __future__ import annotations

import json

import pytest

from sgl_jax import bench_structured_output


@pytest.fixture(scope="module")
def server(default_server):
    return default_server  # conftest.py: the suite's shared server


def test_small_run_and_generated_report(server, tmp_path):
    md = tmp_path / "structured.md"
    bench_structured_output.main(["--base-url", server.url, "--num-requests", "4", "--report", str(md)])
    raw = json.loads((tmp_path / "structured.json").read_text())
    con, plain = raw["rows"]
    assert raw["invalid"] == 0 and con["valid"] == 4
    assert con["output_tokens"] == plain["output_tokens"] > 0  # the same tokens per request in both passes
    assert raw["ratio"] == pytest.approx(con["tok_per_s"] / plain["tok_per_s"])
    rates = raw["rates"]
    assert rates["matmul_gflops"] > 0 and rates["memory_gbps"] > 0
    text = md.read_text()
    assert raw["command"] in text and bench_structured_output.format_table(raw) in text  # the .md from the .json
    assert f"| {rates['memory_gbps']:.1f}, {rates['matmul_gflops']:.1f} |" in text
    state = raw["server_info"]["internal_states"][0]
    assert state["memory_errors"] == 0
    assert (f"num_compiles_after_warmup {state['num_compiles_after_warmup']}, memory_errors 0") in text
