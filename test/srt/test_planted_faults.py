"""The checks fire on a live server, one planted fault per server (fault_injection.PlantedFaults), so that no fault
can stand in for another: a tiny 2-layer random Llama (one compiled bucket) started with one of
SGL_JAX_TEST_LEAK_PAGES=1, SGL_JAX_TEST_DOUBLE_FREE=1, SGL_JAX_TEST_DOUBLE_LOCK=1, SGL_JAX_TEST_COMPILE_WHILE_SERVING=1
and, as every test server, the exact check after every step (SGL_JAX_CHECK_KV_INVARIANTS=1). Its fixture sends the
requests that trigger the fault (the first finished request leaks or double-frees a page and the first step compiles;
for the double lock a second request matches the first one's cached prefix), then each detector must report that
fault and only it:

- the exact check (the scheduler's "KV invariants violated" log lines) names the fault's own problem, no other;
- /get_server_info's memory_errors goes from 0 to > 0 at once (0 for the compile fault);
- the idle check: the scheduler's "KV accounting mismatch while idle" line names the fault, and the test servers'
  idle check (srt_helpers.wait_pool_idle) fails; for the compile fault both pass and the teardown check every test
  server passes (srt_helpers.check_clean) fails on the compile count;
- num_compiles_after_warmup >= 1 for the compile fault, 0 for the others.
"""

import dataclasses
import re
import time
from typing import Optional

import httpx
import pytest

from srt_helpers import ServerProcess, alive_after, check_clean, save_tiny_llama, wait_pool_idle

# fault -> its environment, and the message by which the exact and idle checks name it (None: they must stay silent)
FAULTS = {
    "leak_pages": ({"SGL_JAX_TEST_LEAK_PAGES": "1"}, "pages owned by nobody (leaked)"),
    "double_free": ({"SGL_JAX_TEST_DOUBLE_FREE": "1"}, "pages owned twice"),
    "double_lock": ({"SGL_JAX_TEST_DOUBLE_LOCK": "1"}, "prefix locks no holder accounts for"),
    "compile_while_serving": ({"SGL_JAX_TEST_COMPILE_WHILE_SERVING": "1"}, None),
}
MESSAGES = [m for _, m in FAULTS.values() if m is not None]
EXACT, IDLE = "KV invariants violated", "KV accounting mismatch while idle"
COMPILED = "Compiled a new program while serving"
PROMPT = {"input_ids": list(range(1000, 1040)), "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                       "ignore_eos": True}}


@dataclasses.dataclass
class Faulty:
    """A server carrying one planted fault: its name, the message naming it (None: the compile fault), rank 0's
    internal state before the triggering requests and right after them."""

    fault: str
    message: Optional[str]
    server: ServerProcess
    before: dict
    after: dict

    def lines(self, tag: str) -> list:
        return [line for line in self.server.log_text().splitlines() if tag in line]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def state(server: ServerProcess) -> dict:
    return httpx.get(server.url + "/get_server_info", timeout=30).json()["internal_states"][0]


def generate(server: ServerProcess) -> None:
    r = httpx.post(server.url + "/generate", json=PROMPT, timeout=120)
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module", params=list(FAULTS))
def faulty(request, tiny_llama):
    env, message = FAULTS[request.param]
    model, tokenizer = tiny_llama
    s = ServerProcess(env={**env, "SGL_JAX_CHECK_KV_INVARIANTS": "1"}, engine_args={
        "model_path": model, "tokenizer_path": tokenizer, "context_length": 256, "max_total_tokens": 1024,
        "precompile_token_paddings": [64], "precompile_bs_paddings": [1], "chunked_prefill_size": 64,
        "max_running_requests": 1, "page_size": 4, "grammar_backend": "none"})
    try:
        before = state(s)
        generate(s)  # the first finished request (and the first step after warm-up)
        if request.param == "double_lock":
            generate(s)  # the same prompt: its cached prefix is matched and (planted) locked twice
        yield Faulty(request.param, message, s, before, state(s))
    finally:
        code = s.stop()  # (not stop_checked: this server is dirty on purpose)
    assert code == 0, s.log_text()[-3000:]
    assert not alive_after(s.children)


def test_the_exact_check_names_the_fault_and_nothing_else(faulty):
    lines = faulty.lines(EXACT)
    if faulty.message is None:
        assert lines == []
        return
    assert lines, faulty.server.log_text()[-3000:]
    for line in lines:
        assert [m for m in MESSAGES if m in line] == [faulty.message], line
    if faulty.fault == "double_lock":  # caught while the second request ran (locked twice, one holder) and after
        assert any(re.search(r"lock_ref 2 != 1 holders", line) for line in lines), lines
        assert re.search(r"lock_ref 1 != 0 holders", lines[-1]), lines


def test_memory_errors_count_from_the_first_finished_request(faulty):
    assert faulty.before["memory_errors"] == 0 and faulty.before["num_compiles_after_warmup"] == 0
    if faulty.message is None:
        assert faulty.after["memory_errors"] == 0
    else:
        assert faulty.after["memory_errors"] > 0


def test_the_idle_check_names_the_fault_and_nothing_else(faulty):
    lines = faulty.lines(IDLE)  # (/get_server_info runs the idle check of an idle rank first)
    if faulty.message is None:
        assert lines == []
        wait_pool_idle(faulty.server.url, timeout=5)
        return
    assert lines and [m for m in MESSAGES if m in lines[0]] == [faulty.message], lines
    t0 = time.time()
    with pytest.raises(AssertionError):
        wait_pool_idle(faulty.server.url, timeout=1)  # (a leaked or twice-freed page: never idle; give up at once)
    assert time.time() - t0 < 30


def test_compiles_after_warmup_count_only_the_compile_fault(faulty):
    compiled = faulty.after["num_compiles_after_warmup"]
    if faulty.fault == "compile_while_serving":
        assert compiled >= 1 and faulty.lines(COMPILED)
        with pytest.raises(AssertionError):  # the teardown check of every test server fails on it alone
            check_clean(faulty.server.url)
    else:
        assert compiled == 0 and not faulty.lines(COMPILED)
