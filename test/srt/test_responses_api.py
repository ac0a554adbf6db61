"""OpenAI's Responses API (/v1/responses): the openai client's ``responses.*`` and the openai-agents SDK's default
model (``OpenAIResponsesModel``) against the suite's shared server (SmolLM2), plus the pieces without a model:
the bounded response store, the input-item translation and the stream's event builder.

SmolLM2-135M is tiny: nothing here asserts on what it says, only on shapes, event sequences, usage, statuses,
forced (grammar-constrained) calls and round trips. Temperature 0 and few output tokens keep the module fast.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Literal

import agents
import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response
from openai.types.responses.response_stream_event import ResponseStreamEvent
from pydantic import TypeAdapter

from sgl_jax.srt.entrypoints.openai.response_store import ResponseStore
from sgl_jax.srt.entrypoints.openai.responses_protocol import ResponsesRequest
from sgl_jax.srt.entrypoints.openai.serving_responses import (
    ResponseCall,
    chat_messages,
    input_items,
    output_items,
    response_events,
)
from sgl_jax.srt.errors import RequestError
from srt_helpers import wait_pool_idle

QUESTION = "What is the capital of France?"
CITIES = ["Paris", "London"]
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                               "required": ["city"], "additionalProperties": False}}
EVENTS = TypeAdapter(ResponseStreamEvent)
DISCONNECT_LOG = "Client disconnected: aborting request"  # the server's log line for a request aborted mid-flight


@pytest.fixture(scope="module")
def server(default_server):
    return default_server  # conftest.py: the suite's shared server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def create(client, **kw) -> Response:
    return client.responses.create(model="m", temperature=0, **{"max_output_tokens": 12, **kw})


def check_finished(r: Response, max_tokens: int) -> None:
    """What every finished response shows: ids, status / incomplete_details by the output length, usage sums."""
    assert r.id.startswith("resp_") and r.object == "response" and r.created_at > 0
    u = r.usage
    assert u.input_tokens > 0 and 0 < u.output_tokens <= max_tokens
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.output_tokens_details.reasoning_tokens == 0 and u.input_tokens_details.cached_tokens >= 0
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and u.output_tokens == max_tokens
    else:
        assert r.status == "completed" and r.incomplete_details is None


# ---------------------------------------------------------------- the store (no model)
def test_store_bounded_in_entries_and_time():
    now = [0.0]
    store = ResponseStore(max_entries=3, ttl_s=10.0, clock=lambda: now[0])
    for i in range(4):
        store.put(f"resp_{i}", {"id": f"resp_{i}"}, [{"n": i}])
        now[0] += 1.0
    assert len(store) == 3 and store.get("resp_0") is None  # the oldest was evicted
    assert store.get("resp_1").items == [{"n": 1}] and store.get("resp_3").response == {"id": "resp_3"}
    store.put("resp_1", {"id": "again"}, [])  # replacing an id makes it the newest
    now[0] = 12.5  # resp_2 (stored at 2.0) is 10.5 s old, resp_3 (3.0) 9.5 s, resp_1 (4.0) 8.5 s
    assert store.get("resp_2") is None and "resp_3" in store and store.get("resp_1").response == {"id": "again"}
    assert store.delete("resp_3") and not store.delete("resp_3") and len(store) == 1
    now[0] = 14.0
    assert len(store) == 0 and not store.delete("resp_1")
    with pytest.raises(ValueError):
        ResponseStore(max_entries=0)
    with pytest.raises(ValueError):
        ResponseStore(ttl_s=0)


# ---------------------------------------------------------------- translation and events (no model)
def test_items_become_chat_messages():
    req = ResponsesRequest.model_validate({"input": [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                         {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking.",
                                                              "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
        {"type": "function_call", "call_id": "c3", "name": "get_weather", "arguments": "{}"}]})
    messages = chat_messages(input_items(req), "You help.")
    assert messages == [
        {"role": "system", "content": "You help."}, {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get_weather"},
        {"role": "tool", "content": "noon", "tool_call_id": "c2", "name": "get_time"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]
    assert input_items(ResponsesRequest.model_validate({"input": "hi"})) == [
        {"type": "message", "role": "user", "content": "hi"}]


def _chunk(delta=None, finish=None, usage=None) -> dict:
    if usage is not None:
        return {"choices": [], "usage": usage}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _events(chunks, req: dict = None):
    async def count(text):
        return len(text.split())

    async def source():
        for c in chunks:
            if isinstance(c, Exception):
                raise c
            yield c

    call = ResponseCall(ResponsesRequest.model_validate(req or {"input": "hi"}), "m", [], None, count)

    async def run():
        return [e async for e in response_events(call, source())]

    events = asyncio.run(run())
    for e in events:
        EVENTS.validate_python(e)  # each event as the openai SDK's types declare it
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


USAGE = {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16, "prompt_tokens_details": {"cached_tokens": 4}}


def test_stream_events_reasoning_text_and_calls():
    call = {"id": "call_1", "type": "function", "index": 0, "function": {"name": "f", "arguments": '{"a": 1}'}}
    events = _events([_chunk({"role": "assistant", "content": ""}), _chunk({"reasoning_content": "Let me "}),
                      _chunk({"reasoning_content": "think"}), _chunk({"content": "Hel"}), _chunk({"content": "lo"}),
                      _chunk({"tool_calls": [call]}, "tool_calls"), _chunk(usage=USAGE)])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = Response.model_validate(events[-1]["response"])
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Hello" and final.output[0].content[0].text == "Let me think"
    assert final.output[2].call_id == "call_1" and final.output[2].arguments == '{"a": 1}'
    assert final.usage.output_tokens_details.reasoning_tokens == 3 and final.usage.total_tokens == 16
    assert final.usage.input_tokens_details.cached_tokens == 4
    # each done item is the one the final response carries, under the id its added event announced
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    assert done == events[-1]["response"]["output"] and added == [d["id"] for d in done]
    # the same message, not streamed, gives the same items (but for the ids)
    plain = output_items({"role": "assistant", "content": "Hello", "reasoning_content": "Let me think",
                          "tool_calls": [call]}, incomplete=False)
    assert [{**o, "id": None} for o in plain] == [{**d, "id": None} for d in done]


def test_stream_events_incomplete_empty_and_failed():
    events = _events([_chunk({"content": ""}), _chunk({}, "length"), _chunk(usage=USAGE)])
    final = Response.model_validate(events[-1]["response"])
    assert events[-1]["type"] == "response.incomplete" and final.status == "incomplete"
    assert final.incomplete_details.reason == "max_output_tokens" and final.output_text == ""
    assert [o.status for o in final.output] == ["incomplete"]
    assert output_items({"content": ""}, incomplete=True)[0]["status"] == "incomplete"
    events = _events([_chunk({"content": "Hi"}, "abort"), _chunk(usage=USAGE)])  # /abort_request
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["incomplete_details"] == {
        "reason": None} and events[-1]["response"]["output"][0]["status"] == "incomplete"
    events = _events([_chunk({"content": "Hi"}), RequestError("engine failed", status_code=500)])
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-2]["message"] == "engine failed" and events[-1]["response"]["error"]["code"] == "server_error"
    assert events[-2]["error"] == {"message": "engine failed", "type": "server_error", "param": None, "code": 500}


# ---------------------------------------------------------------- the openai client
def test_create_plain_matches_chat(client):
    r = create(client, input=QUESTION)
    check_finished(r, 12)
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.output_text and r.output[0].content[0].type == "output_text" and r.output[0].content[0].annotations == []
    assert r.model and r.tool_choice == "auto" and r.tools == [] and r.temperature == 0 and r.store is True
    # the same prompt through /v1/chat/completions: same prompt tokens, same greedy output
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=12, temperature=0)
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.output_text == chat.choices[0].message.content
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    # instructions are a system message in front; a list input with text parts is the same user message
    r2 = create(client, instructions="Answer in one word.",
                input=[{"role": "user", "content": [{"type": "input_text", "text": "What is "},
                                                    {"type": "input_text", "text": QUESTION[8:]}]}])
    chat2 = client.chat.completions.create(model="m", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": QUESTION}])
    assert r2.usage.input_tokens == chat2.usage.prompt_tokens and r2.output_text == chat2.choices[0].message.content
    assert r2.instructions == "Answer in one word."


def test_stream_events_and_final_response(client):
    full = create(client, input=QUESTION, max_output_tokens=10)
    events = list(client.responses.create(model="m", input=QUESTION, max_output_tokens=10, temperature=0,
                                          stream=True))
    types = [e.type for e in events]
    n_deltas = types.count("response.output_text.delta")
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * n_deltas + [
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete" if full.status == "incomplete" else "response.completed"]
    assert n_deltas > 0 and [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == events[-4].text == final.output_text == full.output_text
    assert final.status == full.status and final.usage.output_tokens == full.usage.output_tokens
    assert final.usage.input_tokens == full.usage.input_tokens  # (cached_tokens: the second one finds the first's)
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if hasattr(e, "item_id")) and final.output[0].id == item_id


def test_tool_call_round_trip(client):
    r = create(client, input="What is the weather in Paris?", tools=[WEATHER_TOOL], max_output_tokens=24,
               tool_choice={"type": "function", "name": "get_weather"})
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather", r.output
    assert json.loads(calls[0].arguments)["city"] in CITIES and calls[0].call_id and calls[0].id.startswith("fc_")
    assert r.tool_choice.name == "get_weather" and r.tools[0].name == "get_weather"
    # the call and its output sent back: a message comes (tool_choice none: SmolLM2 might call again)
    back = create(client, tools=[WEATHER_TOOL], tool_choice="none", input=[
        {"role": "user", "content": "What is the weather in Paris?"}, calls[0].model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 22 C"}])
    assert [o.type for o in back.output] == ["message"] and back.output_text
    alone = create(client, tools=[WEATHER_TOOL], tool_choice="none", input="What is the weather in Paris?",
                   max_output_tokens=1)
    assert back.usage.input_tokens > alone.usage.input_tokens + 10  # the call and its output are in the prompt
    # tool_choice required, streamed: the call's arguments events
    events = list(client.responses.create(model="m", input="Weather in London?", tools=[WEATHER_TOOL], stream=True,
                                          tool_choice="required", parallel_tool_calls=False, temperature=0,
                                          max_output_tokens=40))
    types = [e.type for e in events]
    assert types[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done",
                         "response.completed"], types
    final = events[-1].response.output[0]
    assert final.type == "function_call" and final.arguments == events[3].delta == events[4].arguments
    assert json.loads(final.arguments)["city"] in CITIES


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    r = create(client, input="Is Paris in France? Answer in JSON.", max_output_tokens=32,
               text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.schema_ == schema
    r = create(client, input="Give a JSON object.", max_output_tokens=16, text={"format": {"type": "json_object"}})
    assert r.output_text.lstrip().startswith("{") and r.text.format.type == "json_object"
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)


def test_previous_response_id_and_store(client):
    r1 = create(client, input="My name is Ana.", max_output_tokens=8)
    r2 = create(client, input="What is my name?", max_output_tokens=8, previous_response_id=r1.id)
    alone = create(client, input="What is my name?", max_output_tokens=8)
    # the second prompt holds the first one, its answer and the new message
    assert r2.usage.input_tokens >= r1.usage.input_tokens + r1.usage.output_tokens
    assert r2.usage.input_tokens > alone.usage.input_tokens and r2.previous_response_id == r1.id
    r3 = create(client, input="And again?", max_output_tokens=4, previous_response_id=r2.id)
    assert r3.usage.input_tokens >= r2.usage.input_tokens + r2.usage.output_tokens
    # store false: not kept, so neither retrievable nor continuable
    r4 = create(client, input="Hi", max_output_tokens=4, store=False)
    assert r4.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r4.id)
    with pytest.raises(openai.BadRequestError) as e:
        create(client, input="Hi", previous_response_id=r4.id)
    assert e.value.body["param"] == "previous_response_id" and r4.id in e.value.body["message"]


def test_retrieve_cancel_delete(client, server):
    r = create(client, input="Hello", max_output_tokens=4, metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"k": "v"}
    with pytest.raises(openai.BadRequestError) as e:  # not a background response: OpenAI's answer
        client.responses.cancel(r.id)
    assert e.value.body["message"] == "Cannot cancel a synchronous response."
    for call in (lambda: client.responses.retrieve("resp_unknown"), lambda: client.responses.cancel("resp_unknown"),
                 lambda: client.responses.delete("resp_unknown")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["type"] == "not_found_error" and "resp_unknown" in e.value.body["message"]
    bare = httpx.post(f"{server.url}/v1/responses/resp_unknown/cancel", timeout=30)  # no body, no content type
    assert bare.status_code == 404, bare.text
    raw = httpx.delete(f"{server.url}/v1/responses/{r.id}", timeout=30)
    assert raw.status_code == 200 and raw.json() == {"id": r.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.items.0.message.content.parts.0.type"),
    ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input.items.0.type"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "input.items.0.message.role"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER_TOOL]}, None),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({}, "input"),
    ({"input": []}, "input"),
])
def test_unsupported_or_invalid_fields_answer_400(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json={"model": "m", **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == 400
    assert param is None or param.split(".")[0] in err["message"]
    if param is None:
        assert "nope" in err["message"]


def test_stream_closed_early_aborts(server):
    aborts = server.log_text().count(DISCONNECT_LOG)
    with httpx.stream("POST", server.url + "/v1/responses", timeout=60,
                      json={"model": "m", "input": "Tell me a long story.", "max_output_tokens": 400,
                            "stream": True, "temperature": 0}) as r:
        lines = r.iter_lines()
        seen = [line for line, _ in zip(lines, range(30))]
    assert seen[0] == "event: response.created" and any("response.output_text.delta" in s for s in seen)
    deadline = time.time() + 30
    while server.log_text().count(DISCONNECT_LOG) == aborts and time.time() < deadline:
        time.sleep(0.2)
    assert server.log_text().count(DISCONNECT_LOG) > aborts  # the server aborted it mid-flight
    wait_pool_idle(server.url)  # and released its KV


# ---------------------------------------------------------------- the openai-agents SDK's default model
@agents.function_tool
def get_weather(city: Literal["Paris", "London"]) -> str:
    """The weather in a city."""
    return f"Sunny in {city}"


def test_agents_sdk_responses_model(server):
    agents.set_tracing_disabled(True)

    async def runs():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        model = agents.OpenAIResponsesModel(model="m", openai_client=client)
        # (the SDK raises on an incomplete response: the answer must end before max_tokens)
        plain = agents.Agent(name="plain", instructions="Answer in one word.", model=model,
                             model_settings=agents.ModelSettings(temperature=0.0, max_tokens=24))
        tooled = agents.Agent(name="tools", instructions="Use the tool.", model=model, tools=[get_weather],
                              tool_use_behavior="stop_on_first_tool",
                              model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                                  temperature=0.0, max_tokens=40))
        try:
            streamed = agents.Runner.run_streamed(plain, QUESTION)
            deltas = [e.data.delta async for e in streamed.stream_events()
                      if e.type == "raw_response_event" and e.data.type == "response.output_text.delta"]
            return (await agents.Runner.run(plain, QUESTION), (streamed, deltas),
                    await agents.Runner.run(tooled, "What is the weather in Paris?"))
        finally:
            await client.close()

    plain, (streamed, deltas), tooled = asyncio.run(runs())
    assert isinstance(plain.final_output, str) and plain.final_output
    assert len(deltas) >= 2 and "".join(deltas) == streamed.final_output == plain.final_output  # streamed run
    assert plain.raw_responses[0].response_id.startswith("resp_")
    assert tooled.final_output in {f"Sunny in {c}" for c in CITIES}


def test_server_idle_after_module(server):
    wait_pool_idle(server.url)
