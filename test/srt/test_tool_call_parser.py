"""Tool-call parsers and the constrained-call schemas (no model)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from sgl_jax.srt.entrypoints.parsers.tool_call_parser import (
    PARSERS,
    HermesParser,
    Llama3Parser,
    calls_from_constrained_output,
    get_parser,
    named_call_schema,
    required_calls_schema,
)

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                  "required": ["city"]}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}


def test_llama3_json_calls():
    p = Llama3Parser()
    content, calls = p.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                             '{"name": "get_time", "arguments": {"tz": "UTC"}}', ["get_weather", "get_time"])
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                   ("get_time", {"tz": "UTC"})]
    assert calls[0].id != calls[1].id and calls[0].to_openai(0)["type"] == "function"
    # plain text, unknown function names and broken JSON stay content
    for text in ["The weather is fine.", '{"name": "launch", "parameters": {}}', '{"name": "get_weather", "par']:
        assert p.parse(text, ["get_weather"]) == (text, [])
    assert p.may_start_call("  {") and p.may_start_call("<|python") and not p.may_start_call("Hello")


def test_hermes_blocks():
    p = HermesParser()
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}\n</tool_call>')
    content, calls = p.parse(text, None)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}),
                                                                   ("get_time", {"tz": "CET"})]
    assert p.parse("no calls here", None) == ("no calls here", [])
    assert p.may_start_call("text <tool") and p.may_start_call("x <tool_call>{") and not p.may_start_call("x <b>")


def test_parser_choice():
    assert get_parser(None, "LlamaForCausalLM").name == "llama3"
    assert get_parser(None, "Qwen3ForCausalLM").name == "hermes"
    assert get_parser("qwen25", "LlamaForCausalLM").name == "hermes"
    with pytest.raises(ValueError, match="unknown tool call parser"):
        get_parser("nope", "LlamaForCausalLM")


def test_constrained_schemas_round_trip():
    schema = required_calls_schema([WEATHER, TIME])
    out = json.dumps([{"name": "get_time", "parameters": {"tz": "UTC"}}])
    jsonschema.validate(json.loads(out), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "launch", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    calls = calls_from_constrained_output(out, None)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"tz": "UTC"})]
    two = [{"name": "get_time", "parameters": {"tz": "UTC"}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]
    jsonschema.validate(two, schema)
    with pytest.raises(jsonschema.ValidationError):  # parallel_tool_calls false: exactly one call
        jsonschema.validate(two, required_calls_schema([WEATHER, TIME], parallel=False))
    assert named_call_schema(WEATHER) == WEATHER["parameters"]
    calls = calls_from_constrained_output('{"city": "Rome"}', "get_weather")
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Rome"}
    with pytest.raises(ValueError, match="incomplete"):
        calls_from_constrained_output('[{"name": "get_ti', None)


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_rendered_calls_parse_back(name):
    """The system-prompt fallback writes earlier calls in the parser's own format: they read back as the same
    calls (names and arguments)."""
    parser = PARSERS[name]()
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1, "b": "é"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]
    content, parsed = parser.parse(parser.render_calls(calls), ["f", "g"])
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [("f", {"a": 1, "b": "é"}), ("g", {})]
    assert parser.fallback_format  # every parser can ask for its format in a system prompt
