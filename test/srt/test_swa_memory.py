"""Hybrid SWA KV memory end to end: real servers on a tiny random Gemma 3 (sliding window W on 2 of 3 layers).

- A separate, smaller SWA pool, with SWA KV freed as it leaves the window, generates exactly the tokens of the
  one-pool reference (--disable-hybrid-swa-memory, which only masks) across radix cache on (SWARadixCache)
  and off (ChunkCache) x page sizes 1/4/16 x chunked prefill W/2 and 2W x forced retract (each value of each
  dimension with both cache kinds); both pools idle after each run. Two rounds: the second extends the
  first round's prompts + outputs (and half-prompts), so with the radix cache it reuses cached prefixes
  whose SWA KV was partly released or evicted (tombstones) -- under SWA-pool pressure in the radix configs.
  /v1/score (a query longer than the window, items shorter and longer than it) gives the reference's label
  log-probabilities on every configuration.
- Capacity: an SWA pool of 1,024 tokens (W = 32) runs eight concurrent 600-token prompts with 64 new tokens
  each, all admitted at once; with SWA release disabled the same run never has them all admitted.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from sgl_jax.srt.mem_cache.swa_allocator import split_hybrid_budget
from srt_helpers import module_server, save_tiny_gemma3, wait_pool_idle

W = 16
NEW_TOKENS = 24
PROMPT_LENGTHS = [W - 1, W, W + 1, 3 * W + 5, 100, 300]
BUDGET = 4096  # --max-total-tokens: one pool's tokens for every layer


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    return save_tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3_swa"), window=W)


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 49000, n).tolist() for n in lengths]


def _second_round(prompts, outputs):
    """Round 2: each prompt + its output + 7 new tokens, and each prompt's first half + 9 new tokens."""
    rng = np.random.default_rng(1)
    return ([p + o + rng.integers(100, 49000, 7).tolist() for p, o in zip(prompts, outputs)]
            + [p[:len(p) // 2] + rng.integers(100, 49000, 9).tolist() for p in prompts])


def _score(url):
    """/v1/score of a 3W-token query and three items (one longer than the window): label log-probabilities."""
    rng = np.random.default_rng(2)
    body = {"query": rng.integers(100, 49000, 3 * W).tolist(), "label_token_ids": [100, 2000, 30000],
            "items": [rng.integers(100, 49000, n).tolist() for n in (3, W + 5, 7)], "apply_softmax": False}
    r = httpx.post(url + "/v1/score", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return np.array(r.json()["scores"])


def _generate_all(url, prompts, new_tokens, meta=None):
    def one(ids):
        r = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}, timeout=600)
        assert r.status_code == 200, r.text
        if meta is not None:
            meta.append(r.json()["meta_info"])
        return r.json()["output_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _serve(model, *args, env=None, radix=False):
    model_dir, tokenizer = model
    return module_server(["--model-path", model_dir, "--tokenizer-path", tokenizer,
                          *([] if radix else ["--disable-radix-cache"]), *args], env=env)


@pytest.fixture(scope="module")
def reference_tokens(tiny_gemma3):
    """Greedy tokens of the one-pool server (windows only masked): (round 1, round 2 prompts, round 2),
    and its /v1/score label log-probabilities."""
    gen = _serve(tiny_gemma3, "--disable-hybrid-swa-memory", "--max-total-tokens", str(BUDGET))
    server = next(gen)
    try:
        state = httpx.get(server.url + "/get_server_info").json()["internal_states"][0]
        assert "swa_tokens_total" not in state
        first = _generate_all(server.url, _prompts(PROMPT_LENGTHS), NEW_TOKENS)
        second_prompts = _second_round(_prompts(PROMPT_LENGTHS), first)
        second = _generate_all(server.url, second_prompts, NEW_TOKENS)
        yield first, second_prompts, second, _score(server.url)
        wait_pool_idle(server.url)
    finally:
        next(gen, None)


# each of radix on/off meets page 1/4/16, chunk W/2 and 2W (a chunk is at least a page), and forced retract; the radix configs' SWA pools
# are small (ratio 1/16: 682 tokens) so that cached SWA KV is evicted and tombstones are matched through
CONFIGS = [(False, 1, W // 2, False, 0.25), (False, 4, 2 * W, True, 0.25), (False, 16, 2 * W, False, 0.25),
           (True, 1, W // 2, True, 0.0625), (True, 4, 2 * W, False, 0.0625), (True, 16, 2 * W, True, 0.0625)]


@pytest.mark.parametrize("radix,page_size,chunk,retract,ratio", CONFIGS,
                         ids=[f"{'radix' if c[0] else 'chunkcache'}-page{c[1]}-chunk{c[2]}{'-retract' if c[3] else ''}"
                              for c in CONFIGS])
def test_hybrid_pool_matches_one_pool(tiny_gemma3, reference_tokens, radix, page_size, chunk, retract, ratio):
    gen = _serve(tiny_gemma3, "--page-size", str(page_size), "--chunked-prefill-size", str(chunk),
                 "--swa-full-tokens-ratio", str(ratio), "--max-total-tokens", str(BUDGET), radix=radix,
                 env={"SGL_JAX_TEST_RETRACT": "1"} if retract else None)
    server = next(gen)
    first, second_prompts, second, scores = reference_tokens
    try:
        state = httpx.get(server.url + "/get_server_info").json()["internal_states"][0]
        full, swa = split_hybrid_budget(BUDGET, 1, 2, ratio, page_size)  # 1 full + 2 sliding-window layers
        assert (state["kv_tokens_total"], state["swa_tokens_total"]) == (full, swa)
        assert _generate_all(server.url, _prompts(PROMPT_LENGTHS), NEW_TOKENS) == first
        wait_pool_idle(server.url)
        meta = []
        assert _generate_all(server.url, second_prompts, NEW_TOKENS, meta) == second
        np.testing.assert_allclose(_score(server.url), scores, atol=1e-4)  # reranking on the hybrid pools
        state = wait_pool_idle(server.url)
        if radix:  # round 2 reused round 1's KV (prefixes longer than the window)
            assert max(m["cached_tokens"] for m in meta) > W
            assert state["swa_tokens_free"] + state["swa_tokens_cached"] == state["swa_tokens_total"]
        else:
            assert state["swa_tokens_free"] == state["swa_tokens_total"]
        if retract:
            assert state["num_retracted_reqs"] > 0
    finally:
        next(gen, None)


CAPACITY_W = 32


@pytest.fixture(scope="module")
def tiny_gemma3_w32(tmp_path_factory):
    return save_tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3_w32"), window=CAPACITY_W)


@pytest.mark.parametrize("swa_release", [True, False])
def test_swa_release_capacity(tiny_gemma3_w32, swa_release):
    """--max-total-tokens 3414 at ratio 0.125: full pool 8193 tokens, SWA pool 1024 (W = 32). Eight 600-token
    prompts (64 new tokens each) hold 5,312 full tokens; with SWA release each holds about W + 2 pages of SWA
    KV once prefilled, without it its whole length (664 > 1024 / 2)."""
    gen = _serve(tiny_gemma3_w32, "--swa-full-tokens-ratio", "0.125", "--max-total-tokens", "3414",
                 "--chunked-prefill-size", "256", env=None if swa_release else {"SGL_JAX_DISABLE_SWA_RELEASE": "1"})
    server = next(gen)
    try:
        state = httpx.get(server.url + "/get_server_info").json()["internal_states"][0]
        assert state["swa_tokens_total"] == 1024 and state["kv_tokens_total"] >= 8 * 664
        outs = _generate_all(server.url, _prompts([600] * 8, seed=1), 64)
        assert all(len(o) == 64 for o in outs)
        state = wait_pool_idle(server.url)
        print(f"SWA release {swa_release}: at most {state['peak_running_reqs']} of 8 requests admitted at once")
        if swa_release:
            assert state["peak_running_reqs"] == 8
        else:
            assert state["peak_running_reqs"] < 8
    finally:
        next(gen, None)
