"""Reasoning parsers (``--reasoning-parser qwen3 | deepseek-r1``) without a model: one-shot parses, streams split
at every position (the deltas always add up to the one-shot parse), ``stream_reasoning`` false, an output cut
before the end tag, ``enable_thinking`` false, and which choices of a chat request are split."""

from __future__ import annotations

import json

import pytest

from sgl_jax.srt.entrypoints.openai.protocol import ChatCompletionRequest
from sgl_jax.srt.entrypoints.openai.serving_chat import reasoning_detectors
from sgl_jax.srt.entrypoints.parsers.reasoning_parser import (
    DeepSeekR1Detector,
    Qwen3Detector,
    get_detector,
    thinking_disabled,
)
from sgl_jax.srt.entrypoints.parsers.tool_call_parser import HermesParser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'

# (parser, output, (reasoning, content))
CASES = [
    # DeepSeek-R1: the template opened the thinking part; R1-0528 repeats the opening tag
    ("deepseek-r1", "I should add.\n</think>\n\nThe answer is 4.", ("I should add.\n", "\n\nThe answer is 4.")),
    ("deepseek-r1", "<think>\nI should add.</think>4", ("\nI should add.", "4")),
    ("deepseek-r1", "<think><think>x</think>y", ("x", "y")),
    ("deepseek-r1", "no end tag: cut by max_tokens", ("no end tag: cut by max_tokens", "")),
    ("deepseek-r1", "a</think>b</think>c<think>d", ("a", "b</think>c<think>d")),  # the first end tag only
    ("deepseek-r1", "</think>only content", ("", "only content")),
    ("deepseek-r1", "x</thin", ("x</thin", "")),  # a partial tag at the end stays reasoning
    ("deepseek-r1", "", ("", "")),
    # Qwen3: reasoning only when the output opens the thinking part itself
    ("qwen3", "<think>\nLet me add.\n</think>\n\nThe answer is 4.", ("\nLet me add.\n", "\n\nThe answer is 4.")),
    ("qwen3", "The answer is 4.", ("", "The answer is 4.")),
    ("qwen3", "Sure. <think>x</think>y", ("", "Sure. <think>x</think>y")),  # text before <think>: content
    ("qwen3", " <think>x</think>y", ("", " <think>x</think>y")),
    ("qwen3", "x</think>y", ("", "x</think>y")),  # not forced: an end tag alone is content
    ("qwen3", "<think>cut by max_tokens", ("cut by max_tokens", "")),
    ("qwen3", "<thi", ("", "<thi")),
    ("qwen3", "<think>", ("", "")),
    ("qwen3", "<think></think>", ("", "")),
    ("qwen3", "<think>a</think>b<tool_call>", ("a", "b<tool_call>")),
    # Qwen3.5 may open a tool call without closing the thinking part: the call is content
    ("qwen3", "<think>I need the weather." + CALL, ("I need the weather.", CALL)),
]


def stream(detector, pieces):
    """Feed `pieces`, then end the stream; returns the list of (reasoning, content) deltas."""
    return [detector.parse_stream_chunk(p) for p in pieces] + [detector.parse_stream_end()]


def joined(deltas):
    return "".join(r for r, _ in deltas), "".join(c for _, c in deltas)


@pytest.mark.parametrize("parser,text,expected", CASES)
def test_non_stream(parser, text, expected):
    assert get_detector(parser).parse_non_stream(text) == expected


@pytest.mark.parametrize("stream_reasoning", [True, False], ids=["stream_reasoning", "hold_reasoning"])
@pytest.mark.parametrize("parser,text,expected", CASES)
def test_stream_split_anywhere_adds_up_to_non_stream(parser, text, expected, stream_reasoning):
    """Every split of the output into three chunks (so each tag is cut at every position, and split over
    three chunks), and one character at a time: the deltas concatenate to the one-shot parse."""
    n = len(text)
    for i in range(n + 1):
        for j in range(i, n + 1):
            deltas = stream(get_detector(parser, stream_reasoning=stream_reasoning), [text[:i], text[i:j], text[j:]])
            assert joined(deltas) == expected, (i, j, deltas)
    assert joined(stream(get_detector(parser, stream_reasoning=stream_reasoning), list(text))) == expected


def test_tag_prefix_is_held_back():
    d = DeepSeekR1Detector()
    assert d.parse_stream_chunk("abc</th") == ("abc", "")
    assert d.parse_stream_chunk("ink>de") == ("", "de")
    assert d.parse_stream_chunk("f") == ("", "f")
    d = DeepSeekR1Detector()
    assert d.parse_stream_chunk("a</") == ("a", "")
    assert d.parse_stream_chunk("b") == ("</b", "")  # not the tag after all
    q = Qwen3Detector()
    assert q.parse_stream_chunk("<th") == ("", "")
    assert q.parse_stream_chunk("ink>x") == ("x", "")
    assert q.in_reasoning
    q = Qwen3Detector()
    assert q.parse_stream_chunk("<th") == ("", "")
    assert q.parse_stream_chunk("e answer") == ("", "<the answer")
    assert not q.in_reasoning
    q = Qwen3Detector()
    assert q.parse_stream_chunk("<think>a <tool") == ("a ", "")
    assert q.parse_stream_chunk("_call>{") == ("", "<tool_call>{")


def test_stream_reasoning_false_sends_reasoning_in_one_piece():
    d = get_detector("deepseek-r1", stream_reasoning=False)
    assert [d.parse_stream_chunk(p) for p in ["Let ", "me ", "think", "</thi", "nk>The", " answer"]] == [
        ("", ""), ("", ""), ("", ""), ("", ""), ("Let me think", "The"), ("", " answer")]
    assert d.parse_stream_end() == ("", "")
    # the end tag never came (max_tokens): the reasoning is sent when the stream ends
    d = get_detector("qwen3", stream_reasoning=False)
    assert [d.parse_stream_chunk(p) for p in ["<think>", "Let ", "me"]] == [("", "")] * 3
    assert d.parse_stream_end() == ("Let me", "")
    # streamed as it comes by default
    d = get_detector("qwen3")
    assert [d.parse_stream_chunk(p) for p in ["<think>", "Let ", "me", "</think>", "4"]] == [
        ("", ""), ("Let ", ""), ("me", ""), ("", ""), ("", "4")]


def test_enable_thinking_false_turns_qwen3_off():
    assert get_detector("qwen3", template_kwargs={"enable_thinking": False}) is None
    assert thinking_disabled("qwen3", {"enable_thinking": False})
    for kwargs in (None, {}, {"enable_thinking": True}, {"other": 1}):
        assert not thinking_disabled("qwen3", kwargs)
        assert isinstance(get_detector("qwen3", template_kwargs=kwargs), Qwen3Detector)
    # DeepSeek-R1's template always opens the thinking part
    assert isinstance(get_detector("deepseek-r1", template_kwargs={"enable_thinking": False}), DeepSeekR1Detector)


def test_continue_final_message_starts_where_the_message_stopped():
    # the continued assistant message opened the thinking part: the output continues it
    assert get_detector("qwen3", previous_content="<think>Let me").parse_non_stream(" see</think>4") == (" see", "4")
    # ... or closed it: the output is content
    assert get_detector("deepseek-r1", previous_content="a</think>").parse_non_stream("b</think>c") == (
        "", "b</think>c")
    assert get_detector("qwen3", previous_content="Sure,").parse_non_stream(" 4") == ("", " 4")
    # deepseek-r1 with no generation prompt (a continued message, add_generation_prompt false): its template
    # opened no thinking part, so a tag-less continuation is content; one that opens the tag is reasoning
    assert get_detector("deepseek-r1", previous_content="Sure,", new_turn=False).parse_non_stream(" 4") == ("", " 4")
    assert get_detector("deepseek-r1", new_turn=False).parse_non_stream("<think>a</think>b") == ("a", "b")
    assert get_detector("deepseek-r1", previous_content="<think>Let", new_turn=False).parse_non_stream(
        " me</think>4") == (" me", "4")
    assert get_detector("deepseek-r1").parse_non_stream(" 4") == (" 4", "")  # a new turn: forced


def test_unknown_parser():
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'"):
        get_detector("nope")


def test_tool_parser_reads_only_the_content():
    """A call the model only thinks about stays in the reasoning; the tool-call parser sees the content."""
    thought = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    reasoning, content = get_detector("deepseek-r1").parse_non_stream(f"Maybe {thought}? No, Oslo.</think>{CALL}")
    assert (reasoning, content) == (f"Maybe {thought}? No, Oslo.", CALL)
    for content in (content, get_detector("qwen3").parse_non_stream("<think>Oslo.</think>" + CALL)[1],
                    get_detector("qwen3").parse_non_stream("<think>Oslo." + CALL)[1]):
        text, calls = HermesParser().parse(content, ["get_weather"])
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})], content


def chat(**fields):
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_which_choices_are_split():
    """reasoning_detectors (serving_chat): one fresh detector per choice, none where the output is not split."""
    dets = reasoning_detectors("qwen3", chat(n=3), 3, constrained=False)
    assert len(dets) == 3 and len({id(d) for d in dets}) == 3 and all(isinstance(d, Qwen3Detector) for d in dets)
    assert dets[0].stream_reasoning and not reasoning_detectors("qwen3", chat(stream_reasoning=False), 1,
                                                                False)[0].stream_reasoning
    assert reasoning_detectors(None, chat(), 2, False) == [None, None]  # no --reasoning-parser
    assert reasoning_detectors("deepseek-r1", chat(separate_reasoning=False), 1, False) == [None]
    assert reasoning_detectors("deepseek-r1", chat(), 1, constrained=True) == [None]  # a grammar decides it all
    assert reasoning_detectors("qwen3", chat(chat_template_kwargs={"enable_thinking": False}), 1, False) == [None]
    assert reasoning_detectors("qwen3", chat(reasoning_effort="none"), 1, False) == [None]  # enable_thinking false
    assert reasoning_detectors("qwen3", chat(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}),
                               1, False)[0] is not None
    assert isinstance(reasoning_detectors("deepseek-r1", chat(reasoning_effort="none"), 1, False)[0],
                      DeepSeekR1Detector)
    # continue_final_message: the continued message decides where the output starts
    req = chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>Hmm"}],
               continue_final_message=True)
    assert reasoning_detectors("qwen3", req, 1, False)[0].parse_non_stream(", 4.</think>4") == (", 4.", "4")
