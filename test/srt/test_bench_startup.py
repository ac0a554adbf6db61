"""bench_startup (python -m sgl_jax.bench_startup, issue #70) on a tiny random Llama: a real server started with an
empty compilation cache compiles every program, the restart on that cache compiles none and loads them all; both
answer a chat; the phases each process reports add up to its start-up time, and the generated report holds them.
This is the suite's cold start: a start-up that compiles while serving, or a cache that stops loading, fails here."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from srt_helpers import save_tiny_llama, server_env

# (the KV pool is zeroed on a thread of its own from after the weights; its phase is the wait for it after warm-up)
SCHEDULER_PHASES = ["process start and imports", "JAX set-up", "model config and tokenizer",
                    "weights (read, place and shard)", "scheduler set-up", "tracing", "compiling",
                    "KV cache allocation", "grammar warm-up", "other"]
SERVER_PHASES = ["process start and imports", "tokenizer", "waiting for the scheduler", "HTTP app", "other"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("startup_model"))


def test_cold_start_compiles_and_the_restart_loads_everything(tiny, tmp_path):
    model, tok = tiny
    report = tmp_path / "startup.md"
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-m", "sgl_jax.bench_startup", "--restarts", "1", "--cache-dir", str(cache),
           "--report", str(report), "--", "--model-path", model, "--tokenizer-path", tok, "--context-length", "256",
           "--precompile-bs-paddings", "4", "--precompile-token-paddings", "64", "--chunked-prefill-size", "64",
           "--max-total-tokens", "2048"]
    # the bench's own temporary directory (its servers' logs), short: ZMQ's IPC paths under it must stay within
    # 107 characters, which pytest's tmp_path under xdist is not
    tmp = Path(tempfile.mkdtemp(prefix="sgl_bst_", dir="/tmp"))
    try:
        env = server_env({"JAX_PLATFORMS": "cpu", "TMPDIR": str(tmp)})
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert not list(tmp.glob("sgl_jax_bench_server_*.log"))  # the servers stopped cleanly: their logs are gone
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    raw = json.loads(report.with_suffix(".json").read_text())
    cold, restart = raw["starts"]
    assert (cold["name"], restart["name"]) == ("cold", "restart 1")
    programs = cold["warmup"]["programs"]
    assert programs > 0 and cold["warmup"]["compiled"] == programs and cold["warmup"]["loaded_from_cache"] == 0
    assert restart["warmup"]["compiled"] == 0 and restart["warmup"]["loaded_from_cache"] == programs
    for start in (cold, restart):
        assert start["num_compiles_after_warmup"] == 0 and start["answer"]
        assert 0 < start["health_s"] <= start["chat_s"]
        phases = start["startup_phases"]
        # the server logs "Ready in" just before it serves; its clock starts at its process's start (/proc), a
        # little after the bench's launch
        assert 0 < phases["ready_s"] <= start["health_s"] + 0.1
        for process, names in (("scheduler", SCHEDULER_PHASES), ("server", SERVER_PHASES)):
            got = phases[process]
            assert [p["name"] for p in got["phases"]] == names, process
            # every second of the process's start-up is in a phase ("other" takes the rest)
            assert sum(p["seconds"] for p in got["phases"]) == pytest.approx(got["total_s"], abs=0.02), process
        assert phases["scheduler"]["total_s"] < phases["ready_s"]  # (the scheduler started after the server)
        note = {p["name"]: p["note"] for p in phases["scheduler"]["phases"]}["compiling"]
        w = start["warmup"]
        assert note.startswith(f"{w['compiled']} compiled, {w['loaded_from_cache'] - w['executables_loaded']} loaded "
                               f"from the compilation cache, {w['executables_loaded']} serialized executables loaded")
    # the restart loaded every program's executable instead of tracing it (program_cache.py)
    assert cold["warmup"]["executables_loaded"] == 0 and restart["warmup"]["executables_loaded"] == programs
    # ... each loaded ahead, while the weights loaded (program_cache.start_prefetch)
    assert restart["warmup"]["executables_loaded_ahead"] == programs
    text = report.read_text()
    assert "| cold |" in text and "| restart 1 |" in text and "| compiling |" in text and "| tokenizer |" in text
