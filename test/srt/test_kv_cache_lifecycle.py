"""The KV cache lifecycle through a launched server (greedy, float32, real HTTP) of a tiny random Llama (2 layers,
weights at standard deviation 0.2 so that its greedy output follows the context, SmolLM2's tokenizer): the module
compares the engine with itself, and six SmolLM2 servers took ~260 s of the suite.

One workload -- three requests sharing a 1,000-token prefix plus short ones -- must give token-identical
outputs with and without the radix cache, with chunked prefill at 64 tokens and with it off, under forced
retract, and with 16-token pages; the baseline runs without the overlap scheduler, every scenario with it.
After every scenario the KV pool is back to free + cached.

One server per scenario (a module-scoped fixture, parametrized indirectly: pytest runs every test of a
scenario on its server, then stops it before starting the next); the chunk-interleaving and /flush_cache tests
run on the scenario server of their configuration. Every test flushes the cache, so the order does not matter.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from srt_helpers import ServerProcess, module_server, save_tiny_llama

GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
PREFIX_LEN = 1000


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> list:
    """The server flags of the tiny model: --model-path, --tokenizer-path (SmolLM2's)."""
    model, tokenizer = save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_kv"), init_std=0.2, max_positions=2048)
    return ["--model-path", model, "--tokenizer-path", tokenizer]


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 13} stones." for i in range(120))
    prefix = smollm2_tokenizer.encode(text)[:PREFIX_LEN]
    assert len(prefix) == PREFIX_LEN
    enc = smollm2_tokenizer.encode
    shared = [prefix + enc(" Question: how many stones are in box 3?"),
              prefix + enc(" Summarize the list in one sentence."),
              prefix + enc(" Which color comes after green?")]
    short = [enc("Hello, my name is"), enc("1, 2, 3, 4,"), enc("The capital of France is")]
    return shared, short


def generate(server, input_ids, sampling_params=GREEDY):
    r = httpx.post(server.url + "/generate", json={"input_ids": input_ids, "sampling_params": sampling_params},
                   timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def run_workload(server, prompts):
    """First request alone (so its prefix is cached when it finishes), then the rest as one batch."""
    shared, short = prompts
    return [generate(server, shared[0])] + generate(server, shared[1:] + short)


def state_of(server) -> dict:
    return httpx.get(server.url + "/get_server_info", timeout=30).json()["internal_states"][0]


def check_idle_accounting(server, radix: bool) -> dict:
    state = state_of(server)
    assert state["kv_tokens_in_use"] == 0 and state["kv_tokens_protected"] == 0
    assert state["kv_tokens_free"] + state["kv_tokens_cached"] == state["kv_tokens_total"]
    assert state["memory_errors"] == 0 and state["num_compiles_after_warmup"] == 0
    assert state["req_slots_free"] == state["max_running_requests"]
    if radix:
        assert state["kv_tokens_cached"] > 0
        assert httpx.post(server.url + "/flush_cache", json={}, timeout=30).status_code == 200
        after = state_of(server)
        assert after["kv_tokens_cached"] == 0 and after["kv_tokens_free"] == after["kv_tokens_total"]
    return state


def run_scenario(model_args: list, prompts, engine_args: dict, env: dict, radix: bool):
    server = ServerProcess(model_args, engine_args=engine_args, env=env)
    try:
        outs = run_workload(server, prompts)
        state = check_idle_accounting(server, radix)
    except BaseException:
        server.stop()
        raise
    server.stop_checked()
    return outs, state


@pytest.fixture(scope="module")
def baseline(tiny_model, prompts):
    """No prefix cache, no chunking, no overlap scheduler (every scenario runs with it): every prompt is prefilled
    whole and every step's result is applied before the next is chosen. One extend bucket, 2,048 tokens: the
    workload's two extends (the first request alone, then the other five, 2,035 tokens together) need no
    other."""
    outs, _ = run_scenario(tiny_model, prompts, {"disable_radix_cache": True, "chunked_prefill_size": -1,
                                     "disable_overlap_schedule": True, "precompile_token_paddings": [2048]}, {},
                           radix=False)
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in outs)
    return [o["output_ids"] for o in outs]


CHUNK64 = {"chunked_prefill_size": 64, "precompile_token_paddings": [64]}  # no extend is longer than a chunk
SCENARIOS = {
    "radix-chunk256": ({}, {}),  # the suite's defaults (SMALL_ENGINE_ARGS)
    "radix-chunk64": (CHUNK64, {}),
    # retract forced every few decode steps, on 16-token pages: retracted requests release their pages
    # and resume (re-prefilled through the radix cache) with the same tokens. Its programs are its own (the
    # page size shapes the KV buffers): only the buckets the workload uses are compiled (extends of up to one
    # 256-token chunk, at most 6 requests at once)
    "radix-page16-forced-retract": ({"page_size": 16, "precompile_token_paddings": [256],
                                     "precompile_bs_paddings": [1, 8], "max_running_requests": 8},
                                    {"SGL_JAX_TEST_RETRACT": "1"}),
    "no-radix-chunk64": ({**CHUNK64, "disable_radix_cache": True}, {}),
}


@pytest.fixture(scope="module")
def server(request, tiny_model, baseline):
    """The server of scenario `request.param` (stops with exit 0, no child left behind). Depends on
    `baseline` so that the baseline's server has come and gone before any scenario server starts. (Its own
    servers only: the module shares none with other modules, so that a pytest-xdist worker runs it beside them.)"""
    overrides, env = SCENARIOS[request.param]
    yield from module_server(tiny_model, engine_args=overrides, env=env)


@pytest.mark.parametrize("server", list(SCENARIOS), indirect=True)
def test_outputs_identical_and_kv_accounted(server, request, prompts, baseline):
    overrides, env = SCENARIOS[request.node.callspec.params["server"]]
    radix = not overrides.get("disable_radix_cache", False)
    assert httpx.post(server.url + "/flush_cache", json={}, timeout=30).status_code == 200
    outs = run_workload(server, prompts)
    state = check_idle_accounting(server, radix)
    assert [o["output_ids"] for o in outs] == baseline
    assert state["overlap_schedule"] and state["num_overlapped_steps"] > 0  # (the baseline's is off)
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    if radix:
        page = overrides.get("page_size", 1)
        assert cached[1] >= 992 and cached[1] == PREFIX_LEN // page * page
        assert cached[2] >= 992  # the third shares the prefix too (cached by the first)
        assert cached[3:] == [0, 0, 0]
    else:
        assert cached == [0] * len(outs)
    if env:
        assert state["num_retracted_reqs"] > 0


@pytest.mark.parametrize("server", ["radix-chunk64"], indirect=True)
def test_chunked_prefill_interleaves_with_running_streams(server, prompts):
    """While a 1,000-token prompt is prefilled in 64-token chunks (16 steps), a running stream keeps
    receiving tokens: a decode step runs between chunks."""
    assert httpx.post(server.url + "/flush_cache", json={}, timeout=30).status_code == 200  # all 16 chunks run
    arrivals = []
    started = threading.Event()

    def stream():
        body = {"text": "Count: 1, 2, 3,", "stream": True,
                "sampling_params": {"max_new_tokens": 120, "ignore_eos": True, "temperature": 0}}
        with httpx.stream("POST", server.url + "/generate", json=body, timeout=600) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(120)
    submitted = time.monotonic()
    long = httpx.post(server.url + "/generate", timeout=600, json={
        "input_ids": prompts[0][0], "sampling_params": {"max_new_tokens": 1}, "stream": True})
    first_token_of_long = time.monotonic()  # the whole response is one token: its arrival time
    assert long.status_code == 200
    t.join(600)
    during = [a for a in arrivals if submitted < a < first_token_of_long]
    assert len(during) >= 10, f"only {len(during)} stream tokens arrived during a 16-chunk prefill"
    check_idle_accounting(server, radix=True)


@pytest.mark.parametrize("server", ["radix-chunk256"], indirect=True)
def test_flush_cache_refused_while_running_and_disconnect_releases(server, prompts):
    """/flush_cache is refused while a request runs; a client that disconnects mid-stream has its
    request aborted and its KV released through the same path."""
    assert httpx.post(server.url + "/flush_cache", json={}, timeout=30).status_code == 200
    body = {"input_ids": prompts[0][0], "stream": True,
            "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=600) as resp:
        # hold the line iterator: a discarded one is finalized at once and closes the connection, and the
        # abort that follows could reach the scheduler before /flush_cache does (flaky: flush accepted)
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                assert json.loads(line[6:])["meta_info"]["completion_tokens"] >= 1
                break
        refused = httpx.post(server.url + "/flush_cache", json={}, timeout=30)
        assert refused.status_code == 400 and "running" in refused.text
    deadline = time.time() + 60  # the stream is closed: the request must be aborted and released
    while state_of(server)["num_running_reqs"] and time.time() < deadline:
        time.sleep(0.2)
    check_idle_accounting(server, radix=True)
