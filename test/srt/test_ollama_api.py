"""Ollama's API (/api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version) against the launched
default server, through the real ``ollama`` Python client (a test dependency, imported at the top: a missing one
is an error, never a skip) and raw HTTP for the wire format (NDJSON lines, error bodies)."""

from __future__ import annotations

import asyncio
import datetime
import json
import os

import httpx
import ollama
import pytest

from sgl_jax.srt.entrypoints.ollama.serving import Outcome, Piece, Reply, ndjson_stream
from sgl_jax.srt.errors import RequestError
from sgl_jax.version import __version__
from srt_helpers import SMALL_ENGINE_ARGS, default_model_path, wait_pool_idle

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 12}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# the output schema of one call to get_weather in the llama3 tool-call format (the default parser): a `format`
# that makes the model's answer a call, so the tool-call parsing and its Ollama form are checked without
# tool_choice (Ollama has none)
CALL_FORMAT = {"type": "object", "properties": {"name": {"enum": ["get_weather"]},
                                                "parameters": {"type": "object",
                                                               "properties": {"city": {"enum": ["Paris"]}},
                                                               "required": ["city"], "additionalProperties": False}},
               "required": ["name", "parameters"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(default_server):
    return default_server  # conftest.py: the suite's shared server (SMALL_ENGINE_ARGS)


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, timeout=120)


def served_name() -> str:
    """The default served model name: the GGUF file's name without .gguf."""
    return os.path.basename(default_model_path())[:-len(".gguf")]


def assert_final(r, stream_chunk: bool = False) -> None:
    """An Ollama final object: done, a done_reason, the counts and the durations (ns)."""
    assert r.done is True and r.done_reason in ("stop", "length"), r
    assert r.model == served_name()
    assert r.prompt_eval_count > 10 and r.eval_count > 0
    assert r.total_duration >= r.prompt_eval_duration + r.eval_duration - 1 > 0 and r.load_duration == 0
    assert r.prompt_eval_duration > 0 and r.eval_duration > 0
    assert datetime.datetime.fromisoformat(r.created_at.replace("Z", "+00:00")).tzinfo is not None


def ndjson(response: httpx.Response) -> list:
    return [json.loads(line) for line in response.text.splitlines() if line]


# ---------------------------------------------------------------- /api/chat
def test_truncation_options_reach_the_sampler(client, server):
    """Ollama's min_p and typical_p (field_types.TruncationFields) are the OpenAI request's: a seeded, filtered
    chat gives the tokens /v1/chat/completions gives with the same values, and not those of the unfiltered one."""
    sampled = {"temperature": 1.5, "seed": 7, "num_predict": 24}
    filtered = {**sampled, "min_p": 0.2, "typical_p": 0.5}
    ours = client.chat(model="m", messages=QUESTION, options=filtered).message.content
    openai = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": QUESTION, "temperature": 1.5, "seed": 7, "max_tokens": 24, "min_p": 0.2, "typical_p": 0.5})
    assert openai.status_code == 200, openai.text
    assert ours == openai.json()["choices"][0]["message"]["content"]
    assert ours != client.chat(model="m", messages=QUESTION, options=sampled).message.content


def test_chat_non_stream_and_stream_agree(client):
    full = client.chat(model="anything:latest", messages=QUESTION, options=GREEDY)
    assert_final(full)
    assert full.message.role == "assistant" and full.message.content and not full.message.tool_calls
    chunks = list(client.chat(model="x", messages=QUESTION, options=GREEDY, stream=True))
    assert [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(c.message.content for c in chunks) == full.message.content
    assert_final(chunks[-1])
    assert chunks[-1].message.content == "" and chunks[-1].eval_count == full.eval_count
    assert chunks[-1].prompt_eval_count == full.prompt_eval_count and chunks[-1].done_reason == full.done_reason


def test_chat_matches_openai_chat(server, client):
    """The same greedy chat through /api/chat and /v1/chat/completions: same text and token counts."""
    r = client.chat(model="m", messages=QUESTION, options=GREEDY)
    o = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": QUESTION, "max_tokens": 12, "temperature": 0}).json()
    assert r.message.content == o["choices"][0]["message"]["content"]
    assert (r.prompt_eval_count, r.eval_count) == (o["usage"]["prompt_tokens"], o["usage"]["completion_tokens"])
    assert r.done_reason == o["choices"][0]["finish_reason"]


def test_chat_wire_format_is_ndjson(server):
    """Streaming is the default (no "stream" field), one JSON object per line, Ollama's media type."""
    resp = httpx.post(server.url + "/api/chat", timeout=60,
                      json={"model": "m", "messages": QUESTION, "options": {"temperature": 0, "num_predict": 4}})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/x-ndjson")
    lines = ndjson(resp)
    assert len(lines) >= 2 and all(set(x) >= {"model", "created_at", "message", "done"} for x in lines)
    assert lines[-1]["done_reason"] == "length" and lines[-1]["eval_count"] == 4
    assert all(x["message"] == {"role": "assistant", "content": x["message"]["content"]} for x in lines)
    assert set(lines[-1]) >= {"total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration",
                              "eval_count", "eval_duration"}


def test_chat_stop_option_and_length(client):
    r = client.chat(model="m", messages=QUESTION, options={"temperature": 0, "num_predict": 3})
    assert r.done_reason == "length" and r.eval_count == 3
    full = client.chat(model="m", messages=QUESTION, options=GREEDY)
    word = full.message.content.split()[1]
    r = client.chat(model="m", messages=QUESTION, options={**GREEDY, "stop": [word]})
    assert r.done_reason == "stop" and word not in r.message.content and r.eval_count < full.eval_count


def test_format_json_and_schema(server, client):
    schema = {"type": "object", "properties": {"capital": {"enum": ["Paris", "Lyon"]}}, "required": ["capital"],
              "additionalProperties": False}
    r = client.chat(model="m", messages=QUESTION, format=schema, options={"temperature": 0, "num_predict": 24})
    assert json.loads(r.message.content) in ({"capital": "Paris"}, {"capital": "Lyon"}) and r.done_reason == "stop"
    # "json": any JSON object, the grammar of OpenAI's json_object (a free object may run past num_predict, so
    # the check is that both APIs constrain the output alike)
    prompt = "Give the capital of France as a JSON object."
    r = client.generate(model="m", prompt=prompt, format="json", options={"temperature": 0, "num_predict": 16})
    o = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "temperature": 0,
        "response_format": {"type": "json_object"}}).json()
    assert r.response == o["choices"][0]["message"]["content"] and r.response.startswith("{")
    free = client.generate(model="m", prompt=prompt, options={"temperature": 0, "num_predict": 16})
    assert free.response != r.response


def test_num_predict_is_a_cap_not_an_error(server, client):
    """Ollama's num_predict stops the output there or at the end of the context, whichever is first: a long
    prompt with a num_predict past the context is served (an OpenAI max_tokens would answer 400)."""
    context = SMALL_ENGINE_ARGS["context_length"]
    text = " hello" * (context - 40)
    count = httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=30).json()["count"]
    text = " hello" * (context - 40 + (context - 6 - count))  # about 6 tokens short of the context
    r = client.generate(model="m", prompt=text, raw=True, options={"temperature": 0, "num_predict": 100})
    assert context - 10 < r.prompt_eval_count < context and r.prompt_eval_count + r.eval_count <= context
    assert r.done_reason == "stop" or r.eval_count == context - r.prompt_eval_count
    r = client.chat(model="m", messages=[{"role": "user", "content": " hello" * (context - 60)}],
                    options={"temperature": 0, "num_predict": 100})
    assert context - 100 < r.prompt_eval_count < context and r.prompt_eval_count + r.eval_count <= context
    assert r.done_reason == "stop" or r.eval_count == context - r.prompt_eval_count


def test_tool_call_comes_back_with_object_arguments(client):
    tools = [WEATHER_TOOL]
    r = client.chat(model="m", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                    tools=tools, format=CALL_FORMAT, options={"temperature": 0, "num_predict": 40})
    assert_final(r)
    assert r.message.content == "" and len(r.message.tool_calls) == 1
    call = r.message.tool_calls[0].function
    assert call.name == "get_weather" and call.arguments == {"city": "Paris"}
    chunks = list(client.chat(model="m", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                              tools=tools, format=CALL_FORMAT, options={"temperature": 0, "num_predict": 40},
                              stream=True))
    calls = [tc for c in chunks for tc in (c.message.tool_calls or [])]
    assert [(tc.function.name, dict(tc.function.arguments)) for tc in calls] == [("get_weather", {"city": "Paris"})]
    assert chunks[-1].done and not any(c.done for c in chunks[:-1])
    # tools with a free answer: whatever the model says parses as Ollama's ChatResponse (the client validates)
    r = client.chat(model="m", messages=QUESTION, tools=tools, options=GREEDY)
    assert_final(r)


def test_tool_history_is_rendered(server):
    """An assistant turn with Ollama tool calls (object arguments) and the tool's result (tool_name) render
    into the prompt: the prompt grows by them."""
    question = [{"role": "user", "content": "What is the weather in Toronto?"}]
    history = question + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Toronto"}}}]},
        {"role": "tool", "content": "11 degrees celsius and sunny", "tool_name": "get_weather"}]

    def prompt_tokens(messages):
        resp = httpx.post(server.url + "/api/chat", timeout=60, json={
            "model": "m", "messages": messages, "tools": [WEATHER_TOOL], "stream": False,
            "options": {"temperature": 0, "num_predict": 4}})
        assert resp.status_code == 200, resp.text
        assert resp.headers["content-type"].startswith("application/json") and resp.json()["done"] is True
        return resp.json()["prompt_eval_count"]

    assert prompt_tokens(history) > prompt_tokens(question) + 5


def test_chat_logprobs(client):
    r = client.chat(model="m", messages=QUESTION, options={"temperature": 0, "num_predict": 5}, logprobs=True,
                    top_logprobs=2)
    assert len(r.logprobs) == r.eval_count == 5
    assert all(lp.logprob <= 0 and len(lp.top_logprobs) == 2 for lp in r.logprobs)
    assert "".join(lp.token for lp in r.logprobs) == r.message.content


# ---------------------------------------------------------------- /api/generate
def test_generate_non_stream_and_stream_agree(server, client):
    full = client.generate(model="m", prompt="What is the capital of France?", options=GREEDY)
    assert_final(full)
    chat = client.chat(model="m", messages=QUESTION, options=GREEDY)  # the prompt is one user turn
    assert full.response == chat.message.content and full.prompt_eval_count == chat.prompt_eval_count
    chunks = list(client.generate(model="m", prompt="What is the capital of France?", options=GREEDY, stream=True))
    assert "".join(c.response for c in chunks) == full.response
    assert chunks[-1].done and chunks[-1].response == "" and chunks[-1].eval_count == full.eval_count
    with_system = client.generate(model="m", prompt="What is the capital of France?", system="Answer briefly.",
                                  options=GREEDY)
    assert with_system.prompt_eval_count != full.prompt_eval_count


def test_generate_raw_matches_completions(server, client):
    prompt = "Q: What is the capital of France?\nA: The capital of France is"
    r = client.generate(model="m", prompt=prompt, raw=True, options={"temperature": 0, "num_predict": 8})
    o = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": 8, "temperature": 0}).json()
    assert r.response == o["choices"][0]["text"] and r.eval_count == o["usage"]["completion_tokens"]
    assert r.prompt_eval_count == o["usage"]["prompt_tokens"] and r.done_reason == "length"
    chunks = list(client.generate(model="m", prompt=prompt, raw=True, stream=True,
                                  options={"temperature": 0, "num_predict": 8}))
    assert "".join(c.response for c in chunks) == r.response and chunks[-1].eval_count == 8
    lp = client.generate(model="m", prompt=prompt, raw=True, logprobs=True, top_logprobs=1,
                         options={"temperature": 0, "num_predict": 3})
    assert [x.token for x in lp.logprobs] and "".join(x.token for x in lp.logprobs) == lp.response
    assert all(len(x.top_logprobs) == 1 for x in lp.logprobs)


def test_empty_prompt_loads(client):
    """Ollama's "load the model" requests: no prompt / no messages answer done with done_reason "load"."""
    r = client.generate(model="m")
    assert r.done and r.done_reason == "load" and r.response == ""
    r = client.chat(model="m", messages=[])
    assert r.done and r.done_reason == "load" and r.message.content == ""


# ---------------------------------------------------------------- model listing
def test_tags_show_ps_version(server, client):
    listed = client.list().models
    assert [m.model for m in listed] == [served_name()]
    m = listed[0]
    assert m.size == os.path.getsize(default_model_path()) and len(m.digest) == 64
    assert (m.details.format, m.details.family, m.details.quantization_level) == ("gguf", "llama", "Q4_1")
    assert m.details.parameter_size == "134.52M" and m.modified_at.tzinfo is not None
    shown = client.show(served_name() + ":latest")
    assert shown.modelinfo["llama.context_length"] == SMALL_ENGINE_ARGS["context_length"]
    assert shown.modelinfo["general.parameter_count"] == 134515008 and shown.modelinfo["llama.block_count"] == 30
    assert "completion" in shown.capabilities and "tools" in shown.capabilities and "im_start" in shown.template
    assert shown.details.family == "llama" and "num_ctx" in shown.parameters
    with pytest.raises(ollama.ResponseError) as e:
        client.show("llama3.2")
    assert e.value.status_code == 404 and e.value.error == "model 'llama3.2' not found"
    running = client.ps().models
    assert [p.model for p in running] == [served_name()] and running[0].context_length == 2048
    assert running[0].size_vram == m.size and running[0].expires_at.year == 9999
    assert httpx.get(server.url + "/api/version", timeout=10).json() == {"version": __version__}


# ---------------------------------------------------------------- errors
def test_errors_name_the_field(server, client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="m", messages=QUESTION, options={"temperature": -1})
    assert e.value.status_code == 400 and "options.temperature" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:  # refused before the stream starts: a real 400
        list(client.chat(model="m", messages=QUESTION, options={"top_p": 0}, stream=True))
    assert e.value.status_code == 400 and "options.top_p" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="m", prompt="def f(x):", suffix="    return y")
    assert e.value.status_code == 400 and "suffix" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="m", messages=QUESTION, think=True)
    assert e.value.status_code == 400 and "does not support thinking" in e.value.error
    cases = [({"model": "m", "messages": "hi"}, "messages"),
             ({"model": "m", "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
             ({"model": "m", "messages": QUESTION, "format": "xml"}, "format"),
             ({"model": "m", "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, "images"),
             ({"messages": QUESTION}, "model")]
    for body, field in cases:
        resp = httpx.post(server.url + "/api/chat", json=body, timeout=30)
        assert resp.status_code == 400 and set(resp.json()) == {"error"} and field in resp.json()["error"], body
    resp = httpx.post(server.url + "/api/generate", timeout=30,
                      json={"model": "m", "prompt": "hi", "raw": True, "system": "be brief"})
    assert resp.status_code == 400 and resp.json() == {"error": "raw mode does not support template, system, or "
                                                                "context"}


def test_unknown_options_are_ignored(client):
    r = client.chat(model="m", messages=QUESTION, options={**GREEDY, "num_ctx": 8192, "mirostat": 2, "numa": True})
    assert r.message.content == client.chat(model="m", messages=QUESTION, options=GREEDY).message.content


def test_error_after_the_stream_started_is_an_error_line():
    """A failure mid-stream: the objects sent so far, then the line {"error": ...} (the client raises on it)."""
    async def pieces():
        yield Piece("Hel")
        raise RequestError("the engine failed", 500)
        yield Outcome("stop", 1, 1)  # (never reached)

    async def lines():
        return [json.loads(x) async for x in ndjson_stream(pieces(), Reply("m", "generate"))]

    out = asyncio.run(lines())
    assert out[0]["response"] == "Hel" and out[0]["done"] is False and out[1] == {"error": "the engine failed"}


def test_client_leaving_mid_stream_aborts(server):
    """Closing a stream after two lines aborts the request: the server is idle again at once (the format keeps
    the model from ending before its 1000 tokens)."""
    long_output = {"type": "array", "items": {"type": "integer"}, "minItems": 1000}
    with httpx.stream("POST", server.url + "/api/chat", timeout=60, json={
            "model": "m", "messages": QUESTION, "format": long_output, "options": {"num_predict": 1000}}) as resp:
        lines = resp.iter_lines()
        assert json.loads(next(lines))["done"] is False and json.loads(next(lines))["done"] is False
    assert wait_pool_idle(server.url, timeout=20)["num_running_reqs"] == 0


def test_server_idle_and_clean_after_module(server):
    wait_pool_idle(server.url)
