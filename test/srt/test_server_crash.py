"""A dying child process (scheduler or detokenizer) must be logged, fail /health, and end the server non-zero.

Each test kills its server, so each starts one: with --disable-precompile (no warm-up compilation of every
bucket; the crash test's one prefill compiles its shape on first use), since serving speed is not under test.
"""

import glob
import os
import re
import signal
import tempfile
import time

import httpx

from srt_helpers import ServerProcess, alive_after


def _health_is_not_ok(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code != 200
    except httpx.HTTPError:
        return True  # already gone


def test_scheduler_crash_takes_the_server_down_loudly():
    s = ServerProcess(["--disable-precompile"], env={"SGL_JAX_TEST_CRASH_AT_STEP": "2"})  # step 1: prefill, 2: crash
    try:
        r = httpx.post(s.url + "/generate", timeout=120,
                       json={"text": "Hi", "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        assert r.status_code == 503 and "scheduler exited" in r.json()["error"]["message"]
        assert _health_is_not_ok(s.url)
        code = s.proc.wait(60)
    finally:
        s.stop()
    assert code != 0
    log = s.log_text()
    assert "Traceback" in log and "injected crash at step 2" in log
    assert "exited unexpectedly" in log
    assert not alive_after(s.children), "child processes left behind"


def test_killed_detokenizer_takes_the_server_down():
    s = ServerProcess(["--disable-precompile"])
    try:
        # compiles are not counted without the warm-up: null, never a 0 that would claim none happened
        info = httpx.get(s.url + "/get_server_info", timeout=30).json()
        assert info["disable_precompile"] and info["internal_states"][0]["num_compiles_after_warmup"] is None, info
        pid = int(re.search(r"detokenizer \(pid (\d+)\)", s.log_text()).group(1))
        assert pid in s.children
        t0 = time.time()
        os.kill(pid, signal.SIGKILL)
        code = s.proc.wait(60)
        took = time.time() - t0
    finally:
        s.stop()
    assert code != 0
    assert "sgl_jax::detokenizer exited unexpectedly with code -9" in s.log_text()
    # SIGKILL of any process brings the rest down within 5 s, and the socket directory goes with them
    assert took < 5.0 and not alive_after(s.children, timeout=max(0.1, 5.0 - took)), took
    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"sgl_jax_ipc_{s.proc.pid}_*"))
