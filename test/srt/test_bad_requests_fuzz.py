"""Property: whatever values a client sends in any field of /generate's sampling params or the OpenAI
endpoints, the server answers without a 5xx, the scheduler stays up, and the KV pool ends idle.

Each example is a request whose fields are drawn from their valid ranges, edges included (int32 and
int64 limits, negative zero, the smallest and largest float32, seeds of any 64-bit width), and then, in
most examples, one field (or an unknown one) is replaced by an arbitrary value: out of range, NaN or an
infinity (sent as JSON's NaN / Infinity tokens), huge, empty, a lone surrogate, the wrong type. So the
valid requests run through the whole engine and every invalid value is met on its own. Generation
lengths stay tiny, so every example is bounded in time. Runs against conftest.hardened_server.
"""

from __future__ import annotations

import json
import os
import re

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from srt_helpers import API_KEY, wait_pool_idle

AUTH = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
# SGL_JAX_FUZZ_EXAMPLES raises the number of examples per endpoint for a longer hunt (CI: 40)
SETTINGS = settings(max_examples=int(os.environ.get("SGL_JAX_FUZZ_EXAMPLES", "40")), deadline=None,
                    suppress_health_check=list(HealthCheck))
VOCAB = 49152

EDGE_INTS = [0, 1, -1, 2, 20, 21, 128, 129, 2047, 2048, VOCAB - 1, VOCAB, 2**31 - 1, 2**31, -(2**31),
             -(2**31) - 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64, 10**30]
EDGE_FLOATS = [0.0, -0.0, 0.5, 1.0, 2.0, -1.0, 1e-45, 1e-300, 3.4e38, 3.5e38, 1e308, float("nan"), float("inf"),
               float("-inf")]
texts = st.text(max_size=12) | st.sampled_from(["", "\ud800", "<|im_end|>", "\x00", "a/b", " " * 30])
scalars = (st.sampled_from(EDGE_INTS) | st.integers() | st.sampled_from(EDGE_FLOATS) | st.floats() | st.booleans()
           | st.none() | texts)
anything = scalars | st.lists(scalars, max_size=3) | st.dictionaries(texts, scalars, max_size=2)

# valid values, edges included
token_ids = st.lists(st.sampled_from([0, 1, 2, VOCAB - 1]) | st.integers(0, VOCAB - 1), max_size=4)
small_len = st.integers(1, 4)  # generation lengths: every example stays short
seeds = st.sampled_from([0, 2**31 - 1, 2**31, 2**63, 2**64 - 1, -1, -(2**63)]) | st.integers(-(2**63), 2**64 - 1)
temperatures = st.sampled_from([0.0, -0.0, 1e-45, 1e-7, 0.7, 1.0, 2.0, 3.4e38]) | st.floats(0, 5)
top_ps = st.sampled_from([1.0, 1e-45, 0.5]) | st.floats(1e-9, 1.0)
top_ks = st.sampled_from([-1, 0, 1, 5, VOCAB - 1, VOCAB, 2**31 - 1]) | st.integers(-1, 100)
probs = st.sampled_from([0.0, -0.0, 1.0]) | st.floats(0, 1)
stops = st.none() | texts.filter(lambda t: "\ud800" not in t) | st.lists(st.sampled_from(["\n", ".", "the", "x"]),
                                                                         max_size=3)
valid_text = st.text(min_size=1, max_size=40).filter(str.strip) | st.sampled_from(["The capital of France is",
                                                                                  "<|im_start|>user"])

SAMPLING_PARAMS = st.fixed_dictionaries({"max_new_tokens": small_len}, optional=dict(
    min_new_tokens=st.integers(0, 1), stop=stops, stop_token_ids=token_ids, temperature=temperatures, top_p=top_ps,
    top_k=top_ks, min_p=probs, frequency_penalty=st.just(0.0), presence_penalty=st.just(-0.0),
    repetition_penalty=st.just(1.0), ignore_eos=st.booleans(), skip_special_tokens=st.booleans(),
    spaces_between_special_tokens=st.booleans(), no_stop_trim=st.booleans(), n=st.just(1), sampling_seed=seeds,
    seed=seeds))
GENERATE = st.fixed_dictionaries({"sampling_params": SAMPLING_PARAMS}, optional=dict(
    return_logprob=st.booleans(), logprob_start_len=st.sampled_from([-1, 0, 1]), top_logprobs_num=st.integers(0, 20),
    token_ids_logprob=token_ids, return_text_in_logprobs=st.booleans(), stream=st.booleans(),
    rid=st.uuids().map(str))).flatmap(
    lambda body: (st.fixed_dictionaries({"text": valid_text}) | st.fixed_dictionaries(
        {"input_ids": st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=6)})).map(lambda p: {**body, **p}))
OPENAI_COMMON = dict(
    temperature=temperatures, top_p=top_ps, n=st.integers(1, 3), stop=stops, presence_penalty=st.just(0.0),
    frequency_penalty=st.just(0.0), seed=seeds, logit_bias=st.just({}), user=texts, top_k=top_ks, min_p=probs,
    min_tokens=st.integers(0, 1), ignore_eos=st.booleans(), stop_token_ids=token_ids,
    skip_special_tokens=st.booleans(), no_stop_trim=st.booleans(), repetition_penalty=st.just(1.0),
    rid=st.uuids().map(str), stream=st.booleans(), model=texts,
    stream_options=st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}))
COMPLETIONS = st.fixed_dictionaries(
    {"prompt": valid_text | st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=6)
     | st.lists(valid_text, min_size=1, max_size=2), "max_tokens": small_len},
    optional=dict(OPENAI_COMMON, logprobs=st.integers(0, 20), echo=st.booleans(), best_of=st.integers(1, 3)))
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                           "content": valid_text}), min_size=1, max_size=3)
CHAT = st.fixed_dictionaries(
    {"messages": messages, "max_tokens": small_len},
    optional=dict(OPENAI_COMMON, max_completion_tokens=small_len, logprobs=st.booleans(),
                  top_logprobs=st.integers(0, 20))).map(
    lambda b: {**b, "logprobs": True} if b.get("top_logprobs") else b)  # top_logprobs needs logprobs

GENERATE_FIELDS = ["text", "input_ids", "return_logprob", "logprob_start_len", "top_logprobs_num",
                   "token_ids_logprob", "return_text_in_logprobs", "stream", "rid", "sampling_params", "bogus"] + [
    f"sampling_params.{k}" for k in ("max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "temperature",
                                     "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                                     "repetition_penalty", "ignore_eos", "skip_special_tokens",
                                     "spaces_between_special_tokens", "no_stop_trim", "n", "sampling_seed", "seed",
                                     "bogus")]
OPENAI_FIELDS = sorted(OPENAI_COMMON) + ["max_tokens", "logprobs", "bogus", "stream_options.include_usage"]
COMPLETIONS_FIELDS = OPENAI_FIELDS + ["prompt", "echo", "best_of", "suffix"]
CHAT_FIELDS = OPENAI_FIELDS + ["messages", "messages.0.content", "messages.0.role", "max_completion_tokens",
                               "top_logprobs", "tools", "response_format"]


LENGTH_FIELDS = {"max_new_tokens", "max_tokens", "max_completion_tokens"}
# a length replaced by anything but a long valid one (None: up to the context; 5..2047: long)
slow_free = anything.filter(lambda v: v is not None and not (type(v) is int and 4 < v < 2048))


def corrupt(data, body: dict, fields) -> dict:
    """In most examples, replace one field (dotted path) by an arbitrary value."""
    if data.draw(st.integers(0, 3), label="keep valid") == 0:
        return body
    path = data.draw(st.sampled_from(fields), label="field").split(".")
    node = body
    for key in path[:-1]:
        if isinstance(node, list):
            key = int(key)
        elif not isinstance(node.get(key), (dict, list)):
            node[key] = {}
        node = node[key]
    values = slow_free if path[-1] in LENGTH_FIELDS else anything
    node[int(path[-1]) if isinstance(node, list) else path[-1]] = data.draw(values, label="value")
    return body


def send(url: str, path: str, body: dict) -> None:
    """POST `body` (NaN and infinities written as JSON's NaN / Infinity tokens) and check the answer."""
    raw = json.dumps(body, allow_nan=True).encode()
    r = httpx.post(url + path, content=raw, headers=AUTH, timeout=120)
    if os.environ.get("SGL_JAX_FUZZ_LOG"):
        with open(os.environ["SGL_JAX_FUZZ_LOG"], "a") as f:
            f.write(f"{path} {r.status_code} {r.text[:160]!r}\n")
    assert r.status_code in (200, 400, 413), (path, body, r.status_code, r.text)
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        for line in re.split(r"\r\n|\r|\n", r.text):  # SSE's line ends only: str.splitlines also splits at
            # U+2028 and the like, which JSON leaves unescaped in a generated text
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event or event["error"].get("code", 400) < 500, (path, body, event)
    assert httpx.get(url + "/health", timeout=10).status_code == 200, "the scheduler went down"


@SETTINGS
@given(data=st.data())
def test_generate_fields(hardened_server, data):
    send(hardened_server.url, "/generate", corrupt(data, data.draw(GENERATE, label="body"), GENERATE_FIELDS))


@SETTINGS
@given(data=st.data())
def test_completions_fields(hardened_server, data):
    send(hardened_server.url, "/v1/completions", corrupt(data, data.draw(COMPLETIONS, label="body"),
                                                         COMPLETIONS_FIELDS))


@SETTINGS
@given(data=st.data())
def test_chat_completions_fields(hardened_server, data):
    send(hardened_server.url, "/v1/chat/completions", corrupt(data, data.draw(CHAT, label="body"), CHAT_FIELDS))


def test_pool_idle_after_fuzzing(hardened_server):
    wait_pool_idle(hardened_server.url, AUTH)
