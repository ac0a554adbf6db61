"""The KV cache lifecycle through the real engine (SmolLM2, greedy, float32).

One workload -- two requests sharing a 1,000-token prefix plus short ones -- must give token-identical
outputs with and without the radix cache, with chunked prefill at 64 tokens and with it off, under forced
retract, and with 16-token pages. After every scenario the KV pool is back to free + cached.
"""

from __future__ import annotations

import os

import pytest

from sgl_jax import Engine
from srt_helpers import SMALL_ENGINE_ARGS

GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
PREFIX_LEN = 1000


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


def run_workload(engine, prompts):
    """First request alone (so its prefix is cached when it finishes), then the rest as one batch."""
    shared, short = prompts
    first = engine.generate(input_ids=shared[0], sampling_params=GREEDY)
    rest = engine.generate(input_ids=shared[1:] + short, sampling_params=GREEDY)
    return [first] + rest


def check_idle_accounting(engine, radix: bool):
    state = engine.get_server_info()["internal_states"][0]
    assert state["kv_tokens_in_use"] == 0 and state["kv_tokens_protected"] == 0
    assert state["kv_tokens_free"] + state["kv_tokens_cached"] == state["kv_tokens_total"]
    assert state["memory_errors"] == 0 and state["num_compiles_after_warmup"] == 0
    assert state["req_slots_free"] == state["max_running_requests"]
    if radix:
        assert state["kv_tokens_cached"] > 0
        assert engine.flush_cache().success
        state = engine.get_server_info()["internal_states"][0]
        assert state["kv_tokens_cached"] == 0 and state["kv_tokens_free"] == state["kv_tokens_total"]
    return state


@pytest.fixture(scope="module")
def baseline(prompts):
    """No prefix cache, no chunking: every prompt is prefilled whole."""
    with Engine(**{**SMALL_ENGINE_ARGS, "disable_radix_cache": True, "chunked_prefill_size": -1,
                   "precompile_token_paddings": [64, 256, 2048]}) as engine:
        outs = run_workload(engine, prompts)
        check_idle_accounting(engine, radix=False)
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in outs)
    return [o["output_ids"] for o in outs]


SCENARIOS = {
    "radix-chunk256": ({}, {}),
    "radix-chunk64": ({"chunked_prefill_size": 64}, {}),
    "radix-forced-retract": ({}, {"SGL_JAX_TEST_RETRACT": "1"}),
    "radix-page16": ({"page_size": 16}, {}),
    "no-radix-chunk64": ({"disable_radix_cache": True, "chunked_prefill_size": 64}, {}),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_outputs_identical_and_kv_accounted(name, prompts, baseline):
    overrides, env = SCENARIOS[name]
    radix = not overrides.get("disable_radix_cache", False)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # read by the scheduler process at start
    try:
        with Engine(**{**SMALL_ENGINE_ARGS, **overrides}) as engine:
            outs = run_workload(engine, prompts)
            state = check_idle_accounting(engine, radix)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert [o["output_ids"] for o in outs] == baseline
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


def test_flush_cache_refused_while_running_and_client_abort_releases(prompts):
    """/flush_cache is refused while a request runs; an aborted request's KV is released the same way."""
    import asyncio

    with Engine(**SMALL_ENGINE_ARGS) as engine:
        shared, _ = prompts

        async def main():
            agen = await engine.async_generate(input_ids=shared[0], stream=True,
                                               sampling_params={"max_new_tokens": 200, "ignore_eos": True})
            first = await agen.__anext__()
            refused = engine.flush_cache()
            await agen.aclose()  # the client goes away mid-stream: the request is aborted
            return first, refused

        first, refused = asyncio.run(main())
        assert first["meta_info"]["completion_tokens"] >= 1
        assert not refused.success and "running" in refused.message
        import time

        deadline = time.time() + 30
        while engine.get_server_info()["internal_states"][0]["num_running_reqs"] and time.time() < deadline:
            time.sleep(0.2)
        check_idle_accounting(engine, radix=True)
