"""The host-memory tier of the prefix cache (--enable-hierarchical-cache: mem_cache/hi_radix_cache.py,
model_executor/host_kv.py) on real servers, with the exact page-ownership check after every step
(SGL_JAX_CHECK_KV_INVARIANTS=1: a violation counts in memory_errors, which the teardown asserts is 0).

Two servers with device pools too small for the workload:
- a tiny random Llama on 2 DP ranks x 2 tensor-parallel devices (virtual CPU devices: each rank's KV heads split
  over two devices, the host copies whole), cache_aware, write_through: a prompt pushed out of its
  rank's device pool by others comes back to that rank and is loaded from the host (``cached_tokens`` counts it,
  ``host_hit_tokens`` and ``sglang:hicache_host_hit_tokens_total`` count it), its output equal to the cold run's and
  its logprobs bit-equal to a device-cache hit's; concurrent requests over shared prefixes all equal their cold
  runs; a weight update and a memory release empty the host pool (its KV came from the weights before);
- a tiny random Gemma 3 (sliding window 16 on two of three layers), page size 4, write_back: the same load-back,
  every layer's KV in one pool.
After each test every rank is idle with both pools exact (free + cached == total).
"""

from __future__ import annotations

import concurrent.futures as cf
import random

import httpx
import pytest

from srt_helpers import check_clean, module_server, save_tiny_gemma3, save_tiny_llama, wait_pool_idle

XLA_ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "SGL_JAX_CHECK_KV_INVARIANTS": "1"}
PROMPT_LEN = 500  # tokens; two prompts overflow a rank's 768-token device pool
COMMON = ["--context-length", "1024", "--max-total-tokens", "768", "--chunked-prefill-size", "512",
          "--precompile-token-paddings", "64", "512", "--precompile-bs-paddings", "1", "8", "--max-running-requests", "8", "--enable-metrics",
          "--enable-hierarchical-cache"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("hicache_llama"), init_std=0.2)


@pytest.fixture(scope="module")
def llama_dp2(tiny_llama):
    model, tok = tiny_llama
    yield from module_server(["--model-path", model, "--tokenizer-path", tok, *COMMON, "--dp-size", "2", "--tp-size",
                              "2", "--load-balance-method", "cache_aware", "--hicache-ratio", "4"], env=XLA_ENV)


@pytest.fixture(scope="module")
def gemma_swa(tmp_path_factory):
    model, tok = save_tiny_gemma3(tmp_path_factory.mktemp("hicache_gemma"), window=16)
    yield from module_server(["--model-path", model, "--tokenizer-path", tok, *COMMON, "--page-size", "4",
                              "--hicache-write-policy", "write_back", "--hicache-size", "0.01"], env=XLA_ENV)


def prompts(seed: int, n: int, length: int = PROMPT_LEN) -> list:
    rng = random.Random(seed)
    return [[rng.randrange(2, 49152) for _ in range(length)] for _ in range(n)]  # (no shared BOS: nothing else on
    # the device matches them)


def generate(url: str, ids, n: int = 8) -> dict:
    r = httpx.post(url + "/generate", json={"input_ids": ids, "return_logprob": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": n, "ignore_eos": True}}, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    return {"ids": out["output_ids"], "cached": out["meta_info"]["cached_tokens"],
            "logprobs": [t[0] for t in out["meta_info"]["output_token_logprobs"]]}


def ranks(url: str) -> list:
    return httpx.get(url + "/get_server_info", timeout=30).json()["internal_states"]


def host_hits(url: str) -> int:
    return sum(st["host_hit_tokens"] for st in ranks(url))


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def check_load_back(url: str, seed: int, others: int, aligned: int) -> dict:
    """A prompt run cold, then from the device cache, then pushed out by `others` prompts and run again: its KV
    comes back from the host (`aligned` tokens: its prompt less the last token, whole pages), equal outputs."""
    a, *rest = prompts(seed, 1 + others)
    cold = generate(url, a)
    device = generate(url, a)
    assert (cold["cached"], device["cached"]) == (0, aligned)
    for p in rest:
        generate(url, p, n=2)
    hits = host_hits(url)
    host = generate(url, a)
    assert host["cached"] == aligned, "the evicted prefix was not served from the host pool"
    assert host_hits(url) - hits == aligned, "the host tier did not count the load-back"
    assert host["ids"] == cold["ids"] == device["ids"]
    assert host["logprobs"] == device["logprobs"], "KV loaded from the host differs from the device cache's"
    return host


def test_evicted_prefix_loads_back_from_host_dp2(llama_dp2):
    """Each rank's pool holds one 500-token prompt's KV: six others (three per rank) evict the first from its rank's
    device pool; cache_aware sends it back to the rank whose host pool holds it."""
    url = llama_dp2.url
    check_load_back(url, seed=0, others=6, aligned=PROMPT_LEN - 1)
    st = wait_pool_idle(url)
    assert metric(url, "sglang:hicache_host_hit_tokens_total") == host_hits(url) > 0
    assert metric(url, "sglang:hicache_host_used_tokens") == sum(r["host_kv_tokens_cached"] for r in st["dp_ranks"])
    for r in st["dp_ranks"]:
        assert r["host_kv_tokens_total"] == 4 * r["kv_tokens_total"] and r["host_written_tokens"] > 0, r
    assert all(r["prefix_cache"] == "hiradix" for r in st["dp_ranks"])


def test_concurrent_requests_over_evicted_prefixes_dp2(llama_dp2):
    """24 concurrent requests over 6 shared 300-token prefixes (more KV than both device pools hold): loads back,
    evictions and retracts under load; the outputs equal the same requests' sequential runs."""
    url = llama_dp2.url
    heads = prompts(1, 6, length=300)
    tails = prompts(2, 4, length=40)
    reqs = [h + t for t in tails for h in heads]
    want = [generate(url, ids, n=6)["ids"] for ids in reqs[:6]]
    hits = host_hits(url)
    with cf.ThreadPoolExecutor(12) as pool:
        outs = list(pool.map(lambda ids: generate(url, ids, n=6), reqs))
    assert [o["ids"] for o in outs[:6]] == want
    assert sum(o["cached"] for o in outs) > 0 and host_hits(url) > hits
    wait_pool_idle(url)


def test_update_and_release_empty_the_host_pool(llama_dp2, tiny_llama):
    """New weights (the same checkpoint, reloaded) and a KV release drop what the host pool holds: it was computed
    before them; after each, a prompt is recomputed once and then served from the caches again."""
    url = llama_dp2.url
    model = tiny_llama[0]
    a = prompts(3, 1)[0]
    cold = generate(url, a)
    for path, body in (("/update_weights_from_disk", {"model_path": model}),
                       ("/release_memory_occupation", {"tags": ["kv_cache"]})):
        r = httpx.post(url + path, json=body, timeout=300)
        assert r.status_code == 200 and r.json()["success"], r.text
        if path == "/release_memory_occupation":
            assert httpx.post(url + "/resume_memory_occupation", json={}, timeout=300).status_code == 200
        assert all(st["host_kv_tokens_cached"] == 0 for st in ranks(url)), ranks(url)
        again = generate(url, a)
        assert again["cached"] == 0 and again["ids"] == cold["ids"]
    check_clean(url)


def test_swa_model_loads_back_from_host(gemma_swa):
    """A sliding-window model (one KV pool for every layer under the host tier), pages of 4, write_back: the
    prefix's first 496 tokens (124 whole pages of its 499 reusable) come back from the host."""
    url = gemma_swa.url
    check_load_back(url, seed=4, others=2, aligned=(PROMPT_LEN - 1) // 4 * 4)
    st = wait_pool_idle(url)
    assert "swa_tokens_total" not in st and st["prefix_cache"] == "hiradix", st
    assert st["host_kv_tokens_total"] == int(0.01e9) // (2 * 3 * 2 * 16 * 4) // 4 * 4, st
