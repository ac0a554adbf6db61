"""The launched server over real HTTP on 127.0.0.1: OpenAI client, native API, errors, KV accounting."""

from __future__ import annotations

import asyncio
import json
import math
import os
import time

import httpx
import openai
import pytest

from srt_helpers import default_model_path, hf_greedy

CHAT_Q = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(default_server):
    return default_server  # conftest.py: the suite's shared server (SMALL_ENGINE_ARGS)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def served_name() -> str:
    """The default served model name: the GGUF file's name without .gguf."""
    return os.path.basename(default_model_path())[:-len(".gguf")]


def sse_events(response: httpx.Response):
    """The data payloads of an SSE response, in order (the last one is '[DONE]')."""
    return [line[len("data: "):] for line in response.text.split("\n") if line.startswith("data: ")]


def internal_state(server) -> dict:
    return httpx.get(server.url + "/get_server_info", timeout=30).json()["internal_states"][0]


def wait_idle(server, timeout=30.0) -> dict:
    deadline = time.time() + timeout
    while True:
        state = internal_state(server)
        if state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0 or time.time() > deadline:
            return state
        time.sleep(0.2)


# ---------------------------------------------------------------- OpenAI chat and completions
def test_chat_completion_answers_paris(server, client):
    r = client.chat.completions.create(model="anything", messages=CHAT_Q, max_tokens=32, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens > 10 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model == served_name()  # the model file's name, never its path; the request's need not match


def test_chat_completion_stream_matches_non_stream(server, client):
    full = client.chat.completions.create(model="m", messages=CHAT_Q, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model="m", messages=CHAT_Q, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens and not chunks[-1].choices
    raw = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                     json={"messages": CHAT_Q, "max_tokens": 4, "stream": True})
    events = sse_events(raw)
    assert raw.headers["content-type"].startswith("text/event-stream") and events[-1] == "[DONE]"
    assert all(json.loads(e)["object"] == "chat.completion.chunk" for e in events[:-1])


def test_completion_stream_and_non_stream(server, client):
    r = client.completions.create(model="m", prompt="1, 2, 3, 4,", max_tokens=8, temperature=0)
    assert r.choices[0].text.startswith(" 5, 6") and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.object == "text_completion"
    chunks = list(client.completions.create(model="m", prompt="1, 2, 3, 4,", max_tokens=8, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    # several prompts (also as token ids), n choices, echo
    r = client.completions.create(model="m", prompt=["Hello", "The capital of France is"], max_tokens=3,
                                  temperature=0, n=2, echo=True)
    assert len(r.choices) == 4 and [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text.startswith("Hello") and r.choices[2].text.startswith("The capital of France is")
    assert r.choices[0].text == r.choices[1].text  # greedy: both choices agree
    by_ids = client.completions.create(model="m", prompt=[504, 3575, 282, 4649, 314], max_tokens=3, temperature=0)
    assert "The capital of France is" + by_ids.choices[0].text == r.choices[2].text


def test_default_max_tokens_of_completions_is_16(server, client):
    r = client.completions.create(model="m", prompt="Once upon a time", temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16


def test_stop_strings(server, client):
    r = client.completions.create(model="m", prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[" 7"])
    assert r.choices[0].text == " 5, 6," and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="m", prompt="1, 2, 3, 4,", max_tokens=16, temperature=0,
                                            stop=[" 7"], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == " 5, 6,"
    r = client.chat.completions.create(model="m", messages=CHAT_Q, max_tokens=32, temperature=0, stop="Paris")
    assert "Paris" not in r.choices[0].message.content and r.choices[0].finish_reason == "stop"


def test_chat_logprobs(server, client):
    r = client.chat.completions.create(model="m", messages=CHAT_Q, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(c.token for c in content).startswith(r.choices[0].message.content)
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 3
        assert c.top_logprobs[0].token == c.token and abs(c.top_logprobs[0].logprob - c.logprob) < 1e-6
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)


def test_completion_logprobs_with_echo(server, client):
    r = client.completions.create(model="m", prompt="The capital of France is", max_tokens=2, temperature=0,
                                  logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.tokens) == 5 + 2
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    assert lp.top_logprobs[0] is None and all(len(t) == 2 for t in lp.top_logprobs[1:])


def test_native_generate_logprobs_and_batch(server):
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2, "return_text_in_logprobs": True}
    out = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    meta = out["meta_info"]
    assert out["text"].startswith(" Paris") and len(out["output_ids"]) == 4
    assert meta["input_token_logprobs"][0][0] is None and meta["input_token_logprobs"][1][2] == " capital"
    assert len(meta["output_token_logprobs"]) == 4 and len(meta["output_top_logprobs"][0]) == 2
    batch = httpx.post(server.url + "/generate", timeout=60, json={
        "text": ["Hello", "The capital of France is"], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()
    assert isinstance(batch, list) and batch[1]["output_ids"] == out["output_ids"]
    raw = httpx.post(server.url + "/generate", timeout=60, json={**body, "stream": True})
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["text"] == out["text"]


def test_twenty_concurrent_requests(server):
    prompts = ["Tell me about cats.", "What is 7 times 8?", "Name a color.", "Write a haiku about rain."]

    async def one(c, p):
        r = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": p}], max_tokens=24,
                                            temperature=0)
        return r.choices[0]

    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        solo = [await one(c, p) for p in prompts]
        together = await asyncio.gather(*(one(c, prompts[i % 4]) for i in range(20)))
        await c.close()
        return solo, together

    solo, together = asyncio.run(main())
    assert len(together) == 20 and all(ch.finish_reason in ("stop", "length") for ch in together)
    for i, ch in enumerate(together):  # continuous batching gives the same greedy answers as one at a time
        assert ch.message.content == solo[i % 4].message.content


# ---------------------------------------------------------------- errors
def _assert_openai_error(resp: httpx.Response, fragment: str):
    assert resp.status_code == 400, resp.text
    body = resp.json()
    assert body["object"] == "error" and body["code"] == 400 and body["type"] == "BadRequestError"
    assert fragment in body["message"], body["message"]


def test_error_cases_get_400_and_server_keeps_serving(server, client):
    u = server.url
    bad_json = httpx.post(u + "/v1/chat/completions", content=b"{not json", timeout=30,
                          headers={"content-type": "application/json"})
    _assert_openai_error(bad_json, "JSON")
    _assert_openai_error(httpx.post(u + "/v1/completions", json={"prompt": "hi", "max_tokens": "many"}, timeout=30),
                         "max_tokens")
    _assert_openai_error(httpx.post(u + "/v1/chat/completions", json={"messages": "hi"}, timeout=30), "messages")
    _assert_openai_error(httpx.post(u + "/v1/completions", json={"prompt": "hi", "max_tokens": -3}, timeout=30),
                         "max_tokens: Input should be greater than or equal to 0")
    _assert_openai_error(httpx.post(u + "/v1/chat/completions", json={"messages": CHAT_Q, "temperature": -0.5},
                                    timeout=30), "temperature: Input should be greater than or equal to 0")
    long_prompt = "hello " * 2100  # > 2048-token context
    _assert_openai_error(httpx.post(u + "/v1/completions", json={"prompt": long_prompt}, timeout=30),
                         "longer than the model's context length")
    streamed = httpx.post(u + "/v1/completions", json={"prompt": long_prompt, "stream": True}, timeout=30)
    _assert_openai_error(streamed, "context length")  # refused before the stream starts
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=CHAT_Q, temperature=-1)

    native = httpx.post(u + "/generate", content=b"[1, 2", timeout=30, headers={"content-type": "application/json"})
    assert native.status_code == 400 and "JSON" in native.json()["error"]["message"]
    native = httpx.post(u + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": -1}}, timeout=30)
    assert native.status_code == 400 and "max_new_tokens" in native.json()["error"]["message"]
    native = httpx.post(u + "/generate", json={"text": 5}, timeout=30)
    assert native.status_code == 400
    native = httpx.post(u + "/generate", json={"text": "hi", "bogus": 1}, timeout=30)
    assert native.status_code == 400 and "bogus" in native.json()["error"]["message"]

    r = client.chat.completions.create(model="m", messages=CHAT_Q, max_tokens=8, temperature=0)
    assert r.choices[0].message.content
    assert httpx.get(u + "/health", timeout=10).status_code == 200


# ---------------------------------------------------------------- control endpoints
def test_info_health_and_flush(server):
    u = server.url
    models = httpx.get(u + "/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == served_name() and models["data"][0]["max_model_len"] == 2048
    info = httpx.get(u + "/get_model_info", timeout=10).json()
    assert info["model_path"] == served_name() and info["is_generation"] is True  # SGLang's key, no disk path
    assert httpx.get(u + "/health", timeout=10).status_code == 200
    assert httpx.get(u + "/health_generate", timeout=60).status_code == 200
    wait_idle(server)
    assert httpx.post(u + "/flush_cache", json={}, timeout=10).status_code == 200


def test_abort_request_and_client_disconnect_free_the_kv(server):
    u = server.url
    body = {"text": "Count forever: 1, 2, 3,", "rid": "to-abort", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}}
    with httpx.stream("POST", u + "/generate", json=body, timeout=120) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert httpx.post(u + "/abort_request", json={"rid": "to-abort"}, timeout=10).status_code == 200
        events = [line[6:] for line in lines if line.startswith("data: ")]
    last = json.loads(events[-2])
    assert events[-1] == "[DONE]" and last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 400

    body["rid"] = "to-disconnect"
    with httpx.stream("POST", u + "/generate", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                break  # leave with the request still running: the client disconnects
    state = wait_idle(server)
    assert state["num_running_reqs"] == 0 and state["kv_tokens_in_use"] == 0


def test_cached_tokens_reported_in_usage(server, client):
    long_question = "Here are some facts about the solar system. " * 60 + "Which planet is largest?"
    msgs = [{"role": "user", "content": long_question}]
    first = client.chat.completions.create(model="m", messages=msgs, max_tokens=4, temperature=0)
    second = client.chat.completions.create(model="m", messages=msgs, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens > 500
    # the second request reuses the whole prompt except its last token (which must be computed for logits)
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    assert second.choices[0].message.content == first.choices[0].message.content
    body = {"text": long_question, "sampling_params": {"max_new_tokens": 1}}  # no chat template: new tokens
    before = httpx.post(server.url + "/generate", timeout=60, json=body).json()["meta_info"]
    after = httpx.post(server.url + "/generate", timeout=60, json=body).json()["meta_info"]
    assert before["cached_tokens"] < before["prompt_tokens"] - 1
    assert after["cached_tokens"] == after["prompt_tokens"] - 1


def test_flush_cache_refused_while_running_and_openai_stream_close_aborts(server, client):
    stream = client.completions.create(model="m", prompt="Count: 1, 2, 3,", max_tokens=500, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    refused = httpx.post(server.url + "/flush_cache", json={}, timeout=10)
    assert refused.status_code == 400 and "running" in refused.text
    stream.close()  # the openai client goes away mid-stream
    state = wait_idle(server)
    assert state["num_running_reqs"] == 0 and state["kv_tokens_in_use"] == 0 and state["kv_tokens_protected"] == 0


def test_kv_pool_is_free_when_idle(server):
    state = wait_idle(server)
    assert state["kv_tokens_in_use"] == 0 and state["kv_tokens_protected"] == 0 and state["num_waiting_reqs"] == 0
    assert state["kv_tokens_free"] + state["kv_tokens_cached"] == state["kv_tokens_total"] == 16384
    assert state["memory_errors"] == 0, "the idle accounting check found leaked KV"
    assert state["num_compiles_after_warmup"] == 0, "serving compiled a new shape"
    assert httpx.post(server.url + "/flush_cache", json={}, timeout=10).status_code == 200
    state = internal_state(server)
    assert state["kv_tokens_cached"] == 0 and state["kv_tokens_free"] == state["kv_tokens_total"]


def test_prefill_extend_needs_the_scoring_cache_flag(server, smollm2_tokenizer):
    """This server runs without --enable-scoring-cache: a request may not pick prefill_extend (its handles
    hold slots and KV), while auto picks packed and works."""
    labels = [smollm2_tokenizer.encode(" yes", add_special_tokens=False)[0]]
    body = {"query": "Is it about France? ", "items": ["Paris.", "Bananas."], "label_token_ids": labels}
    refused = httpx.post(server.url + "/v1/score", json={**body, "algorithm": "prefill_extend"}, timeout=60)
    assert refused.status_code == 400 and "--enable-scoring-cache" in refused.json()["message"]
    auto = httpx.post(server.url + "/v1/score", json=body, timeout=60)
    packed = httpx.post(server.url + "/v1/score", json={**body, "algorithm": "packed"}, timeout=60)
    assert auto.status_code == 200 and packed.status_code == 200
    for x, y in zip(auto.json()["scores"], packed.json()["scores"]):  # (the second one hits the radix cache)
        assert abs(math.log(x[0]) - math.log(y[0])) < 1e-4
    state = wait_idle(server)
    assert state["kv_tokens_in_use"] == 0 and state["num_score_handles"] == 0


def test_a_prompt_just_above_a_bucket_is_cut_and_matches_transformers(server, hf_smollm2, smollm2_tokenizer):
    """SMALL_ENGINE_ARGS' extend buckets are 64 and 256 with a 256-token chunk: a 100-token prompt runs as 64
    tokens, then 36 in a second 64-token step (ShapeBuckets.extend_cut; 128 tokens computed instead of 256), and
    its greedy tokens are transformers' own."""
    ids = smollm2_tokenizer.encode("The history of the city of Paris, told from its first settlers to the present "
                                   "day, in ten short chapters. " * 6, add_special_tokens=False)[:100]
    assert len(ids) == 100

    def cuts():
        return httpx.get(server.url + "/get_server_info", timeout=30).json()["internal_states"][0]["num_bucket_cuts"]

    before = cuts()
    r = httpx.post(server.url + "/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}, timeout=120)
    assert r.status_code == 200, r.text
    assert cuts() == before + 1
    assert r.json()["output_ids"] == hf_greedy(hf_smollm2, ids, 8)
