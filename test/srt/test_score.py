"""/v1/score and Engine.score on the real SmolLM2 model.

The three algorithms (serial, packed, prefill_extend) must agree within 1e-4 in log-probability, and
each must agree within 1e-3 with transformers' next-token log-probabilities computed for every scored
sequence separately -- with and without a delimiter, with apply_softmax true and false, for text and
token-id inputs, and for item_first. Then the scoring-cache handle lifecycle (cache miss, TTL eviction,
concurrent requests, aborts) and every error case, with the KV pool back to free + cached afterwards.

The HTTP tests run on conftest.hardened_server (its delimiter: the newline token; at most 64 items; the API key).
"""

import asyncio
import math
import time

import httpx
import numpy as np
import pytest
import torch

from srt_helpers import API_KEY, SHARED_ENGINE_ARGS
from sgl_jax.srt.io_struct import ScoreSeq
from sgl_jax.srt.tokenizer.tokenizer_manager import RequestError

MODES = ("serial", "packed", "prefill_extend")
TRANSFORMERS_ATOL = 1e-3  # |log-probability - transformers'| (the test names state these bounds)
SAME_SCORES_ATOL = 1e-4  # |log-probability difference| of the same scores computed two ways (algorithms, inputs)
TTL_S = SHARED_ENGINE_ARGS["multi_item_prefill_extend_cache_timeout"]
QUERY = ("Question: which of the following passages says something true about the capital city of "
         "France, its history, its monuments or its inhabitants? Answer yes or no for each passage. ") * 4
ITEMS = [
    "Paris is the capital of France.",
    "Bananas are yellow.",
    "x",
    "The Eiffel Tower was completed in 1889 for the World's Fair and is one of the most visited "
    "monuments on Earth, with millions of visitors every single year from all over the world.",
    "Berlin is the capital of Germany.",
    "Paris has about two million inhabitants within the city limits.",
    "Cats sleep a lot.",
    "The Louvre is a museum in Paris.",
]


@pytest.fixture(scope="module")
def labels(smollm2_tokenizer):
    return [smollm2_tokenizer.encode(w, add_special_tokens=False)[0] for w in (" yes", " no", " maybe")]


@pytest.fixture(scope="module")
def engine(shared_engine):
    # conftest.py: SHARED_ENGINE_ARGS (packs of at most 300 tokens, so that packed requests are split into
    # several packs; TTL_S; 3 items per extend request), shared with test_engine.py; no memory error at the end
    return shared_engine


AUTH = {"authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(hardened_server):
    return hardened_server  # conftest.py: --multi-item-scoring-delimiter scoring_delimiter, --max-multi-item-count 64


def state(engine) -> dict:
    return engine._run(engine.tokenizer_manager.get_internal_state())


def wait_idle(get_state, timeout: float = 30.0) -> dict:
    """Wait until no score work is left; then the KV pool must be free + cached (nothing in use)."""
    deadline = time.time() + timeout
    while True:
        st = get_state()
        if (st["num_score_groups"] == 0 and st["num_score_handles"] == 0 and st["num_waiting_reqs"] == 0
                and st["kv_tokens_in_use"] == 0) or time.time() > deadline:
            break
        time.sleep(0.2)
    assert st["num_score_groups"] == 0 and st["num_score_handles"] == 0
    assert st["kv_tokens_in_use"] == 0, st
    assert st["kv_tokens_protected"] == 0
    assert st["kv_tokens_free"] + st["kv_tokens_cached"] == st["kv_tokens_total"]
    assert st["memory_errors"] == 0
    return st


def prefix_special(tok):
    """The tokenizer's leading special tokens (what the engine puts once at the start)."""
    with_special, plain = tok.encode("a"), tok.encode("a", add_special_tokens=False)
    return with_special[:len(with_special) - len(plain)]


def hf_label_logprobs(hf, seqs, labels):
    """transformers: log-softmax of the next-token logits after each sequence, at the labels (float64)."""
    out = []
    with torch.no_grad():
        for s in seqs:
            logits = hf(torch.tensor([s])).logits[0, -1].double()
            out.append(torch.log_softmax(logits, -1)[labels].numpy())
    return np.asarray(out)


def as_logprobs(scores, apply_softmax, ref_lp):
    """Engine scores -> log-probabilities, and the reference's log-probabilities in the same convention."""
    ours = np.log(np.asarray(scores, np.float64))
    ref = ref_lp - np.log(np.exp(ref_lp).sum(-1, keepdims=True)) if apply_softmax else ref_lp
    return ours, ref


def check_modes(results: dict, ref_lp, apply_softmax):
    base = None
    for mode, scores in results.items():
        ours, ref = as_logprobs(scores, apply_softmax, ref_lp)
        assert ours.shape == ref.shape
        assert np.abs(ours - ref).max() < TRANSFORMERS_ATOL, (mode, np.abs(ours - ref).max())
        if base is None:
            base = ours
        assert np.abs(ours - base).max() < SAME_SCORES_ATOL, (mode, np.abs(ours - base).max())
    if apply_softmax:
        for scores in results.values():
            np.testing.assert_allclose(np.asarray(scores).sum(-1), 1.0, rtol=1e-9)


# ---------------------------------------------------------------- Engine: numerics
@pytest.mark.parametrize("apply_softmax", [False, True])
def test_modes_agree_within_1e_4_and_match_transformers_within_1e_3(engine, hf_smollm2, smollm2_tokenizer, labels,
                                                                     apply_softmax):
    tok = smollm2_tokenizer
    q = tok.encode(QUERY, add_special_tokens=False)
    assert len(q) > 128, "the query must span several attention KV blocks"
    seqs = [prefix_special(tok) + q + tok.encode(it, add_special_tokens=False) for it in ITEMS]
    ref = hf_label_logprobs(hf_smollm2, seqs, labels)
    results = {m: engine.score(QUERY, ITEMS, labels, apply_softmax=apply_softmax, algorithm=m) for m in MODES}
    check_modes(results, ref, apply_softmax)
    wait_idle(lambda: state(engine))


def test_token_ids_within_1e_4_of_text_and_item_first_within_1e_3_of_transformers(engine, hf_smollm2,
                                                                                    smollm2_tokenizer, labels):
    tok = smollm2_tokenizer
    q = tok.encode(QUERY, add_special_tokens=False)
    items = [tok.encode(it, add_special_tokens=False) for it in ITEMS[:5]]
    ref = hf_label_logprobs(hf_smollm2, [q + it for it in items], labels)
    results = {m: engine.score(q, items, labels, algorithm=m) for m in MODES}
    check_modes(results, ref, False)
    special = prefix_special(tok)
    if not special:  # token ids are used as given; text adds only the tokenizer's leading specials
        text = engine.score(QUERY, ITEMS[:5], labels, algorithm="packed")
        np.testing.assert_allclose(np.log(text), np.log(results["packed"]), atol=SAME_SCORES_ATOL)

    # item_first: item + query, computed by the serial algorithm (auto picks it)
    ref = hf_label_logprobs(hf_smollm2, [special + it + q for it in items], labels)
    check_modes({"auto": engine.score(QUERY, ITEMS[:5], labels, item_first=True)}, ref, False)
    with pytest.raises(RequestError, match="item_first"):
        engine.score(QUERY, ITEMS[:5], labels, item_first=True, algorithm="packed")
    wait_idle(lambda: state(engine))


def test_items_longer_than_a_chunk(engine, labels):
    """An item longer than --chunked-prefill-size (256 here) is prefilled in chunks from the handle's
    query: its partial KV must never enter the prefix cache (the handle owns the query's pages)."""
    items = ["Short one.", "A much longer passage about Paris and its river. " * 30, "Another short one."]
    query = "A query that no earlier test has sent, so the handle owns all of its KV. " * 3
    ext = engine.score(query, items, labels, algorithm="prefill_extend")  # first: nothing cached yet
    wait_idle(lambda: state(engine))
    serial = engine.score(query, items, labels, algorithm="serial")
    np.testing.assert_allclose(np.log(ext), np.log(serial), atol=SAME_SCORES_ATOL)
    wait_idle(lambda: state(engine))


# ---------------------------------------------------------------- Engine: handle lifecycle
def test_cache_miss_aborts_cleanly(engine, labels):
    client = engine.tokenizer_manager.score_client
    with pytest.raises(RequestError, match="missing or expired") as err:
        engine._run(client.extend("miss-1", "no-such-handle", [ScoreSeq([1, 2, 3], [3 + 2])], labels))
    assert err.value.status_code == 400
    wait_idle(lambda: state(engine))


def test_ttl_eviction_frees_the_kv(engine, labels, smollm2_tokenizer):
    client = engine.tokenizer_manager.score_client
    before = state(engine)
    q = smollm2_tokenizer.encode("An unused query that will expire. " * 8, add_special_tokens=False)
    engine._run(client.prefill("ttl-handle", q))
    st = state(engine)
    assert st["num_score_handles"] == 1
    assert st["kv_tokens_in_use"] + st["kv_tokens_protected"] >= len(q), "the handle holds the query's KV"
    # touch-on-access: an extend within the TTL keeps it alive past the first deadline
    time.sleep(TTL_S * 0.6)
    engine._run(client.extend("ttl-touch", "ttl-handle", [ScoreSeq([5, 6], [len(q) + 1])], labels))
    time.sleep(TTL_S * 0.6)
    assert state(engine)["num_score_handles"] == 1, "the extend must have refreshed the TTL"
    deadline = time.time() + TTL_S + 10
    while state(engine)["num_score_handles"] and time.time() < deadline:
        time.sleep(0.3)
    st = wait_idle(lambda: state(engine))
    assert st["num_expired_score_handles"] == before["num_expired_score_handles"] + 1
    with pytest.raises(RequestError, match="missing or expired"):
        engine._run(client.extend("ttl-late", "ttl-handle", [ScoreSeq([5, 6], [len(q) + 1])], labels))


def test_concurrent_requests_with_different_queries(engine, labels):
    queries = [QUERY, "Is this sentence about food? " * 5, "Rate the sentiment of the review. " * 7]
    alone = [engine.score(q, ITEMS, labels, algorithm=m) for q, m in zip(queries, MODES[::-1])]

    async def together():
        return await asyncio.gather(*(engine.async_score(q, ITEMS, labels, algorithm=m)
                                      for q, m in zip(queries * 2, MODES[::-1] + MODES)))

    both = asyncio.run(together())
    for i, res in enumerate(both):
        np.testing.assert_allclose(np.log(res), np.log(alone[i % 3]), atol=SAME_SCORES_ATOL)
    wait_idle(lambda: state(engine))


@pytest.mark.parametrize("mode", ["prefill_extend", "packed"])
def test_abort_mid_request_releases_everything(engine, labels, mode):
    items = [f"Passage number {i} talks about something else entirely." for i in range(300)]

    async def start_and_cancel():
        task = asyncio.ensure_future(engine.async_score(QUERY, items, labels, algorithm=mode))
        await asyncio.sleep(1.5)
        assert not task.done(), "the request finished before it could be aborted"
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(start_and_cancel())
    wait_idle(lambda: state(engine))
    # the engine keeps serving
    assert len(engine.score(QUERY, ITEMS[:2], labels)) == 2


# ---------------------------------------------------------------- HTTP: delimiter, shapes, errors
def http_state(server) -> dict:
    return httpx.get(server.url + "/get_server_info", headers=AUTH, timeout=30).json()["internal_states"][0]


def post_score(server, body, timeout=120):
    return httpx.post(server.url + "/v1/score", json=body, headers=AUTH, timeout=timeout)


@pytest.mark.parametrize("apply_softmax", [False, True])
def test_http_delimiter_modes_agree_within_1e_4_and_match_transformers_within_1e_3(
        server, hf_smollm2, smollm2_tokenizer, labels, scoring_delimiter, apply_softmax):
    tok = smollm2_tokenizer
    q = tok.encode(QUERY, add_special_tokens=False)
    d = [scoring_delimiter]
    seqs = [prefix_special(tok) + q + d + tok.encode(it, add_special_tokens=False) + d for it in ITEMS]
    ref = hf_label_logprobs(hf_smollm2, seqs, labels)
    results = {}
    for mode in MODES + ("auto",):
        r = post_score(server, {"query": QUERY, "items": ITEMS, "label_token_ids": labels,
                                "apply_softmax": apply_softmax, "algorithm": mode, "model": "m"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "scoring" and body["model"]
        assert body["usage"]["prompt_tokens"] == sum(len(s) for s in seqs) == body["usage"]["total_tokens"]
        results[mode] = body["scores"]
    check_modes(results, ref, apply_softmax)
    wait_idle(lambda: http_state(server))


def test_http_errors_are_400_and_server_keeps_serving(server, labels):
    good = {"query": "Is it relevant?", "items": ["yes it is", "no"], "label_token_ids": labels}
    cases = {
        "empty items": {**good, "items": []},
        "mixed text and ids": {**good, "items": ["text", [1, 2, 3]]},
        "mixed query ids, item text": {**good, "query": [1, 2, 3]},
        "label outside vocab": {**good, "label_token_ids": [labels[0], 10**6]},
        "negative label": {**good, "label_token_ids": [-1]},
        "no labels": {**good, "label_token_ids": []},
        "too many items": {**good, "items": ["a"] * 65},
        "longer than the context": {**good, "query": "word " * 2100},
        "unknown field": {**good, "bogus": 1},
        "bad algorithm": {**good, "algorithm": "magic"},
        "item_first with packed": {**good, "item_first": True, "algorithm": "packed"},
        "empty item": {**good, "items": ["a", ""]},
        "item ids outside vocab": {**good, "query": [1, 2], "items": [[3, 10**7]]},
        "not json": None,
    }
    for name, body in cases.items():
        if body is None:
            r = httpx.post(server.url + "/v1/score", content=b"{nope", timeout=30,
                           headers={**AUTH, "content-type": "application/json"})
        else:
            r = post_score(server, body)
        assert r.status_code == 400, (name, r.status_code, r.text)
        assert r.json()["object"] == "error" and r.json()["message"], name
    r = post_score(server, good)
    assert r.status_code == 200 and len(r.json()["scores"]) == 2
    wait_idle(lambda: http_state(server))


def test_http_client_disconnect_aborts(server, labels):
    items = [f"Passage number {i} talks about something else entirely, at some length. " * 3 for i in range(64)]
    with pytest.raises(httpx.ReadTimeout):
        post_score(server, {"query": QUERY * 2, "items": items, "label_token_ids": labels,
                            "algorithm": "prefill_extend"}, timeout=1.0)
    st = wait_idle(lambda: http_state(server))
    assert st["num_score_handles"] == 0
    assert "Client disconnected: aborting score request" in server.log_text()
    r = post_score(server, {"query": "Is it relevant?", "items": ["yes"], "label_token_ids": labels})
    assert r.status_code == 200


def test_scores_are_probabilities(engine, labels):
    s = engine.score(QUERY, ITEMS[:3], labels, apply_softmax=False)
    assert all(0.0 < x < 1.0 for row in s for x in row)
    assert all(sum(row) <= 1.0 for row in s)
    assert not math.isnan(sum(map(sum, s)))
