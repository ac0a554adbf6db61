"""A scheduler crash must be logged with its traceback, fail /health, and end the server non-zero."""

import httpx

from srt_helpers import ServerProcess, pid_alive


def test_scheduler_crash_takes_the_server_down_loudly():
    s = ServerProcess(env={"SGL_JAX_TEST_CRASH_AT_STEP": "2"})  # step 1: prefill, step 2: crash
    try:
        r = httpx.post(s.url + "/generate", timeout=120,
                       json={"text": "Hi", "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        assert r.status_code == 503 and "scheduler exited" in r.json()["error"]["message"]
        try:
            health = httpx.get(s.url + "/health", timeout=5).status_code
        except httpx.HTTPError:
            health = None  # already gone
        assert health != 200
        code = s.proc.wait(60)
    finally:
        s.stop()
    assert code != 0
    log = s.log_text()
    assert "Traceback" in log and "injected crash at step 2" in log
    assert "exited unexpectedly" in log
    assert not [p for p in s.children if pid_alive(p)], "child processes left behind"
