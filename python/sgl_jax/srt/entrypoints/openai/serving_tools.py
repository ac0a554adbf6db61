"""Tool calling for /v1/chat/completions (OpenAI's ``tools`` / ``tool_choice``, SGLang's behaviour).

``tool_choice`` "auto" (the default when tools are given): the tools are rendered through the model's chat
template and the output is read by the ``--tool-call-parser`` (parsers/tool_call_parser.py); text that is not
a call stays content. A chat template that does not render tools (SmolLM2's) would drop them silently, so the
tools then go into the system prompt instead, in a generic format that asks for calls in the parser's own
format (llama.cpp's approach; `tools_system_prompt`); a parser without such a format answers 400.
"required" and a named function: the output is constrained by the grammar backend to the calls' JSON schema,
so it always parses. "none": tools are ignored.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Dict, List, Optional, Tuple

from sgl_jax.srt.entrypoints.openai.protocol import ChatCompletionRequest
from sgl_jax.srt.entrypoints.parsers.tool_call_parser import (
    ToolCall,
    ToolCallParser,
    calls_from_constrained_output,
    get_parser,
    named_call_schema,
    required_calls_schema,
)
from sgl_jax.srt.errors import RequestError

logger = logging.getLogger(__name__)
PROBE_TOOL = "sgl_jax_probe_tool"  # a name no template writes by itself
_RENDERS_TOOLS: Dict[str, bool] = {}  # chat template source -> whether it renders tools


@dataclasses.dataclass
class ToolPlan:
    """How one chat request uses its tools.

    template_tools: the tools as the chat template takes them (OpenAI's {"type": "function", "function"}).
    forced_schema: the JSON schema the output is constrained to (required / named), else None.
    named: the function a named tool_choice forces.
    parallel: OpenAI's parallel_tool_calls; when false, at most one call is returned (the first, as SGLang).
    """

    parser: ToolCallParser
    tool_names: List[str]
    template_tools: List[dict]
    forced_schema: Optional[str] = None
    named: Optional[str] = None
    parallel: bool = True

    def read(self, text: str) -> Tuple[Optional[str], List[ToolCall]]:
        """A finished output -> (content, calls); a forced output that does not parse (cut by max_tokens)
        comes back as content with no calls."""
        if self.forced_schema is not None:
            try:
                content, calls = None, calls_from_constrained_output(text, self.named)
            except (ValueError, TypeError):
                return text, []
        else:
            content, calls = self.parser.parse(text, self.tool_names)
        return content, calls if self.parallel else calls[:1]


def plan_tools(req: ChatCompletionRequest, parser_name: Optional[str], architecture: str) -> Optional[ToolPlan]:
    """The request's tool plan, or None when it has no tools or tool_choice is "none".

    Raises:
        RequestError: a named tool_choice that is not among the tools, tool_choice without tools, or a forced
            call together with another grammar (response_format, json_schema, regex, ebnf).
    """
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise RequestError("tool_choice requires tools")
        return None
    if choice == "none":
        return None
    fns = [t.function.model_dump(exclude_none=True) for t in req.tools]
    names = [f["name"] for f in fns]
    try:
        parser = get_parser(parser_name, architecture)
    except ValueError as e:
        raise RequestError(str(e)) from None
    plan = ToolPlan(parser, names, [{"type": "function", "function": f} for f in fns],
                    parallel=req.parallel_tool_calls)
    if choice is None or choice == "auto":
        return plan
    has_grammar = req.response_format is not None and req.response_format.type != "text"
    if has_grammar or any(getattr(req, k) is not None for k in ("json_schema", "regex", "ebnf")):
        raise RequestError("tool_choice required or a named function cannot be combined with response_format, "
                           "json_schema, regex or ebnf")
    if choice == "required":
        plan.forced_schema = json.dumps(required_calls_schema(fns, parallel=req.parallel_tool_calls))
        return plan
    name = choice.function.get("name")
    if name not in names:
        raise RequestError(f"tool_choice names function {name!r}, which is not among the tools {names}")
    plan.named = name
    plan.forced_schema = json.dumps(named_call_schema(fns[names.index(name)]))
    return plan


def message_for(plan: Optional[ToolPlan], text: str, finish_reason: Optional[str]) -> Tuple[dict, Optional[str]]:
    """The assistant message of a finished choice and its finish_reason ("tool_calls" when it calls)."""
    if plan is None:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = plan.read(text)
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    return ({"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]},
            "tool_calls")


class ToolStream:
    """Streams one choice's text while holding back what may be a tool call; at the end, the held text is
    either emitted as tool_calls deltas or released as content."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.sent = 0
        self.holding = plan.forced_schema is not None

    def feed(self, text: str) -> str:
        """The full text so far -> the content delta that may be sent now."""
        self.text = text
        if not self.holding and self.plan.parser.may_start_call(text[self.sent:] if self.sent else text):
            self.holding = True
        if self.holding:
            return ""
        delta = text[self.sent:]
        self.sent = len(text)
        return delta

    def finish(self, finish_reason: Optional[str]) -> Tuple[dict, Optional[str]]:
        """(the last delta, finish_reason) once the choice has finished."""
        rest = self.text[self.sent:]
        if not self.holding:
            return ({"content": rest} if rest else {}), finish_reason
        content, calls = self.plan.read(rest if self.sent else self.text)
        if not calls:
            return ({"content": rest} if rest else {}), finish_reason
        delta = {"tool_calls": [c.to_openai(index=j) for j, c in enumerate(calls)]}
        if content:
            delta["content"] = content
        return delta, "tool_calls"


def template_renders_tools(tok) -> bool:
    """Whether the tokenizer's chat template renders the ``tools`` it is given: a one-message conversation with
    a probe tool is rendered once per template and the probe's name looked for (a template error counts as
    not rendering). Call off the event loop (it renders a template)."""
    template = tok.chat_template if isinstance(tok.chat_template, str) else json.dumps(tok.chat_template)
    if template not in _RENDERS_TOOLS:
        probe = [{"type": "function", "function": {"name": PROBE_TOOL, "description": "probe",
                                                    "parameters": {"type": "object", "properties": {}}}}]
        try:
            text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=probe, tokenize=False,
                                           add_generation_prompt=True)
        except Exception:  # (jinja2 errors of templates that know no tools)
            text = ""
        _RENDERS_TOOLS[template] = PROBE_TOOL in text
        logger.info("The chat template %s tools%s", "renders" if _RENDERS_TOOLS[template] else "does not render",
                    "" if _RENDERS_TOOLS[template] else ": requests' tools go into the system prompt")
    return _RENDERS_TOOLS[template]


def tools_system_prompt(plan: ToolPlan) -> str:
    """The generic tools block for a system prompt: each function as one JSON line (name, description,
    parameters' JSON Schema), then how to call one, in the format `plan.parser` reads.

    Raises:
        RequestError: 400 -- the parser has no format a prompt can ask for.
    """
    if plan.parser.fallback_format is None:
        raise RequestError(f"The chat template does not render tools and --tool-call-parser {plan.parser.name} has "
                           f"no format to ask for in the system prompt; use a parser with one or a model whose "
                           f"template renders tools", param="tools")
    lines = [json.dumps({k: t["function"][k] for k in ("name", "description", "parameters") if k in t["function"]},
                        ensure_ascii=False) for t in plan.template_tools]
    return ("You can call these functions (each with the JSON Schema of its parameters):\n" + "\n".join(lines)
            + "\n\n" + plan.parser.fallback_format + " If no function is needed, answer normally.")


def with_tools_in_system_prompt(messages: List[dict], plan: ToolPlan) -> List[dict]:
    """`messages` with `tools_system_prompt` appended to the first system (or developer) message, or put first
    as a system message when there is none; assistant turns' ``tool_calls`` are written into their content in
    the parser's format.

    Raises:
        RequestError: see `tools_system_prompt`.
    """
    block = tools_system_prompt(plan)
    messages = [_calls_as_text(m, plan) for m in messages]
    if messages and messages[0]["role"] in ("system", "developer"):
        first = messages[0]["content"]
        return [{**messages[0], "content": f"{first}\n\n{block}" if first else block}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def _calls_as_text(message: dict, plan: ToolPlan) -> dict:
    """An assistant message's ``tool_calls`` written into its content in the parser's format (a template that
    renders no tools renders no calls either, so the model would see results of calls it never made)."""
    if message["role"] != "assistant" or not message.get("tool_calls"):
        return message
    calls = plan.parser.render_calls(message["tool_calls"])
    content = f"{message['content']}\n{calls}" if message.get("content") else calls
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": content}
