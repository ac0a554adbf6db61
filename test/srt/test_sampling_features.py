"""Penalties, logit_bias and structured output (json_schema, regex, ebnf, response_format) on a real server.

Penalties are checked token for token against transformers' SmolLM2 with the same adjustments applied in
the reference (srt_helpers.penalized_logits: transformers' RepetitionPenaltyLogitsProcessor, OpenAI's
documented frequency/presence formula); grammar outputs must parse / match on every request.
"""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import jsonschema
import openai
import pytest

from srt_helpers import hf_greedy_penalized, wait_pool_idle

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                      "population": {"type": "integer", "minimum": 0}},
     "required": ["city", "population"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "number"}},
     "required": ["answer", "confidence"], "additionalProperties": False},
    {"type": "object", "properties": {"colors": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                                 "minItems": 1, "maxItems": 3}},
     "required": ["colors"], "additionalProperties": False},
]
QUESTIONS = ["Describe a person.", "Describe a city.", "Is the sky blue?", "List some colors."]


@pytest.fixture(scope="module")
def server(default_server):
    return default_server  # conftest.py: the suite's shared server (SMALL_ENGINE_ARGS)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def generate(server, text, **sp):
    r = httpx.post(server.url + "/generate", json={"text": text, "sampling_params": sp}, timeout=300)
    return r


PENALTY_CASES = [
    ("The capital of France is", dict(repetition=1.3)),
    ("def fibonacci(n):\n", dict(frequency=0.8, presence=0.5)),
    ("Here is a list of fruits: apple, banana,", dict(presence=1.5)),
    ("1, 1, 2, 3, 5, 8,", dict(repetition=1.2, frequency=0.3, logit_bias={"28": 2.5, "30": -100.0})),
]


def test_penalties_match_transformers(server, hf_smollm2, smollm2_tokenizer):
    def run(case):
        prompt, pen = case
        sp = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True,
              "frequency_penalty": pen.get("frequency", 0.0), "presence_penalty": pen.get("presence", 0.0),
              "repetition_penalty": pen.get("repetition", 1.0)}
        if "logit_bias" in pen:
            sp["logit_bias"] = pen["logit_bias"]
        r = generate(server, prompt, **sp)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    with concurrent.futures.ThreadPoolExecutor(len(PENALTY_CASES)) as pool:  # one batch
        outs = list(pool.map(run, PENALTY_CASES))
    for (prompt, pen), ours in zip(PENALTY_CASES, outs):
        ref = hf_greedy_penalized(hf_smollm2, smollm2_tokenizer.encode(prompt), 24, **pen)
        assert ours == ref, f"{prompt!r} {pen}: ours {smollm2_tokenizer.decode(ours)!r} vs " \
                            f"ref {smollm2_tokenizer.decode(ref)!r}"
    # the penalties changed something (the plain greedy output differs)
    plain = generate(server, PENALTY_CASES[1][0], max_new_tokens=24, temperature=0, ignore_eos=True).json()
    assert plain["output_ids"] != outs[1]


def test_logit_bias_through_openai(client, smollm2_tokenizer):
    token = smollm2_tokenizer.encode(" banana")[0]
    r = client.completions.create(model="x", prompt="My favourite fruit is", max_tokens=4, temperature=0,
                                  logit_bias={str(token): 100})
    assert r.choices[0].text == smollm2_tokenizer.decode([token] * 4)
    banned = client.completions.create(model="x", prompt="The capital of France is", max_tokens=8, temperature=0)
    first = smollm2_tokenizer.encode(banned.choices[0].text)[0]
    r = client.completions.create(model="x", prompt="The capital of France is", max_tokens=8, temperature=0,
                                  logit_bias={str(first): -100})
    assert smollm2_tokenizer.encode(r.choices[0].text)[0] != first
    r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Say hi"}], max_tokens=6,
                                       temperature=0, frequency_penalty=1.0, presence_penalty=0.5)
    assert r.choices[0].message.content


def test_json_schema_concurrent_outputs_validate(server):
    """16 concurrent requests (4 schemas x 4 seeds, sampled) beside unconstrained ones: every output parses
    and validates against its schema."""
    def run(i):
        schema = SCHEMAS[i % 4]
        r = generate(server, CHAT.format(QUESTIONS[i % 4]), max_new_tokens=96, temperature=0.8, seed=i,
                     json_schema=json.dumps(schema))
        assert r.status_code == 200, r.text
        return schema, r.json()

    def plain(i):
        return generate(server, CHAT.format(QUESTIONS[i % 4]), max_new_tokens=32, temperature=0.8, seed=i).json()

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        plains = [pool.submit(plain, i) for i in range(4)]
        results = list(pool.map(run, range(16)))
        assert all(p.result()["text"] is not None for p in plains)
    for schema, out in results:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), schema)


def test_regex_and_ebnf(server):
    r = generate(server, CHAT.format("Is water wet? Answer and give a number."), max_new_tokens=16,
                 temperature=0.9, seed=3, regex=r"(yes|no), [0-9]{3}")
    assert r.status_code == 200, r.text
    assert re.fullmatch(r"(yes|no), [0-9]{3}", r.json()["text"]), r.json()["text"]
    for seed in range(3):
        r = generate(server, CHAT.format("Name a pet."), max_new_tokens=8, temperature=1.0, seed=seed,
                     ebnf='root ::= "cat" | "dog" | "goldfish"')
        assert r.status_code == 200, r.text
        assert r.json()["text"] in ("cat", "dog", "goldfish")


def test_response_format_through_openai(client):
    schema = SCHEMAS[0]
    r = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=96,
        temperature=0.7, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": 'Reply with the JSON object {"ok": true} and nothing else.'}],
        max_tokens=128,
        temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    chunks = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=96,
        temperature=0.7, seed=3, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("sp, needle", [
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": "[1, 2]"}, "json_schema"),
    ({"regex": "a(b"}, "regex"),
    ({"ebnf": "root ::= foo"}, "ebnf"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "one of"),
])
def test_malformed_grammar_is_400(server, sp, needle):
    r = generate(server, "hi", max_new_tokens=4, **sp)
    assert r.status_code == 400, r.text
    assert needle in r.text


def test_a_grammar_the_vocabulary_cannot_follow_aborts_the_request_alone(server, client):
    """A regex of one character, U+A0F17 (UTF-8 F2 A0 BC 97), which SmolLM2's vocabulary cannot spell (it has no
    token for the byte 0xF2): llguidance's mask offers a token that its matcher then refuses. The request ends
    with an abort that names the field (status 400; the refused token is the output so far), never a 500, on
    /generate and on /v1/chat/completions (where the fuzzer found it); the server serves on, its pool idle."""
    r = generate(server, "hi", max_new_tokens=4, temperature=0, regex="\U000A0F17")
    assert r.status_code == 200, r.text
    reason = r.json()["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 400, reason
    assert reason["message"].startswith("regex: the grammar cannot be generated with this model's vocabulary")
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "regex": "\U000A0F17"})
    assert chat.status_code < 500, chat.text
    assert client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Say hi"}],
                                          max_tokens=3).choices[0].message.content
    wait_pool_idle(server.url)


def test_no_leak_and_no_compile_after_warmup(server):
    st = wait_pool_idle(server.url)
    assert st["num_compiles_after_warmup"] == 0, "grammars or penalties compiled a new program while serving"


def test_structured_output_benchmark_runs(server):
    """The benchmark tool at small scale: every output validates and both runs generate the same tokens."""
    from sgl_jax.bench_structured_output import format_table, run_benchmark

    result = run_benchmark(server.url, num_requests=4, max_new_tokens=64)
    print(format_table(result))
    con, plain = result["rows"]
    assert con["valid"] == 4 and con["output_tokens"] == plain["output_tokens"] > 0
    assert result["ratio"] > 0


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 20}},
                                       "required": ["tz"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_call(call, tools):
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id and call.function.name in by_name
    jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])
    return call.function.name


def test_tool_choice_required_and_named_always_parse(client):
    tools = [WEATHER_TOOL, TIME_TOOL]
    r = client.chat.completions.create(model="x", messages=ASK, tools=tools, tool_choice="required", max_tokens=96,
                                       temperature=0.7, seed=5)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        check_call(call, tools)
    r = client.chat.completions.create(model="x", messages=ASK, tools=tools, max_tokens=96, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and [check_call(c, tools) for c in calls] == ["get_time"]
    r = client.chat.completions.create(model="x", messages=ASK, tools=tools, tool_choice="required", max_tokens=96,
                                       temperature=0.7, seed=5, parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
    check_call(r.choices[0].message.tool_calls[0], tools)
    # streaming: the call arrives as tool_calls deltas, then finish_reason tool_calls
    chunks = list(client.chat.completions.create(model="x", messages=ASK, tools=tools, tool_choice="required",
                                                 max_tokens=96, temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert calls and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    name = calls[0].function.name
    assert name in ("get_weather", "get_time")
    jsonschema.validate(json.loads(calls[0].function.arguments),
                        {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[name]["function"]["parameters"])


def test_tool_choice_auto_and_none(client):
    """With tool_choice auto a reply that is not a call stays content; none ignores the tools; a tool turn
    and an assistant turn with tool_calls render through the template."""
    r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Say hello."}],
                                       tools=[WEATHER_TOOL], max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    r2 = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Say hello."}],
                                        tools=[WEATHER_TOOL], tool_choice="none", max_tokens=8, temperature=0)
    assert r2.choices[0].message.tool_calls is None
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    r3 = client.chat.completions.create(model="x", messages=history, tools=[WEATHER_TOOL], max_tokens=16,
                                        temperature=0)
    assert r3.choices[0].message.content is not None or r3.choices[0].message.tool_calls


def test_bad_tool_choice_is_400(client):
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(model="x", messages=ASK, tools=[WEATHER_TOOL], max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="requires tools"):
        client.chat.completions.create(model="x", messages=ASK, tool_choice="required", max_tokens=4)
