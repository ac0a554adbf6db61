"""OpenAI's Responses API request body (``POST /v1/responses``,
https://platform.openai.com/docs/api-reference/responses/create), as far as this server serves it.

Served: ``input`` (a string, or a list of items: messages with text parts, ``function_call``,
``function_call_output`` and ``reasoning`` items), ``instructions``, ``max_output_tokens``, ``temperature``,
``top_p``, function ``tools`` (Responses' flat shape ``{"type": "function", "name", "description", "parameters",
"strict"}``), ``tool_choice``, ``parallel_tool_calls``, ``text.format`` (text / json_object / json_schema),
``reasoning.effort``, ``stream``, ``store``, ``previous_response_id``, ``metadata`` (echoed back).

Refused with 400 naming the field: a value this server cannot honour -- ``background: true``, built-in tools
(``web_search``, ``file_search``, ``mcp``, ...), non-text content parts (images, files), unsupported item types,
``include`` entries other than ``reasoning.encrypted_content``, ``truncation: "auto"``, ``top_logprobs``,
``conversation``, ``prompt`` (`field_types.default_only`). ``input`` is required (OpenAI's prompt templates and
conversations, which stand in for it there, are not served). Accepted and ignored: hints that do not change
the output (``user``, ``safety_identifier``, ``prompt_cache_key``, ...; `field_types.ignored`). Unknown fields
are ignored, as in the other OpenAI request models (protocol.py). Types are strict and ``null`` means a field's
default (`field_types.NullMeansDefault`).

The item and part unions are tagged by ``type`` (a message item may omit it, as OpenAI's ``EasyInputMessage``),
so a validation error names the item: ``input.items.0.message.role``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Literal, Optional, Union

from pydantic import Discriminator, Field, Tag, model_validator
from typing_extensions import Annotated

from sgl_jax.srt.entrypoints.field_types import (
    LenientModel,
    NonNegFloat32,
    NonNegInt32,
    NullMeansDefault,
    TopP,
    default_only,
    ignored,
)

ItemStatus = Optional[Literal["in_progress", "completed", "incomplete"]]
# the function names OpenAI allows (also what the chat request's FunctionDefinition checks)
FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
TEXT_PART_TYPES = ("input_text", "output_text", "text")


class Unsupported(LenientModel):
    """The tagged-union member (tag "type") for every ``type`` this server does not serve: validation fails with a
    message naming the type (subclasses set `what` and `supported`)."""

    what: ClassVar[str] = "item"
    supported: ClassVar[str] = ""

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{cls.what} type {kind!r} is not supported by this server (supported: {cls.supported})")


def _tag_by_type(default: Optional[str], known: tuple):
    """A callable discriminator: the value's ``type`` (`default` when absent) if it is one of `known`, else
    "type" (the tag of the `Unsupported` member, so the error's location ends in ``.type``)."""

    def tag(value: Any) -> str:
        kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", default)
        return kind if kind in known else "type"

    return tag


def _text_or_list(value: Any) -> str:
    return "text" if isinstance(value, str) else "parts"


# ---------------------------------------------------------------- content parts
class TextPart(LenientModel):
    """A text part: ``input_text`` (user input), ``output_text`` (an earlier assistant output; its
    ``annotations`` and ``logprobs`` are ignored) or ``text``."""

    type: Literal["input_text", "output_text", "text"]
    text: str


class RefusalPart(LenientModel):
    """An earlier assistant refusal (``{"type": "refusal", "refusal"}``), read as text."""

    type: Literal["refusal"]
    refusal: str


class UnsupportedPart(Unsupported):
    what: ClassVar[str] = "content part"
    supported: ClassVar[str] = "input_text, output_text, refusal"


def _part_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if kind in TEXT_PART_TYPES:
        return "text"
    return "refusal" if kind == "refusal" else "type"


ContentPart = Annotated[Union[Annotated[TextPart, Tag("text")], Annotated[RefusalPart, Tag("refusal")],
                              Annotated[UnsupportedPart, Tag("type")]],
                        Discriminator(_part_tag)]


Content = Annotated[Union[Annotated[str, Tag("text")], Annotated[List[ContentPart], Tag("parts")]],
                    Discriminator(_text_or_list)]


def content_text(content: Union[str, List[Any]]) -> str:
    """A validated `Content` as one string (the parts' texts joined, as chat content parts are)."""
    if isinstance(content, str):
        return content
    return "".join(p.text if isinstance(p, TextPart) else p.refusal for p in content)


# ---------------------------------------------------------------- input items
class MessageItem(LenientModel):
    """A message (OpenAI's ``EasyInputMessage`` / ``ResponseInputMessage`` / ``ResponseOutputMessage``): ``role``
    user, system, developer (rendered as system) or assistant; ``content`` a string or text parts."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: Optional[str] = None
    status: ItemStatus = None


class FunctionCallItem(LenientModel):
    """An earlier function call of the model (``ResponseFunctionToolCall``): ``arguments`` is its JSON text."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: Optional[str] = None
    status: ItemStatus = None


class FunctionCallOutputItem(LenientModel):
    """The result of a function call (``FunctionCallOutput``): ``output`` a string or text parts."""

    type: Literal["function_call_output"]
    call_id: Optional[str] = None
    output: Content
    id: Optional[str] = None
    status: ItemStatus = None


class ReasoningItem(LenientModel):
    """An earlier reasoning item: accepted (clients send their output back) and left out of the prompt, as chat
    templates leave out earlier turns' thinking."""

    type: Literal["reasoning"]
    id: Optional[str] = None
    summary: List[Dict[str, Any]] = Field(default_factory=list)
    content: Optional[List[Dict[str, Any]]] = None
    encrypted_content: Optional[str] = None
    status: ItemStatus = None


class UnsupportedItem(Unsupported):
    what: ClassVar[str] = "input item"
    supported: ClassVar[str] = "message, function_call, function_call_output, reasoning"


ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")],
                            Annotated[UnsupportedItem, Tag("type")]],
                      Discriminator(_tag_by_type("message", ITEM_TYPES))]
Input = Annotated[Union[Annotated[str, Tag("text")], Annotated[List[InputItem], Tag("items")]],
                  Discriminator(lambda v: "text" if isinstance(v, str) else "items")]


# ---------------------------------------------------------------- tools, tool_choice, text, reasoning
class FunctionTool(LenientModel):
    """A function tool in the Responses API's flat shape."""

    type: Literal["function"]
    name: FunctionName
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None


class UnsupportedTool(Unsupported):
    what: ClassVar[str] = "tool"
    supported: ClassVar[str] = "function; built-in tools are not available here"


ToolParam = Annotated[Union[Annotated[FunctionTool, Tag("function")], Annotated[UnsupportedTool, Tag("type")]],
                      Discriminator(_tag_by_type(None, ("function",)))]


class ToolChoiceFunction(LenientModel):
    """``{"type": "function", "name"}``: force a call of that function."""

    type: Literal["function"]
    name: str


class UnsupportedToolChoice(Unsupported):
    what: ClassVar[str] = "tool_choice"
    supported: ClassVar[str] = '"none", "auto", "required" or {"type": "function", "name"}'


def _tool_choice_tag(value: Any) -> str:
    if isinstance(value, str):
        return "mode"
    return _tag_by_type(None, ("function",))(value)


ToolChoice = Annotated[Union[Annotated[Literal["none", "auto", "required"], Tag("mode")],
                             Annotated[ToolChoiceFunction, Tag("function")],
                             Annotated[UnsupportedToolChoice, Tag("type")]],
                       Discriminator(_tool_choice_tag)]


class TextFormat(LenientModel):
    """``text.format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema", "name",
    "schema", "description", "strict"}`` (the output constrained to the schema by the grammar backend)."""

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None

    @model_validator(mode="after")
    def _schema_given(self) -> "TextFormat":
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("type json_schema needs schema (the JSON Schema of the output)")
        return self

    def echo(self) -> dict:
        """The format as the response object shows it."""
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "name": self.name or "schema", "schema": self.schema_,
                "description": self.description, "strict": self.strict}


class TextConfig(NullMeansDefault, LenientModel):
    """``text``: the output's format."""

    format: Optional[TextFormat] = None
    verbosity: default_only(Optional[str], None, "medium", description="answer length of reasoning models") = None


class ReasoningConfig(NullMeansDefault, LenientModel):
    """``reasoning``: ``effort`` becomes the chat request's ``reasoning_effort`` (the template's thinking switch);
    with ``--reasoning-parser`` the thinking part of the output becomes a ``reasoning`` output item."""

    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None
    summary: ignored(Optional[str], "a summary of the reasoning; the reasoning item carries the reasoning text "
                                    "itself") = None
    generate_summary: ignored(Optional[str], "deprecated name of summary") = None


# ---------------------------------------------------------------- the request
class ResponsesRequest(NullMeansDefault, LenientModel):
    """``POST /v1/responses`` (see the module docstring for what is served, refused and ignored)."""

    model: Optional[str] = Field(None, description="any name: the server serves one model")
    input: Input = Field(description="a user message, or a list of input items (required here: the prompt "
                                     "templates and conversations that stand in for it at OpenAI are not served)")
    instructions: Optional[str] = Field(None, description="a system message put first (not carried over by "
                                                          "previous_response_id)")
    max_output_tokens: Optional[NonNegInt32] = Field(None, description="null: up to the context length")
    temperature: NonNegFloat32 = 1.0
    top_p: TopP = 1.0
    tools: List[ToolParam] = Field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    stream: bool = False
    store: bool = Field(True, description="keep the response (bounded in-memory store) for GET and "
                                          "previous_response_id")
    previous_response_id: Optional[str] = Field(None, description="continue the stored conversation of that "
                                                                  "response")
    metadata: Optional[Dict[str, str]] = Field(None, description="echoed back in the response")
    # accepted and ignored: they do not change the output
    user: ignored(Optional[str], "an end-user id for abuse monitoring") = None
    safety_identifier: ignored(Optional[str], "an end-user id for abuse monitoring") = None
    prompt_cache_key: ignored(Optional[str], "a prompt-cache routing hint; the radix cache finds shared prefixes "
                                             "itself") = None
    prompt_cache_retention: ignored(Optional[str], "how long OpenAI keeps cached prefixes") = None
    max_tool_calls: ignored(Optional[NonNegInt32], "a limit on calls of built-in tools, of which this server has "
                                                   "none") = None
    stream_options: ignored(Optional[Dict[str, Any]], "include_obfuscation pads stream events; they are sent "
                                                      "without padding") = None
    # accepted only at their defaults
    background: default_only(bool, False, description="background responses") = False
    include: default_only(Optional[List[str]], None, "reasoning.encrypted_content",
                          description="extra output data; reasoning items carry their text, never encrypted "
                                      "content") = None
    truncation: default_only(Optional[str], None, "disabled", description="dropping input to fit the context") = None
    top_logprobs: default_only(Optional[int], None, 0, description="log-probabilities") = None
    service_tier: default_only(Optional[str], None, "auto", "default", description="processing tiers") = None
    conversation: default_only(Optional[Union[str, Dict[str, Any]]], description="the Conversations API") = None
    prompt: default_only(Optional[Dict[str, Any]], description="stored prompt templates") = None
    context_management: default_only(Optional[List[Dict[str, Any]]], description="context compaction") = None
