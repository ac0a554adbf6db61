"""Tool calls read from chat output, for the formats of the model families we serve (SGLang's
``--tool-call-parser`` names), and the JSON schema that forces a call for ``tool_choice`` required / named.

- ``llama3``: Llama 3.x JSON tool calls: the output is one JSON object ``{"name": ..., "parameters": {...}}``
  (``arguments`` is accepted too), optionally after ``<|python_tag|>``, several separated by ``;``
  (Meta's Llama 3.1 prompt format). Llama-architecture models (SmolLM2 too) default to it.
- ``hermes`` / ``qwen25``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks, any
  text before the first block being content (Hermes 2 Pro format, used by Qwen 2.5 / Qwen 3 templates).

``tool_choice`` "required" or a named function is enforced by the grammar backend as SGLang does: the output
is constrained to `required_calls_schema` (a JSON array of {name, parameters} objects) or to the named
function's parameters schema, and read back with `calls_from_constrained_output`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import List, Optional, Tuple

DEFAULT_PARSER_BY_ARCHITECTURE = {"LlamaForCausalLM": "llama3", "Qwen2ForCausalLM": "qwen25",
                                  "Qwen3ForCausalLM": "qwen25", "Qwen2MoeForCausalLM": "qwen25",
                                  "Qwen3MoeForCausalLM": "qwen25"}


@dataclasses.dataclass
class ToolCall:
    """One parsed call: the function name and its arguments as a JSON string (OpenAI's wire form)."""

    name: str
    arguments: str
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: Optional[int] = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def _call_from_obj(obj, known: Optional[set]) -> Optional[ToolCall]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if known is not None and obj["name"] not in known:
        return None
    args = obj.get("parameters", obj.get("arguments", {}))
    if isinstance(args, str):  # some models emit arguments already serialised
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _plain_calls(calls: List[dict]) -> List[dict]:
    """OpenAI tool_calls entries -> [{"name", "arguments": object}] (arguments that are not a JSON string stay
    as they are)."""
    out = []
    for c in calls:
        fn = c.get("function", c) if isinstance(c, dict) else {}
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        out.append({"name": fn.get("name"), "arguments": args})
    return out


class ToolCallParser:
    """Base: `parse` splits a finished output into (content, calls); `may_start_call` tells a stream when to
    hold text back because it might be (the start of) a call."""

    name = ""
    # How a model is told to call a function when its chat template does not render tools (the generic
    # system-prompt fallback, serving_tools.tools_system_prompt): the format this parser reads. None: the parser
    # has no format a prompt can ask for (tools then answer 400 with such a template).
    fallback_format: Optional[str] = None

    def parse(self, text: str, tool_names: Optional[List[str]] = None) -> Tuple[Optional[str], List[ToolCall]]:
        raise NotImplementedError

    def may_start_call(self, text: str) -> bool:
        raise NotImplementedError

    def render_calls(self, calls: List[dict]) -> str:
        """Earlier calls (OpenAI ``tool_calls`` entries: {"function": {"name", "arguments"}}) written as this
        parser reads them: an assistant turn of the system-prompt fallback, for templates that render no
        ``tool_calls``."""
        raise NotImplementedError


class Llama3Parser(ToolCallParser):
    """Llama 3.x JSON calls (``<|python_tag|>`` optional, calls separated by ``;``)."""

    name = "llama3"
    TAG = "<|python_tag|>"
    fallback_format = ('To call a function, answer with only a JSON object of the form {"name": <function name>, '
                       '"parameters": <the arguments as a JSON object>} and nothing else; for several calls, '
                       'separate the objects with ";".')

    def parse(self, text, tool_names=None):
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].strip()
        if not body.startswith("{"):
            return text, []
        known = set(tool_names) if tool_names is not None else None
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return text, []
            call = _call_from_obj(obj, known)
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return None, calls

    def render_calls(self, calls):
        return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False)
                         for c in _plain_calls(calls))

    def may_start_call(self, text):
        body = text.lstrip()
        return body == "" or body.startswith("{") or self.TAG.startswith(body[:len(self.TAG)])


class HermesParser(ToolCallParser):
    """``<tool_call>{json}</tool_call>`` blocks (Hermes 2 Pro; Qwen 2.5 / 3 chat templates)."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    fallback_format = ('To call a function, answer with <tool_call>\n{"name": <function name>, "arguments": <the '
                       'arguments as a JSON object>}\n</tool_call>, one such block per call.')
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text, tool_names=None):
        start = text.find(self.START)
        if start < 0:
            return text, []
        known = set(tool_names) if tool_names is not None else None
        calls = []
        for m in self._BLOCK.finditer(text, start):
            try:
                call = _call_from_obj(json.loads(m.group(1)), known)
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        content = text[:start].strip()
        return (content or None), calls

    def render_calls(self, calls):
        return "\n".join(f"{self.START}\n" + json.dumps(c, ensure_ascii=False) + f"\n{self.END}"
                         for c in _plain_calls(calls))

    def may_start_call(self, text):
        if self.START in text:
            return True
        tail = text[-len(self.START):]
        return any(self.START.startswith(tail[i:]) for i in range(len(tail)) if tail[i:])


PARSERS = {"llama3": Llama3Parser, "hermes": HermesParser, "qwen25": HermesParser}


def get_parser(name: Optional[str], architecture: str) -> ToolCallParser:
    """The parser named by ``--tool-call-parser``, else the default for the model's architecture (llama3).

    Raises:
        ValueError: an unknown parser name.
    """
    name = name or DEFAULT_PARSER_BY_ARCHITECTURE.get(architecture, "llama3")
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; one of {sorted(PARSERS)}")
    return PARSERS[name]()


def required_calls_schema(tools: List[dict], parallel: bool = True) -> dict:
    """JSON schema of ``tool_choice: "required"`` output: a non-empty array of calls to the given functions
    (``tools``: OpenAI function definitions, {"name", "parameters"?}); exactly one call unless `parallel`
    (OpenAI's ``parallel_tool_calls``)."""
    options = [{"type": "object",
                "properties": {"name": {"type": "string", "enum": [t["name"]]},
                               "parameters": t.get("parameters") or {"type": "object"}},
                "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": options[0] if len(options) == 1 else {"anyOf": options}}
    return schema if parallel else {**schema, "maxItems": 1}


def named_call_schema(tool: dict) -> dict:
    """JSON schema of a named ``tool_choice``: the function's parameters object (SGLang's behaviour)."""
    return tool.get("parameters") or {"type": "object"}


def calls_from_constrained_output(text: str, named: Optional[str]) -> List[ToolCall]:
    """Calls from an output constrained by `required_calls_schema` (named=None) or `named_call_schema`.

    Raises:
        ValueError: the text is not what the schema forces (e.g. the output was cut by max_tokens).
    """
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the constrained tool call is incomplete: {e}") from None
    if named is not None:
        return [ToolCall(named, json.dumps(obj, ensure_ascii=False))]
    calls = [_call_from_obj(o, None) for o in obj]
    if not calls or any(c is None for c in calls):
        raise ValueError("the constrained tool call output is not a list of calls")
    return calls
