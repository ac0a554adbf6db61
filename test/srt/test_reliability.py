"""Reliability under overload, bad sizes and signals, on real servers (loopback only, bounded in time).

- guarded_server (SmolLM2, the suite's shapes, --max-queued-requests 8, --graceful-shutdown-timeout 5,
  chunked prefill at 128): fan-out limits (--max-n, 413 for a fan-out larger than the queue), a
  non-streaming fan-out aborted whole when its client goes away, 10x overload
  answered only with 503 + Retry-After while /health stays fast and every admitted request finishes, the
  private IPC directory, and last SIGTERM to the whole process group with 4 streams in flight (drain, abort events, exit 0, no
  child, no socket left, one log line per shutdown event).
- tiny_server (a random tiny Llama, a 256-token KV pool in a 1,024-token context): the memory preflight
  (413 with both numbers) on /generate, /v1/chat/completions, /v1/score and a session's turn, before
  tokenizing when the text's length alone tells; last, SIGKILL of the server process brings its children
  down within 5 s and the next start removes the socket directory it left.
- two tiny servers whose scheduler hangs at a chosen step (test hooks): with --watchdog-timeout 2 and every
  step slowed to 0.25 s, a 16-chunk prefill (longer than 2 s in all) does not trip the watchdog and the hang
  does (the server goes down, non-zero, a log line naming the step); without a watchdog, SIGTERM drains and
  a second signal exits at once.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import signal
import stat
import tempfile
import threading
import time

import httpx
import pytest

from srt_helpers import ServerProcess, alive_after, check_clean, child_pids, pid_alive, save_tiny_llama, wait_pool_idle

MAX_QUEUED = 8
MAX_RUNNING = 32  # SMALL_ENGINE_ARGS'
CAPACITY = MAX_RUNNING + MAX_QUEUED
WATCHDOG_S = 2
STEP_DELAY_S = 0.25
CHUNK = 128
GRACE_S = 5
GUARDED_ARGS = {"chunked_prefill_size": CHUNK, "max_queued_requests": MAX_QUEUED, "graceful_shutdown_timeout": GRACE_S,
                "enable_metrics": True}
TINY_POOL = 256


def ipc_dirs(pid: int) -> list:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"sgl_jax_ipc_{pid}_*"))


def stop_checked(server: ServerProcess) -> None:
    """Teardown of a module's server: if a test has not stopped it, it must be clean and stop with exit 0,
    childless (`ServerProcess.stop_checked`); if a test stopped it, no child may be left."""
    if server.proc.poll() is None:
        server.stop_checked()
    assert not alive_after(server.children)


@pytest.fixture(scope="module")
def guarded_server():
    s = ServerProcess(engine_args=GUARDED_ARGS, start_new_session=True)
    yield s
    stop_checked(s)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def tiny_args(tiny_model, **extra) -> dict:
    model, tokenizer = tiny_model
    return {"model_path": model, "tokenizer_path": tokenizer, "context_length": 1024, "max_total_tokens": TINY_POOL,
            "precompile_token_paddings": [64], "precompile_bs_paddings": [1, 8], "chunked_prefill_size": 64,
            "max_running_requests": 8, **extra}


@pytest.fixture(scope="module")
def tiny_server(tiny_model):
    s = ServerProcess(engine_args=tiny_args(tiny_model))
    yield s
    if s.proc.poll() is None:
        stop_checked(s)


# ---------------------------------------------------------------- guarded_server
def test_ipc_sockets_live_in_a_private_directory(guarded_server):
    dirs = ipc_dirs(guarded_server.proc.pid)
    assert len(dirs) == 1, dirs
    assert stat.S_IMODE(os.stat(dirs[0]).st_mode) == 0o700  # the sockets carry pickled objects
    names = sorted(os.listdir(dirs[0]))
    assert names == ["detokenizer", "scheduler", "tokenizer"]
    assert all(stat.S_ISSOCK(os.stat(os.path.join(dirs[0], n)).st_mode) for n in names)


def test_fanout_is_capped_and_counted_whole(guarded_server):
    url = guarded_server.url
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, body in [("/v1/chat/completions", {**chat, "n": 129}),
                       ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "best_of": 129}),
                       ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, "n": 129}})]:
        r = httpx.post(url + path, json=body, timeout=30)
        assert r.status_code == 400 and "--max-n" in r.text and "128" in r.text, (path, r.text)
    # a fan-out larger than what can be running or queued can never be admitted: 413, nothing sent
    r = httpx.post(url + "/v1/chat/completions", json={**chat, "n": CAPACITY + 1}, timeout=30)
    assert r.status_code == 413 and "--max-queued-requests" in r.text, r.text
    r = httpx.post(url + "/generate", json={"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2, "n": 21}},
                   timeout=30)
    assert r.status_code == 413, r.text  # 2 prompts x 21 samples = 42 sequences
    info = httpx.get(url + "/get_server_info", timeout=30).json()
    assert info["queue_capacity"] == CAPACITY and info["max_queued_requests"] == MAX_QUEUED
    assert info["max_n"] == 128
    wait_pool_idle(url)


def test_client_gone_aborts_a_non_streaming_fanout(guarded_server):
    """A non-streaming chat request with n = 8 and long outputs whose client gives up (timeout: the connection
    is closed): all 8 sequences are aborted within seconds, nothing stays in flight, the pool is idle."""
    url = guarded_server.url
    body = {"messages": [{"role": "user", "content": "Tell me a very long story."}], "n": 8, "max_tokens": 1500,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/chat/completions", json=body, timeout=3)
    deadline = time.time() + 15
    while httpx.get(url + "/get_server_info", timeout=30).json()["num_in_flight_reqs"] and time.time() < deadline:
        time.sleep(0.2)
    assert httpx.get(url + "/get_server_info", timeout=30).json()["num_in_flight_reqs"] == 0
    wait_pool_idle(url, timeout=15)
    assert guarded_server.log_text().count("Client disconnected: aborting request") >= 8


def test_overload_gets_only_503_and_health_stays_fast(guarded_server):
    """Arrivals at more than 10x what the server serves: 400 requests in ~4 s (it serves a few per second).
    Each answer is 200 with the whole output or 503 with Retry-After; /health (polled from another thread)
    answers 200 within 1 s throughout; the rejections show in /get_server_info and /metrics."""
    url = guarded_server.url
    rejected_before = httpx.get(url + "/get_server_info", timeout=30).json()["num_rejected_reqs"]
    health, stop = [], threading.Event()

    def poll_health():
        with httpx.Client(timeout=10) as c:
            while not stop.is_set():
                t = time.perf_counter()
                code = c.get(url + "/health").status_code
                health.append((code, time.perf_counter() - t))
                time.sleep(0.1)

    async def one(client, i):
        await asyncio.sleep(i * 0.01)
        stream = i % 4 == 0
        body = {"text": f"Request {i}: count slowly", "stream": stream,
                "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
        if i % 3 == 1:  # an OpenAI endpoint too
            r = await client.post(url + "/v1/completions", json={"prompt": f"Request {i}", "max_tokens": 16,
                                                                 "ignore_eos": True, "temperature": 0})
            full = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
            return r.status_code, r.headers.get("retry-after"), r.text, full
        async with client.stream("POST", url + "/generate", json=body) as r:
            text = (await r.aread()).decode()
        if r.status_code != 200:
            return r.status_code, r.headers.get("retry-after"), text, False
        last = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")][-1] if stream \
            else json.loads(text)
        return r.status_code, None, text, last["meta_info"]["completion_tokens"] == 16

    async def flood():
        limits = httpx.Limits(max_connections=500, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(400)))

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        results = asyncio.run(flood())
    finally:
        stop.set()
        poller.join()
    codes = [r[0] for r in results]
    assert set(codes) <= {200, 503}, {c for c in codes if c not in (200, 503)}
    refused = [r for r in results if r[0] == 503]
    served = [r for r in results if r[0] == 200]
    assert refused and served, (len(refused), len(served))
    assert all(r[1] == "1" and "queue is full" in r[2] for r in refused), refused[:2]
    assert all(r[3] for r in served), [r[2][:200] for r in served if not r[3]][:3]  # every admitted one finished
    assert health and all(code == 200 for code, _ in health)
    assert max(t for _, t in health) < 1.0, sorted(t for _, t in health)[-5:]
    info = httpx.get(url + "/get_server_info", timeout=30).json()
    assert info["num_rejected_reqs"] - rejected_before == len(refused)
    metrics = httpx.get(url + "/metrics", timeout=30).text
    line = next(x for x in metrics.splitlines() if x.startswith("sglang:num_rejected_requests_total"))
    assert float(line.split()[-1]) == info["num_rejected_reqs"]
    wait_pool_idle(url)
    print(f"overload: {len(served)} served, {len(refused)} refused; /health max {max(t for _, t in health):.3f} s")


def test_sigterm_to_the_process_group_drains_and_exits_zero(guarded_server):
    """SIGTERM to the whole group (as Ctrl-C, systemd or `kill -TERM -PGID` send it) with 4 streams in flight:
    new requests get 503 + Retry-After and /health 503 at once; each stream ends with its whole output or an
    abort event; the server exits 0 within the grace period plus a few seconds; no child process and no
    socket directory is left; the log says what happened, one line per event, without a traceback."""
    url, proc = guarded_server.url, guarded_server.proc
    check_clean(url)  # the teardown's checks of the module's traffic: the signal leaves no teardown to run them
    children = child_pids(proc.pid)
    seen = [[] for _ in range(4)]
    started = [threading.Event() for _ in range(4)]

    def stream(i: int, max_new: int) -> None:
        body = {"text": f"Story {i}:", "stream": True,
                "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
        with httpx.stream("POST", url + "/generate", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    seen[i].append(json.loads(line[6:]))
                    started[i].set()

    threads = [threading.Thread(target=stream, args=(i, 1500 if i < 3 else 10)) for i in range(4)]
    for t in threads:
        t.start()
    assert all(e.wait(120) for e in started)
    t0 = time.time()
    os.killpg(proc.pid, signal.SIGTERM)
    time.sleep(0.5)
    r = httpx.post(url + "/generate", json={"text": "late", "sampling_params": {"max_new_tokens": 2}}, timeout=10)
    assert r.status_code == 503 and r.headers.get("retry-after") and "shutting down" in r.text, r.text
    assert httpx.get(url + "/health", timeout=5).status_code == 503
    for t in threads:
        t.join(GRACE_S + 30)
    code = proc.wait(GRACE_S + 30)
    took = time.time() - t0
    assert code == 0, guarded_server.log_text()[-3000:]
    assert took < GRACE_S + 10, took
    for i, events in enumerate(seen):
        meta = events[-1]["meta_info"]
        fr = meta["finish_reason"]
        if i < 3:  # 1,500 tokens cannot finish in 5 s on this CPU: aborted, with what they had
            assert fr["type"] == "abort" and "shutting down" in fr["message"], fr
        else:
            assert fr["type"] == "length" and meta["completion_tokens"] == 10, meta
    assert not alive_after(children, timeout=5)
    assert not ipc_dirs(proc.pid)
    log = guarded_server.log_text()
    assert "SIGTERM received: draining" in log and "Aborting 3 requests still running" in log
    assert "Traceback" not in log and "exited unexpectedly" not in log, log[-3000:]


# ---------------------------------------------------------------- tiny_server: memory preflight
def test_memory_preflight_answers_413_with_both_numbers(tiny_server, smollm2_tokenizer):
    from sgl_jax.srt.tokenizer.tokenizer_manager import max_chars_per_token

    url = tiny_server.url

    def post(path, body):
        return httpx.post(url + path, json=body, timeout=60)

    r = post("/generate", {"input_ids": [5] * 300, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 413 and "300 tokens" in r.text and f"holds {TINY_POOL} tokens" in r.text, r.text
    # the least output counts: min_new_tokens
    r = post("/generate", {"input_ids": [5] * 250, "sampling_params": {"max_new_tokens": 8, "min_new_tokens": 8}})
    assert r.status_code == 413 and "needs 258 KV tokens" in r.text, r.text
    r = post("/generate", {"input_ids": [5] * 250, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    # a text whose length alone proves it cannot fit is refused without being tokenized
    cap = max_chars_per_token(smollm2_tokenizer)
    r = post("/generate", {"text": "a" * (cap * 300), "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 413 and "at least 300 tokens" in r.text, r.text
    r = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 400}], "max_tokens": 2})
    assert r.status_code == 413 and r.json()["message"].startswith("The input"), r.text
    # /v1/score: the query with its largest item
    r = post("/v1/score", {"query": [5] * 240, "items": [[6] * 10, [7] * 30], "label_token_ids": [1, 2]})
    assert r.status_code == 413 and "270 tokens" in r.text, r.text
    # a session's turn: its whole prompt, history included (checked by the scheduler)
    sid = post("/open_session", {"capacity_of_str_len": 1000}).json()
    first = post("/generate", {"input_ids": [5] * 200, "session_params": {"id": sid},
                               "sampling_params": {"max_new_tokens": 10, "ignore_eos": True}}).json()
    r = post("/generate", {"input_ids": [6] * 60, "sampling_params": {"max_new_tokens": 2},
                           "session_params": {"id": sid, "rid": first["meta_info"]["id"]}})
    assert r.status_code == 413 and "270 tokens" in r.text, r.text
    assert post("/close_session", {"session_id": sid}).status_code == 200
    wait_pool_idle(url)


def test_sigkill_of_the_server_takes_its_children_down(tiny_server):
    from sgl_jax.srt.port_args import PortArgs

    proc = tiny_server.proc
    check_clean(tiny_server.url)  # the teardown's checks of the module's traffic, before the kill leaves none
    children = child_pids(proc.pid)
    left = ipc_dirs(proc.pid)  # SIGKILL allows no clean-up of these ...
    assert len(children) >= 2 and left
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert not alive_after(children, timeout=5.0)
    # ... the next start removes what a dead process left (this one, or a server another test worker starts
    # meanwhile: either may be first)
    PortArgs.init_new().cleanup()
    assert not any(os.path.exists(d) for d in left)


# ---------------------------------------------------------------- a scheduler that hangs
def _hung_server(tiny_model, **extra) -> ServerProcess:
    return ServerProcess(engine_args=tiny_args(tiny_model, **extra), env={"SGL_JAX_TEST_HANG_AT_STEP": "1"})


def _send_in_background(url: str, max_new_tokens: int = 4) -> threading.Thread:
    def send():
        try:
            httpx.post(url + "/generate", json={"text": "hang", "sampling_params": {
                "max_new_tokens": max_new_tokens, "ignore_eos": True}}, timeout=60)
        except httpx.HTTPError:
            pass

    t = threading.Thread(target=send, daemon=True)
    t.start()
    return t


def test_watchdog_times_steps_not_requests(tiny_model):
    """Every step of this server takes >= 0.25 s (a test hook) and its scheduler hangs at step 25 (another):
    a prompt prefilled in 16 chunks of 64 tokens (steps 1-16, then 3 decode steps) takes longer than
    --watchdog-timeout 2 s in all and does not trip it; the hang at step 25 does, and takes the server down
    (non-zero, a log line naming the step, every process and the socket directory gone)."""
    s = ServerProcess(engine_args=tiny_args(tiny_model, watchdog_timeout=WATCHDOG_S, max_total_tokens=2048),
                      env={"SGL_JAX_TEST_HANG_AT_STEP": "25", "SGL_JAX_TEST_STEP_DELAY_S": str(STEP_DELAY_S)})
    try:
        children = child_pids(s.proc.pid)
        t = time.perf_counter()
        r = httpx.post(s.url + "/generate", json={"input_ids": [1000 + i for i in range(1000)],
                                                  "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}},
                       timeout=120)
        elapsed = time.perf_counter() - t
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4, r.text
        assert elapsed > WATCHDOG_S and "Watchdog" not in s.log_text(), elapsed
        assert httpx.get(s.url + "/health", timeout=5).status_code == 200
        t0 = time.time()
        _send_in_background(s.url, max_new_tokens=30)  # its steps 20-49: the hang at 25 trips the watchdog
        code = s.proc.wait(60)
        assert code != 0 and time.time() - t0 < 30
        log = s.log_text()
        assert "Watchdog: scheduler step 25 (rank 0: decode of 1) has run for" in log, log[-3000:]
        assert not alive_after(children, timeout=5.0)
        assert not ipc_dirs(s.proc.pid)
    finally:
        s.stop()


def test_second_signal_exits_at_once(tiny_model):
    s = _hung_server(tiny_model, watchdog_timeout=0, graceful_shutdown_timeout=60)
    try:
        children = child_pids(s.proc.pid)
        _send_in_background(s.url)
        time.sleep(1.0)
        s.proc.send_signal(signal.SIGTERM)  # drains: the stuck request would hold it for 60 s
        time.sleep(1.0)
        assert s.proc.poll() is None
        t0 = time.time()
        s.proc.send_signal(signal.SIGINT)
        code = s.proc.wait(15)
        assert code == 0 and time.time() - t0 < 8, (code, time.time() - t0)
        assert "Second signal (SIGINT): exiting now" in s.log_text()
        assert not alive_after(children, timeout=5.0)
        assert not ipc_dirs(s.proc.pid)
    finally:
        s.stop()


def test_sigterm_during_startup_stops_cleanly(tiny_model, tmp_path):
    """SIGTERM while the scheduler still loads and compiles: exit 0, no child, no socket directory."""
    import subprocess
    import sys

    from sgl_jax.srt.utils import find_free_port
    from srt_helpers import engine_cli_args, server_env

    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sgl_jax.launch_server", "--host", "127.0.0.1", "--port",
                                 str(find_free_port()), *engine_cli_args(tiny_args(tiny_model))],
                                stdout=out, stderr=subprocess.STDOUT, env=server_env())
    try:
        deadline = time.time() + 120
        while "Started scheduler" not in log.read_text():
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        children = child_pids(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, log.read_text()[-3000:]
        assert "SIGTERM received during start-up: stopping" in log.read_text()
        assert not alive_after(children, timeout=5.0)
        assert not ipc_dirs(proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_stale_socket_leftovers_of_dead_processes_are_removed(tmp_path, monkeypatch):
    """What a dead process left (a socket directory, or the loose socket files of versions before it) goes;
    what a live process uses stays."""
    from sgl_jax.srt.port_args import remove_stale_ipc_dirs

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = next(p for p in range(4_000_000, 4_100_000) if not pid_alive(p))
    names = [f"sgl_jax_ipc_{dead}_abc", f"sgl_jax_{dead}_0123abcd_tokenizer", f"sgl_jax_ipc_{os.getpid()}_live",
             f"sgl_jax_{os.getpid()}_0123abcd_scheduler", "sgl_jax_other_file"]
    for n in names:
        (tmp_path / n).mkdir() if "_ipc_" in n else (tmp_path / n).write_text("")
    remove_stale_ipc_dirs()
    assert sorted(os.listdir(tmp_path)) == sorted(names[2:])
