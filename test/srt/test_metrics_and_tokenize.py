"""Operations endpoints on one launched server: /metrics (Prometheus), /tokenize and /detokenize, the API key's
reach, /v1/models with --served-model-name, /get_model_info and /health_generate.

The server is conftest.hardened_server (API key, --enable-metrics, --served-model-name), shared with
test_bad_requests: the metric checks look at differences between two scrapes, not at fresh counters."""

from __future__ import annotations

import types

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from srt_helpers import API_KEY, SERVED_MODEL_NAME, SMALL_ENGINE_ARGS

KEY = API_KEY
AUTH = {"Authorization": f"Bearer {KEY}"}
NAME = SERVED_MODEL_NAME
PROMPT = "The capital of France is"

COUNTERS = ("sglang:prompt_tokens", "sglang:generation_tokens", "sglang:cached_tokens", "sglang:num_requests")
GAUGES = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate",
          "sglang:num_used_tokens", "sglang:max_total_num_tokens")
HISTOGRAMS = ("sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds",
              "sglang:e2e_request_latency_seconds")


@pytest.fixture(scope="module")
def server(hardened_server):
    return hardened_server  # conftest.py: stops with exit 0 and no child left behind at the end of the session


def scrape(server) -> dict:
    """{family name: (type, {sample name: value})} of /metrics, fetched without the API key."""
    r = httpx.get(server.url + "/metrics", timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            assert s.labels.get("model_name") == NAME, s
        out[fam.name] = (fam.type, {s.name + (f"[{s.labels['le']}]" if "le" in s.labels else ""): s.value
                                    for s in fam.samples})
    return out


def value(metrics: dict, family: str, sample: str) -> float:
    return metrics[family][1][sample]


def generate(server, text: str, max_new_tokens: int, stream: bool = False):
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                              "ignore_eos": True}, "stream": stream}
    r = httpx.post(server.url + "/generate", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r


# ---------------------------------------------------------------- /metrics
def test_metric_names_and_types(server):
    m = scrape(server)
    for name in COUNTERS:
        assert m[name][0] == "counter" and name + "_total" in m[name][1]
    for name in GAUGES:
        assert m[name][0] == "gauge" and name in m[name][1]
    for name in HISTOGRAMS:
        assert m[name][0] == "histogram"
        assert {name + "_count", name + "_sum", name + "_bucket[+Inf]"} <= set(m[name][1])


def test_counters_and_histograms_follow_one_request(server):
    before = scrape(server)
    meta = generate(server, PROMPT, 6).json()["meta_info"]
    after = scrape(server)

    def delta(family, sample):
        return value(after, family, sample) - value(before, family, sample)

    assert meta["completion_tokens"] == 6
    assert delta("sglang:prompt_tokens", "sglang:prompt_tokens_total") == meta["prompt_tokens"]
    assert delta("sglang:generation_tokens", "sglang:generation_tokens_total") == meta["completion_tokens"]
    assert delta("sglang:cached_tokens", "sglang:cached_tokens_total") == meta["cached_tokens"]
    assert delta("sglang:num_requests", "sglang:num_requests_total") == 1
    for name in ("sglang:time_to_first_token_seconds", "sglang:e2e_request_latency_seconds"):
        assert delta(name, name + "_count") == 1
        assert 0 < delta(name, name + "_sum") < 120
    # not streamed: one output at the end, so no gap between two outputs to observe
    assert delta("sglang:inter_token_latency_seconds", "sglang:inter_token_latency_seconds_count") == 0


def test_streamed_request_observes_inter_token_latency_per_token(server):
    before = scrape(server)
    r = generate(server, "One, two, three,", 5, stream=True)
    assert r.text.rstrip().endswith("data: [DONE]")
    after = scrape(server)
    itl = "sglang:inter_token_latency_seconds"
    # --stream-interval 1: the first output brings the first token (TTFT), each later one one more token
    assert value(after, itl, itl + "_count") - value(before, itl, itl + "_count") == 4
    ttft = "sglang:time_to_first_token_seconds"
    assert value(after, ttft, ttft + "_count") - value(before, ttft, ttft + "_count") == 1
    gen = "sglang:generation_tokens"
    assert value(after, gen, gen + "_total") - value(before, gen, gen + "_total") == 5


def test_gauges_are_sane_and_cache_hits_are_counted(server):
    long_prompt = "Paris is the capital and largest city of France. " * 4
    generate(server, long_prompt, 1)
    meta = generate(server, long_prompt, 1).json()["meta_info"]  # the same prompt again: a prefix cache hit
    assert meta["cached_tokens"] > 0
    m = scrape(server)
    state = httpx.get(server.url + "/get_server_info", headers=AUTH, timeout=30).json()["internal_states"][0]
    assert 0.0 <= value(m, "sglang:token_usage", "sglang:token_usage") <= 1.0
    assert value(m, "sglang:max_total_num_tokens", "sglang:max_total_num_tokens") == state["kv_tokens_total"]
    assert 0 <= value(m, "sglang:num_used_tokens", "sglang:num_used_tokens") <= state["kv_tokens_total"]
    assert value(m, "sglang:num_running_reqs", "sglang:num_running_reqs") >= 0
    assert value(m, "sglang:num_queue_reqs", "sglang:num_queue_reqs") >= 0
    rate = value(m, "sglang:cache_hit_rate", "sglang:cache_hit_rate")
    total = value(m, "sglang:prompt_tokens", "sglang:prompt_tokens_total")
    cached = value(m, "sglang:cached_tokens", "sglang:cached_tokens_total")
    assert 0.0 < rate <= 1.0 and rate == pytest.approx(cached / total)


def test_metrics_route_exists_only_with_the_flag():
    from sgl_jax.srt.entrypoints.http_server import build_app
    from sgl_jax.srt.metrics.collector import MetricsCollector
    from sgl_jax.srt.server_args import ServerArgs

    def paths(metrics):
        return set(build_app(types.SimpleNamespace(metrics=metrics), ServerArgs(), None).openapi()["paths"])

    assert "/metrics" not in paths(None)  # FastAPI answers 404
    assert "/metrics" in paths(MetricsCollector(NAME))


def test_collectors_use_private_registries():
    from prometheus_client import REGISTRY

    from sgl_jax.srt.metrics.collector import MetricsCollector

    a, b = MetricsCollector("a"), MetricsCollector("b")  # same names twice: no clash
    assert a.registry is not b.registry and a.registry is not REGISTRY
    assert REGISTRY.get_sample_value("sglang:prompt_tokens_total", {"model_name": "a"}) is None


# ---------------------------------------------------------------- /tokenize and /detokenize
def test_tokenize_matches_the_servers_tokenizer(server, smollm2_tokenizer):
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["tokens"] == smollm2_tokenizer.encode(PROMPT)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == SMALL_ENGINE_ARGS["context_length"]
    info = httpx.get(server.url + "/get_model_info", headers=AUTH, timeout=30).json()
    assert out["max_model_len"] == info["context_length"]
    meta = generate(server, PROMPT, 1).json()["meta_info"]
    assert meta["prompt_tokens"] == out["count"]

    texts = [PROMPT, "héllo wörld 🙂", ""]
    batch = httpx.post(server.url + "/v1/tokenize", json={"prompt": texts, "add_special_tokens": False,
                                                          "model": "anything"}, headers=AUTH, timeout=30).json()
    expected = [smollm2_tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert batch["tokens"] == expected and batch["count"] == [len(x) for x in expected]
    empty = httpx.post(server.url + "/tokenize", json={"prompt": []}, headers=AUTH, timeout=30).json()
    assert empty["tokens"] == [] and empty["count"] == []


def test_detokenize_inverts_tokenize(server, smollm2_tokenizer):
    text = "Hello, world! Ünïcödé 🙂 text."
    ids = httpx.post(server.url + "/tokenize", json={"prompt": text}, headers=AUTH, timeout=30).json()["tokens"]
    r = httpx.post(server.url + "/detokenize", json={"tokens": ids}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json() == {"text": smollm2_tokenizer.decode(ids, skip_special_tokens=True)}
    assert r.json()["text"].strip() == text
    batch = httpx.post(server.url + "/v1/detokenize", json={"tokens": [ids, [], ids[:2]]}, headers=AUTH,
                       timeout=30).json()
    assert batch["text"] == [smollm2_tokenizer.decode(x, skip_special_tokens=True) for x in (ids, [], ids[:2])]
    assert httpx.post(server.url + "/detokenize", json={"tokens": []}, headers=AUTH, timeout=30).json() == {"text": ""}


@pytest.mark.parametrize("body", [{"tokens": [1, 49152]}, {"tokens": [[1, 2], [2**31 - 1]]}, {"tokens": [-1]},
                                  {"tokens": [1.5]}, {"tokens": "12"}, {"tokens": [True]}, {}])
def test_detokenize_refuses_bad_ids(server, body):
    r = httpx.post(server.url + "/detokenize", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    assert "tokens" in r.json()["error"]["message"]
    if body.get("tokens") == [1, 49152]:
        assert "vocabulary" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/detokenize", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["object"] == "error"  # OpenAI's error object under /v1/


@pytest.mark.parametrize("body", [{"prompt": 5}, {"prompt": [PROMPT, 3]}, {"prompt": PROMPT, "add_special_tokens": 1},
                                  {}])
def test_tokenize_refuses_bad_bodies(server, body):
    r = httpx.post(server.url + "/tokenize", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text


def test_tokenize_refuses_a_text_that_cannot_fit_without_tokenizing_it(server):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "x" * 400_000}, headers=AUTH, timeout=30)
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"], r.text


# ---------------------------------------------------------------- API key, model name, info
def test_api_key_guards_everything_but_health_and_metrics(server):
    for path in ("/health", "/health_generate", "/metrics"):
        assert httpx.get(server.url + path, timeout=60).status_code == 200, path
    for method, path in (("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/tokenize"),
                         ("GET", "/v1/models"), ("GET", "/get_model_info"), ("GET", "/get_server_info"),
                         ("POST", "/generate")):
        for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY}):
            r = httpx.request(method, server.url + path, json={"prompt": "x"}, headers=headers, timeout=30)
            assert r.status_code == 401, (method, path, headers, r.text)
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}, headers=AUTH, timeout=30).status_code == 200


def test_served_model_name_and_model_info(server):
    models = httpx.get(server.url + "/v1/models", headers=AUTH, timeout=30).json()
    assert [m["id"] for m in models["data"]] == [NAME]
    info = httpx.get(server.url + "/get_model_info", headers=AUTH, timeout=30).json()
    assert info["served_model_name"] == NAME and info["model_path"] == NAME and info["is_generation"] is True
    r = httpx.post(server.url + "/v1/completions", json={"model": "x", "prompt": PROMPT, "max_tokens": 1},
                   headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == NAME
    assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 200
