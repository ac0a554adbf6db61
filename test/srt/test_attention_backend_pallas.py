"""`--attention-backend pallas` end to end on CPU: the server runs the Pallas TPU kernel in Pallas'
interpreter for every layer, and a greedy generation equals the native (pure-JAX) path token for token."""

from __future__ import annotations

import time

import httpx
import pytest

from srt_helpers import SMALL_ENGINE_ARGS, ServerProcess

# Few shapes: every layer of every compiled shape holds an interpreted kernel.
ARGS = dict(SMALL_ENGINE_ARGS, precompile_token_paddings=[64], precompile_bs_paddings=[1, 4],
            max_running_requests=4, max_total_tokens=4096, chunked_prefill_size=64)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    # longer than one 64-token extend step: chunked prefill, then decode over a 100+ token context
    "Here is a list of fruits, one per line, with their colours: " + ", ".join(["apple red", "banana yellow",
                                                                                  "grape purple"] * 8),
]
GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def native_ids(default_server):
    """The native backend's greedy tokens, from conftest's shared server (no Engine start of its own). It runs
    the suite's common shapes, not ARGS': greedy tokens do not depend on batch padding or prefill chunking
    (test_engine's batch invariance and test_kv_cache_lifecycle's scenarios check that), so a difference
    points at the kernel. The shared server may hold other modules' prefixes: flushed first, so that every
    prompt is prefilled whole, as on the Pallas server."""
    assert httpx.post(default_server.url + "/flush_cache", json={}, timeout=30).status_code == 200
    out = httpx.post(default_server.url + "/generate", json={"text": PROMPTS, "sampling_params": GREEDY},
                     timeout=600).json()
    return [o["output_ids"] for o in out]


@pytest.fixture(scope="module")
def pallas_server():
    s = ServerProcess(engine_args=dict(ARGS, attention_backend="pallas"))
    yield s
    s.stop_checked()


def test_pallas_interpret_generation_equals_native(pallas_server, native_ids):
    assert "Attention backend: pallas (--attention-backend pallas on cpu)" in pallas_server.log_text()
    out = httpx.post(pallas_server.url + "/generate", json={"text": PROMPTS, "sampling_params": GREEDY},
                     timeout=600).json()
    assert [o["output_ids"] for o in out] == native_ids
    assert all(len(ids) == GREEDY["max_new_tokens"] for ids in native_ids)
    # one at a time too (decode batches of 1 instead of 4)
    alone = httpx.post(pallas_server.url + "/generate", json={"text": PROMPTS[3], "sampling_params": GREEDY},
                       timeout=600).json()
    assert alone["output_ids"] == native_ids[3]
    deadline = time.time() + 30
    while True:
        state = httpx.get(pallas_server.url + "/get_server_info", timeout=30).json()["internal_states"][0]
        if state["num_running_reqs"] == 0 and state["kv_tokens_in_use"] == 0 or time.time() > deadline:
            break
        time.sleep(0.2)
    assert state["num_running_reqs"] == 0 and state["kv_tokens_in_use"] == 0
