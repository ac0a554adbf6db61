"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) with the ``anthropic`` Python client against
the launched server (the default SmolLM2 model): plain and streamed messages, system prompts, stop sequences,
a tool round trip, structured output, prefill, token counting, Anthropic's error bodies, ``x-api-key`` auth;
and the stream translation itself (thinking blocks, a mid-stream error) on made-up chat chunks."""

from __future__ import annotations

import asyncio
import json
import os

import anthropic
import httpx
import jsonschema
import pytest

from sgl_jax.srt.entrypoints.anthropic.protocol import AnthropicMessagesRequest, AnthropicToolChoice
from sgl_jax.srt.entrypoints.anthropic.serving import (
    chat_request,
    message_events,
    message_from_chat,
    sampling_fields,
    sse_events,
    stop_reason,
)
from sgl_jax.srt.errors import RequestError
from srt_helpers import API_KEY, default_model_path, wait_pool_idle

ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {"name": "get_weather", "description": "Current weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                                 "required": ["city", "unit"], "additionalProperties": False}}
TIME_TOOL = {"name": "get_time", "input_schema": {"type": "object", "properties": {"tz": {"type": "string",
                                                                                          "maxLength": 20}},
                                                  "required": ["tz"], "additionalProperties": False}}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# anthropic 2.x's create() no longer takes temperature, top_p or top_k (Claude's newest models dropped them); older
# clients send them, and the server honours them: here they go as extra body fields
GREEDY = {"extra_body": {"temperature": 0}}
# what the SDK's MessageStream yields besides the raw events (derived from them)
DERIVED_EVENTS = {"text", "input_json", "thinking", "signature", "citation"}


@pytest.fixture(scope="module")
def server(default_server):
    yield default_server  # conftest.py: the suite's shared server (SMALL_ENGINE_ARGS)
    wait_pool_idle(default_server.url)  # every request of this module finished and freed its KV


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)


def served_name() -> str:
    return os.path.basename(default_model_path())[:-len(".gguf")]


def prompt_tokens(usage) -> int:
    """The prompt's length from Anthropic's usage (the cache read is not part of input_tokens)."""
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def raw_events(response: httpx.Response):
    """(event name, data) of each SSE event of an Anthropic stream."""
    out = []
    for chunk in response.text.split("\n\n"):
        if chunk.strip():
            head, data = chunk.split("\n", 1)
            assert head.startswith("event: ") and data.startswith("data: "), chunk
            out.append((head[len("event: "):], json.loads(data[len("data: "):])))
    return out


# ---------------------------------------------------------------- plain messages
def test_create_matches_chat_completions(server, client):
    """A message's text, stop reason and usage are those of the same chat completion; max_tokens ends with
    stop_reason max_tokens and output_tokens == max_tokens."""
    m = client.messages.create(model="claude-x", max_tokens=32, **GREEDY, messages=ASK)
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                      json={"messages": ASK, "max_tokens": 32, "temperature": 0}).json()
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m._request_id == m.id
    assert m.model == served_name() and [b.type for b in m.content] == ["text"]
    assert text_of(m) == chat["choices"][0]["message"]["content"] and "Paris" in text_of(m)
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert m.usage.output_tokens == chat["usage"]["completion_tokens"] < 32
    assert prompt_tokens(m.usage) == chat["usage"]["prompt_tokens"]
    short = client.messages.create(model="claude-x", max_tokens=3, messages=ASK, metadata={"user_id": "u1"},
                                   extra_body={"temperature": 0, "top_k": 5, "top_p": 0.9})
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    assert text_of(m).startswith(text_of(short))


def test_system_prompt_string_and_blocks(client):
    """``system`` as a string and as text blocks render the same prompt, which differs from the one without it
    (SmolLM2's template then puts in its own default system prompt); count_tokens equals the prompt the message
    used."""
    system = "You are a helpful geography teacher."
    plain = client.messages.count_tokens(model="m", messages=ASK).input_tokens
    as_str = client.messages.count_tokens(model="m", messages=ASK, system=system).input_tokens
    as_blocks = client.messages.count_tokens(model="m", messages=ASK, system=[
        {"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]).input_tokens
    assert as_str == as_blocks != plain
    m = client.messages.create(model="m", max_tokens=8, **GREEDY, system=system, messages=ASK)
    assert prompt_tokens(m.usage) == as_str and m.content


def test_stop_sequences(client):
    m = client.messages.create(model="m", max_tokens=32, **GREEDY, messages=ASK,
                               stop_sequences=["zzz", "Paris"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "Paris"
    assert "Paris" not in text_of(m)
    with client.messages.stream(model="m", max_tokens=32, **GREEDY, messages=ASK,
                                stop_sequences=["zzz", "Paris"]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "Paris"
    assert text_of(final) == text_of(m)


def test_prefill_continues_the_final_assistant_turn(client):
    prefill = "The capital of France is"
    m = client.messages.create(model="m", max_tokens=4, **GREEDY,
                               messages=ASK + [{"role": "assistant", "content": prefill}])
    assert "Paris" in text_of(m) and not text_of(m).startswith(prefill)
    counted = client.messages.count_tokens(model="m", messages=ASK + [{"role": "assistant", "content": prefill}])
    assert counted.input_tokens == prompt_tokens(m.usage)


# ---------------------------------------------------------------- streaming
def test_stream_events_and_final_message(server, client):
    """The SDK's accumulated message equals the non-streamed one and what the events carried; the events come
    in Anthropic's order."""
    full = client.messages.create(model="m", max_tokens=16, **GREEDY, messages=ASK)
    with client.messages.stream(model="m", max_tokens=16, **GREEDY, messages=ASK) as stream:
        events = [e for e in stream if e.type not in DERIVED_EVENTS]
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    start, delta = events[0], events[-2]
    assert start.message.content == [] and start.message.stop_reason is None and start.message.id == final.id
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == text_of(final)
    assert (final.stop_reason, final.usage.output_tokens) == (delta.delta.stop_reason, delta.usage.output_tokens)
    assert text_of(final) == text_of(full) and final.stop_reason == full.stop_reason
    assert final.usage.output_tokens == full.usage.output_tokens
    assert prompt_tokens(final.usage) == prompt_tokens(full.usage) == start.message.usage.input_tokens
    # on the wire: `event: <type>` names each `data:` object's type; any anthropic-version is accepted
    raw = httpx.post(server.url + "/v1/messages", timeout=60,
                     headers={"anthropic-version": "1999-01-01", "anthropic-beta": "anything"},
                     json={"model": "m", "max_tokens": 4, "messages": ASK, "stream": True})
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    assert all(name == data["type"] for name, data in raw_events(raw))


# ---------------------------------------------------------------- tools
def check_tool_use(block, tools):
    by_name = {t["name"]: t["input_schema"] for t in tools}
    assert block.type == "tool_use" and block.id and block.name in by_name
    jsonschema.validate(block.input, by_name[block.name])


def openai_tool(tool: dict) -> dict:
    return {"type": "function", "function": {"name": tool["name"], "description": tool.get("description"),
                                             "parameters": tool["input_schema"]}}


def test_tool_round_trip(server, client):
    """A forced call (tool_choice tool) comes back as a tool_use block; its tool_result goes back (tool_choice
    auto, the default) and the reply is text. count_tokens counts the prompt the round trip rendered, which is
    the prompt of the same turns sent to /v1/chat/completions (tool_use = an assistant's tool_calls, tool_result
    = a tool message)."""
    tools = [WEATHER_TOOL, TIME_TOOL]
    m = client.messages.create(model="m", max_tokens=64, **GREEDY, messages=WEATHER_ASK, tools=tools,
                               tool_choice={"type": "tool", "name": "get_weather"})
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    call = m.content[0]
    check_tool_use(call, tools)
    assert call.name == "get_weather"
    history = WEATHER_ASK + [{"role": "assistant", "content": m.content},
                             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                           "content": [{"type": "text", "text": "18 degrees"}]}]}]
    reply = client.messages.create(model="m", max_tokens=16, **GREEDY, messages=history, tools=tools)
    assert reply.stop_reason in ("end_turn", "max_tokens") and [b.type for b in reply.content] == ["text"]
    counted = client.messages.count_tokens(model="m", messages=history, tools=tools)
    assert counted.input_tokens == prompt_tokens(reply.usage)
    chat_turns = WEATHER_ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"}]
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": chat_turns, "tools": [openai_tool(t) for t in tools], "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == counted.input_tokens
    # a failed tool: is_error reaches the model (the prompt differs from the successful result's)
    failed = [*history[:2], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                          "content": "18 degrees", "is_error": True}]}]
    assert client.messages.count_tokens(model="m", messages=failed, tools=tools).input_tokens != counted.input_tokens


def test_tool_use_streamed(client):
    """tool_choice any (OpenAI's required), streamed: a tool_use block whose input arrives as input_json_delta;
    disable_parallel_tool_use gives exactly one call."""
    tools = [WEATHER_TOOL, TIME_TOOL]
    with client.messages.stream(model="m", max_tokens=64, **GREEDY, messages=WEATHER_ASK, tools=tools,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        events = [e for e in stream if e.type not in DERIVED_EVENTS]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    check_tool_use(final.content[0], tools)
    start = next(e for e in events if e.type == "content_block_start")
    assert start.content_block.type == "tool_use" and start.content_block.id == final.content[0].id
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(partial) == final.content[0].input


def test_structured_output(client):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"], "additionalProperties": False}
    m = client.messages.create(model="m", max_tokens=24, **GREEDY, messages=ASK,
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(text_of(m)), schema)


# ---------------------------------------------------------------- errors and auth
def test_errors_have_anthropic_bodies_naming_the_field(server, client):
    with pytest.raises(anthropic.BadRequestError, match="max_tokens") as e:
        client.messages.create(model="m", max_tokens=0, messages=ASK)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError, match="temperature"):
        client.messages.create(model="m", max_tokens=4, messages=ASK, extra_body={"temperature": 1.5})
    with pytest.raises(anthropic.BadRequestError, match=r"messages\.0\.content\.0"):
        client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://example.com/a.png"}}]}])
    with pytest.raises(anthropic.BadRequestError, match="not among the tools"):
        client.messages.create(model="m", max_tokens=4, messages=ASK, tools=[WEATHER_TOOL],
                               tool_choice={"type": "tool", "name": "nope"})
    with pytest.raises(anthropic.BadRequestError, match=r"tools\.0\.type"):
        client.messages.count_tokens(model="m", messages=ASK, tools=[{"type": "web_search_20250305",
                                                                      "name": "web_search"}])
    r = httpx.post(server.url + "/v1/messages", timeout=30, json={"model": "m", "messages": ASK})
    assert r.status_code == 400 and r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/messages", timeout=30,
                   json={"model": "m", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]})
    assert r.status_code == 400 and "messages.0.role" in r.json()["error"]["message"]


def test_x_api_key_auth(hardened_server):
    """With --api-key, Anthropic's x-api-key header (what the SDK sends) and a Bearer token are accepted; a
    wrong key is a 401 with Anthropic's error body."""
    good = anthropic.Anthropic(base_url=hardened_server.url, api_key=API_KEY, max_retries=0, timeout=60)
    assert good.messages.create(model="m", max_tokens=2, messages=ASK).usage.output_tokens == 2
    bearer = anthropic.Anthropic(base_url=hardened_server.url, auth_token=API_KEY, max_retries=0, timeout=60)
    assert bearer.messages.count_tokens(model="m", messages=ASK).input_tokens > 0
    bad = anthropic.Anthropic(base_url=hardened_server.url, api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="m", max_tokens=2, messages=ASK)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"


# ---------------------------------------------------------------- the translations alone
def test_request_translation():
    """The chat request a Messages request becomes: system blocks joined, tool_use -> the assistant's tool_calls,
    tool_result (is_error marked) -> tool messages in block order, tools and tool_choice mapped, a final
    assistant turn continued. (SmolLM2's template renders no tool_calls, so the server tests cannot see them.)"""
    req = AnthropicMessagesRequest.model_validate({
        "model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "A."}, {"type": "text", "text": "B."}],
        "tools": [WEATHER_TOOL], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["x"], "temperature": 0, "top_k": 3, "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                              {"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "t1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                          "content": [{"type": "text", "text": "down"}]},
                                         {"type": "text", "text": "Try again"}]},
            {"role": "assistant", "content": "Sure"}]})
    chat = chat_request(req, **sampling_fields(req))
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "A.\nB."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "Error: down"}, {"role": "user", "content": "Try again"},
        {"role": "assistant", "content": "Sure"}]
    assert chat.continue_final_message and chat.tool_choice == "required" and not chat.parallel_tool_calls
    assert chat.tools[0].function.parameters == WEATHER_TOOL["input_schema"]
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_k) == (8, ["x"], 0.0, 3)
    named = chat_request(req.model_copy(update={"tool_choice": AnthropicToolChoice(type="tool", name="get_weather")}))
    assert named.tool_choice.function == {"name": "get_weather"}


def test_response_translation():
    """A chat completion -> Anthropic's message: thinking, text, then tool_use blocks with the arguments as an
    object; finish reasons -> stop reasons; usage split into input_tokens and cache_read_input_tokens."""
    result = {"id": "chatcmpl-abc", "model": "m", "usage": {"prompt_tokens": 10, "completion_tokens": 5,
                                                             "prompt_tokens_details": {"cached_tokens": 4}},
              "choices": [{"message": {"role": "assistant", "content": "ok", "reasoning_content": "hmm", "tool_calls": [
                  {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
                  "finish_reason": "tool_calls", "matched_stop": None}]}
    assert message_from_chat(result, None) == {
        "id": "msg_abc", "type": "message", "role": "assistant", "model": "m", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": ""}, {"type": "text", "text": "ok"},
            {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}}],
        "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"input_tokens": 6, "output_tokens": 5, "cache_read_input_tokens": 4,
                  "cache_creation_input_tokens": 0}}
    assert stop_reason("length", None, None) == ("max_tokens", None)
    assert stop_reason("stop", 2, ["x"]) == ("end_turn", None)  # an EOS token id
    assert stop_reason("stop", "x", ["x"]) == ("stop_sequence", "x")



START = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [], "stop_reason": None,
         "stop_sequence": None, "usage": {"input_tokens": 7, "output_tokens": 0}}


def chunk(delta=None, finish=None, **extra):
    return {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish, **extra}]}


async def collect(chunks, stop_sequences=None) -> list:
    async def gen():
        for c in chunks:
            if isinstance(c, Exception):
                raise c
            yield c

    return [b async for b in sse_events(message_events(gen(), START, stop_sequences))]


def decode(raw: list) -> list:
    return raw_events(httpx.Response(200, content=b"".join(raw)))


def test_stream_translation_thinking_text_and_usage():
    """Reasoning deltas (--reasoning-parser) become a thinking block before the text block; the usage chunk's
    counts reach message_delta with the cache read apart; a matched stop string is the stop_sequence."""
    raw = asyncio.run(collect([
        chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "hmm"}),
        chunk({"reasoning_content": "..."}), chunk({"content": "Hi"}), chunk({}, "stop", matched_stop="END"),
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4,
                                  "prompt_tokens_details": {"cached_tokens": 3}}}], ["END"]))
    events = decode(raw)
    assert [(k, d.get("index")) for k, d in events] == [
        ("message_start", None), ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
        ("content_block_stop", 1), ("message_delta", None), ("message_stop", None)]
    assert events[1][1]["content_block"]["type"] == "thinking" and events[5][1]["content_block"]["type"] == "text"
    assert events[3][1]["delta"] == {"type": "thinking_delta", "thinking": "..."}
    assert events[8][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert events[8][1]["usage"] == {"input_tokens": 4, "output_tokens": 4, "cache_read_input_tokens": 3,
                                     "cache_creation_input_tokens": 0}


def test_stream_translation_error_event():
    """An error after the stream started ends it with an `error` event carrying Anthropic's error body."""
    events = decode(asyncio.run(collect([chunk({"content": "Hi"}), RequestError("engine failed", 500)])))
    assert [k for k, _ in events] == ["message_start", "content_block_start", "content_block_delta", "error"]
    assert events[-1][1] == {"type": "error", "error": {"type": "api_error", "message": "engine failed"}}
