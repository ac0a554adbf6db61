"""sglang-router (PyPI ``sglang-router``, its cache-aware policy) in front of two real sgl-jax servers: the
way SGLang users run replicas (docs/parallelism.md).

- /generate (plain and streaming), /v1/completions and /v1/chat/completions through the router give what
  the workers give;
- cache-aware routing: requests sharing a long prefix go to one worker and are served from its radix cache;
- both workers take traffic (round robin), and report their load (/get_load);
- a stream aborted by its client through the router leaves both workers' KV pools idle.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
import sglang_router  # noqa: F401  (a test dependency: RouterProcess runs `python -m sglang_router.launch_router`)

from srt_helpers import RouterProcess, module_server, wait_pool_idle

WORKER_ARGS = ["--enable-metrics"]  # the flags of conftest.default_server, worker_a


@pytest.fixture(scope="module")
def worker_a(default_server):
    return default_server  # conftest.py: the suite's shared server, the same flags as worker_b


@pytest.fixture(scope="module")
def worker_b():
    yield from module_server(WORKER_ARGS)


@pytest.fixture(scope="module")
def router(worker_a, worker_b):
    r = RouterProcess([worker_a.url, worker_b.url], ["--policy", "cache_aware"])
    try:
        yield r
    finally:
        r.stop()


def generate(url: str, text: str, **sampling) -> dict:
    r = httpx.post(url + "/generate", timeout=120,
                   json={"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 8, **sampling}})
    assert r.status_code == 200, r.text
    return r.json()


def finished_requests(url: str) -> float:
    """sglang:num_requests_total of one worker (its /metrics)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(m) for m in re.findall(r"^sglang:num_requests_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


def test_endpoints_through_the_router(router, worker_a):
    import openai

    prompt = "The capital of France is"
    direct = generate(worker_a.url, prompt)["text"]
    assert generate(router.url, prompt)["text"] == direct
    with httpx.stream("POST", router.url + "/generate", timeout=120, json={
            "text": prompt, "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["text"] == direct
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=120)
    completion = client.completions.create(model="m", prompt=prompt, temperature=0, max_tokens=8)
    assert completion.choices[0].text == direct
    chat = client.chat.completions.create(model="m", temperature=0, max_tokens=8,
                                          messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in chat.choices[0].message.content
    stream = client.chat.completions.create(model="m", temperature=0, max_tokens=8, stream=True,
                                            messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_cache_aware_routing_reuses_a_shared_prefix(router):
    prefix = "You are a careful assistant. " * 40  # ~280 tokens shared by every request
    cached, prompt_tokens = [], []
    for i in range(6):
        meta = generate(router.url, prefix + f"Question {i}: what is {i} + {i}?", max_new_tokens=2)["meta_info"]
        cached.append(meta["cached_tokens"])
        prompt_tokens.append(meta["prompt_tokens"])
    shared = prompt_tokens[0] - 12  # the prefix's tokens (the question adds ~12)
    assert all(c >= 0.9 * shared for c in cached[1:]), (cached, prompt_tokens)


def test_both_workers_take_traffic(worker_a, worker_b):
    """Round robin spreads requests over both workers. (The cache-aware policy of sglang-router 0.3.2 sent
    unrelated one-at-a-time requests all to one worker in our runs: it balances by load only past
    --balance-abs-threshold requests.)"""
    rr = RouterProcess([worker_a.url, worker_b.url], ["--policy", "round_robin"])
    try:
        before = finished_requests(worker_a.url), finished_requests(worker_b.url)
        for i in range(8):
            generate(rr.url, f"{i}: unrelated words about topic {i * 7919}", max_new_tokens=1)
        after = finished_requests(worker_a.url), finished_requests(worker_b.url)
    finally:
        rr.stop()
    assert after[0] - before[0] == 4 and after[1] - before[1] == 4, (before, after)


def test_workers_report_their_load_to_the_router(router, worker_a):
    """SGLang's /get_load (polled by the router): one entry per data-parallel rank."""
    load = httpx.get(worker_a.url + "/get_load", timeout=30).json()
    assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}], load
    loads = httpx.get(router.url + "/get_loads", timeout=30).json()["workers"]
    assert len(loads) == 2 and all(w["load"] >= 0 for w in loads), loads


def test_aborted_stream_through_the_router_frees_kv(router, worker_a, worker_b):
    body = {"text": "Count slowly:", "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 1800, "ignore_eos": True}}
    with httpx.stream("POST", router.url + "/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        for n, _ in enumerate(r.iter_lines()):
            if n >= 6:
                break  # leave mid-stream: the router must pass the disconnect on to the worker
    for w in (worker_a, worker_b):
        wait_pool_idle(w.url, timeout=30)  # 1800 tokens would take minutes: idle means aborted
