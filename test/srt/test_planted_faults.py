"""The checks fire on a live server: a tiny-model server started with every planted fault of
fault_injection.PlantedFaults (SGL_JAX_TEST_LEAK_PAGES=1, SGL_JAX_TEST_DOUBLE_FREE, SGL_JAX_TEST_DOUBLE_LOCK,
SGL_JAX_TEST_COMPILE_WHILE_SERVING) and the exact page-ownership check after every step. Its first finished
request leaks a page and frees one twice (which cancel out in kv_tokens_in_use), its first step compiles a new
program, a second request locks a cached prefix twice; /get_server_info's memory_errors and
num_compiles_after_warmup, the log lines of the exact and idle checks, and the teardown check every test
server passes (srt_helpers.check_clean) all report them."""

import httpx
import pytest

from srt_helpers import ServerProcess, alive_after, check_clean, save_tiny_llama

FAULTS = {"SGL_JAX_TEST_LEAK_PAGES": "1", "SGL_JAX_TEST_DOUBLE_FREE": "1", "SGL_JAX_TEST_DOUBLE_LOCK": "1",
          "SGL_JAX_TEST_COMPILE_WHILE_SERVING": "1", "SGL_JAX_CHECK_KV_INVARIANTS": "1"}
PROMPT = {"input_ids": list(range(1000, 1040)), "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                       "ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model, tokenizer = save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))
    s = ServerProcess(env=FAULTS, engine_args={
        "model_path": model, "tokenizer_path": tokenizer, "context_length": 256, "max_total_tokens": 1024,
        "precompile_token_paddings": [64], "precompile_bs_paddings": [1], "chunked_prefill_size": 64,
        "max_running_requests": 1, "page_size": 4, "grammar_backend": "none"})
    yield s
    assert s.stop() == 0  # (not stop_checked: this server is dirty on purpose)
    assert not alive_after(s.children)


def state(server) -> dict:
    return httpx.get(server.url + "/get_server_info", timeout=30).json()["internal_states"][0]


def generate(server) -> None:
    r = httpx.post(server.url + "/generate", json=PROMPT, timeout=120)
    assert r.status_code == 200, r.text


def test_first_finished_request_reports_memory_errors(server):
    assert state(server)["memory_errors"] == 0
    generate(server)
    st = state(server)
    assert st["memory_errors"] > 0
    # the leaked page and the page freed twice cancel out in the counts: only the exact checks see them
    assert st["kv_tokens_in_use"] == 0 and st["kv_tokens_free"] + st["kv_tokens_cached"] == st["kv_tokens_total"]
    log = server.log_text()
    invariants = [line for line in log.splitlines() if "KV invariants violated" in line]  # after the step
    assert invariants and "pages owned by nobody (leaked)" in invariants[0] and "pages owned twice" in invariants[0]
    idle = [line for line in log.splitlines() if "KV accounting mismatch while idle" in line]
    assert idle and "leaked" in idle[0] and "owned twice" in idle[0]


def test_a_compile_while_serving_is_counted(server):
    assert state(server)["num_compiles_after_warmup"] >= 1
    assert "Compiled a new program while serving" in server.log_text()


def test_a_prefix_locked_twice_is_reported_when_idle(server):
    errors = state(server)["memory_errors"]
    generate(server)  # the same prompt: its cached prefix is matched and (planted) locked twice
    st = state(server)
    assert st["kv_tokens_protected"] > 0 and st["num_running_reqs"] == 0
    assert st["memory_errors"] > errors
    assert "cached tokens still locked with nothing running" in server.log_text()


def test_the_teardown_check_of_every_test_server_fails_here(server):
    with pytest.raises(AssertionError):
        check_clean(server.url)
