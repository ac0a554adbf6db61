"""Multi-host serving on one machine: two processes on 127.0.0.1 with 2 virtual CPU devices each
(``--nnodes 2``, jax.distributed with gloo collectives) serve a tiny random Llama sharded tp 4 over both,
and give the same greedy tokens as one process with 4 devices; when one node is killed the other exits
non-zero within 60 s (both directions).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from srt_helpers import (ServerProcess, alive_after, check_clean, child_pids, engine_cli_args, free_port_range,
                         module_server, save_tiny_llama, server_env, stop_process)

PROMPTS = [f"Host test {i}: " + "one two three four " * (1 + i % 3) for i in range(8)]
EXIT_WITHIN_S = 60


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_mh"))


def model_args(tiny_model) -> list:
    model, tokenizer = tiny_model
    return ["--model-path", model, "--tokenizer-path", tokenizer, "--context-length", "512", "--max-total-tokens",
            "2048", "--tp-size", "4", "--precompile-token-paddings", "64", "--precompile-bs-paddings", "8",
            "--max-running-requests", "8", "--chunked-prefill-size", "64"]


def xla_env(devices: int) -> dict:
    return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}


def generate_all(url: str) -> list:
    def one(text):
        r = httpx.post(url + "/generate", timeout=300, json={
            "text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    with cf.ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, PROMPTS))


def start_follower(tiny_model, addr: str, *extra: str) -> subprocess.Popen:
    """Node 1: ``launch_server --node-rank 1`` (no HTTP), its log in a temp file."""
    log = tempfile.NamedTemporaryFile("w+", prefix="sgl_jax_node1_", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "sgl_jax.launch_server", *engine_cli_args(), *model_args(tiny_model),
           "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr, *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env(xla_env(2)))
    proc.log_name = log.name
    return proc


def start_pair(tiny_model, *extra: str):
    addr = f"127.0.0.1:{free_port_range(4)}"
    follower = start_follower(tiny_model, addr, *extra)
    try:
        leader = ServerProcess([*model_args(tiny_model), "--nnodes", "2", "--node-rank", "0", "--dist-init-addr",
                                addr, *extra], env=xla_env(2))
    except BaseException:
        stop_process(follower, signal.SIGKILL)
        raise
    return leader, follower


def wait_exit(proc: subprocess.Popen, timeout: float) -> float:
    t0 = time.time()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"process {proc.pid} still running {timeout} s after its peer was killed")
    return time.time() - t0


@pytest.fixture(scope="module")
def one_host(tiny_model):
    yield from module_server(model_args(tiny_model), env=xla_env(4))


def test_two_hosts_match_one_and_exit_when_a_node_dies(tiny_model, one_host):
    expected = generate_all(one_host.url)
    leader, follower = start_pair(tiny_model)
    try:
        assert not child_pids(follower.pid)  # node 1 runs its scheduler in its own process: no child to leave
        assert generate_all(leader.url) == expected
        info = httpx.get(leader.url + "/get_server_info", timeout=30).json()
        assert info["nnodes"] == 2
        check_clean(leader.url)  # the teardown's checks: the kill leaves no teardown to run them
        follower.send_signal(signal.SIGKILL)
        took = wait_exit(leader.proc, EXIT_WITHIN_S)
        assert leader.proc.returncode != 0, "node 0 should fail when node 1 dies"
        print(f"node 0 exited {took:.1f} s after node 1 was killed")
        assert leader.children and not alive_after(leader.children), "node 0 left child processes"
    finally:
        stop_process(follower, signal.SIGKILL)
        leader.stop()


def test_follower_exits_when_node_zero_dies(tiny_model):
    leader, follower = start_pair(tiny_model, "--disable-precompile")
    try:
        assert follower.poll() is None and not child_pids(follower.pid)  # (its scheduler runs in its own process)
        check_clean(leader.url)  # (compiles not counted: null under --disable-precompile)
        for pid in [leader.proc.pid, *leader.children]:  # the whole node 0 server at once, as a host crash would
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        took = wait_exit(follower, EXIT_WITHIN_S)
        assert follower.returncode != 0
        print(f"node 1 exited {took:.1f} s after node 0 was killed")
    finally:
        stop_process(follower, signal.SIGKILL)
        leader.stop()


def test_servers_ports_are_drawn_below_the_ephemeral_range():
    """A test server binds its port seconds after the port is chosen. Ports are drawn below the kernel's ephemeral
    range, so no outgoing connection (a Gloo peer of jax.distributed, an HTTP client) can be handed the port in
    between: with a port from that range, node 0 once failed with "address already in use" (2026-12-05 suite)."""
    from sgl_jax.srt.utils import find_free_port

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    ports = [find_free_port() for _ in range(20)]
    assert all(1024 <= p < ephemeral for p in ports), ports
    assert len(set(ports)) > 1  # drawn at random: two test workers rarely draw the same one
