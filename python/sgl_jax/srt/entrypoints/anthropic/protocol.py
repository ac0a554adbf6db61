"""Anthropic Messages API request bodies (https://docs.anthropic.com/en/api/messages and
https://docs.anthropic.com/en/api/messages-count-tokens), as the ``anthropic`` SDKs send them.

Every field the server honours is declared with its type and range (field_types.py); a wrongly typed or
out-of-range value answers HTTP 400 naming the field, in Anthropic's error body. Unknown fields are ignored
(`LenientModel`), and so are the hints that do not change the output (``metadata``, ``cache_control``,
``service_tier``: `field_types.ignored`). What the engine cannot do (image and document blocks, server tools
such as web search) is refused with a 400 naming the block, never dropped: see anthropic/serving.py.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import Field
from typing_extensions import Annotated

from sgl_jax.srt.entrypoints.field_types import LenientModel, NonNegInt32, PosInt32, TopP, ignored

# Anthropic's temperature range (its API answers 400 outside it)
Temperature = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False, description="0.0 to 1.0")]
# Anthropic's tool-name pattern (a subset of OpenAI's function names)
ToolName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
CacheControl = ignored(Optional[Dict[str, Any]], "prompt caching is automatic here (the radix cache)")


class AnthropicTextBlock(LenientModel):
    """A ``text`` block (``system`` entries and tool results hold only these)."""

    type: Literal["text"]
    text: str
    cache_control: CacheControl = None
    citations: ignored(Optional[List[Dict[str, Any]]], "citations of documents; no documents here") = None


class AnthropicToolResultPart(LenientModel):
    """One block of a ``tool_result``'s content: ``text`` (other types, e.g. ``image``, answer 400)."""

    type: str
    text: Optional[str] = None


class AnthropicContentBlock(LenientModel):
    """One block of a message's content, by ``type``:

    - ``text``: `text`;
    - ``tool_use`` (assistant): `id`, `name`, `input` (the call's arguments, an object);
    - ``tool_result`` (user): `tool_use_id`, `content` (a string or text blocks), `is_error`;
    - ``thinking`` / ``redacted_thinking`` (assistant, earlier turns): accepted and left out of the prompt, as
      Anthropic does for earlier turns' thinking.

    Any other type (``image``, ``document``, server-tool blocks) answers 400 naming the block.
    """

    type: str
    text: Optional[str] = None
    id: Optional[str] = Field(None, max_length=256)
    name: Optional[str] = None
    input: Optional[Dict[str, Any]] = None
    tool_use_id: Optional[str] = Field(None, max_length=256)
    content: Optional[Union[str, List[AnthropicToolResultPart]]] = None
    is_error: Optional[bool] = None
    thinking: Optional[str] = None
    signature: Optional[str] = None
    data: Optional[str] = None
    cache_control: CacheControl = None


class AnthropicMessage(LenientModel):
    """One turn: ``role`` user or assistant, ``content`` a string or a list of blocks."""

    role: Literal["user", "assistant"]
    content: Union[str, List[AnthropicContentBlock]]


class AnthropicToolDefinition(LenientModel):
    """A client tool: ``name``, ``description``, ``input_schema`` (the JSON Schema of its input). Anthropic's
    server tools (``type`` such as ``web_search_20250305`` or ``bash_20250124``) are refused (400)."""

    name: ToolName
    description: Optional[str] = None
    input_schema: Optional[Dict[str, Any]] = None
    type: Optional[str] = Field(None, description="\"custom\" or absent; server tools are not supported")
    cache_control: CacheControl = None


class AnthropicToolChoice(LenientModel):
    """``tool_choice``: ``auto`` (the default), ``any`` (some tool must be called), ``tool`` (the tool `name`
    must be called) or ``none``; ``disable_parallel_tool_use`` returns at most one call."""

    type: Literal["auto", "any", "tool", "none"]
    name: Optional[ToolName] = None
    disable_parallel_tool_use: bool = False


class AnthropicThinkingConfig(LenientModel):
    """``thinking``: ``disabled`` renders the chat template without thinking (``thinking`` and
    ``enable_thinking`` false); ``enabled`` / ``adaptive`` with them true. ``budget_tokens`` is not enforced
    (``max_tokens`` bounds the whole output)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[NonNegInt32] = None


class AnthropicOutputFormat(LenientModel):
    """``output_config.format``: ``{"type": "json_schema", "schema": {...}}`` constrains the text to the schema
    (through the grammar backend, as OpenAI's ``response_format`` json_schema)."""

    type: Literal["json_schema"]
    schema_: Dict[str, Any] = Field(alias="schema")


class AnthropicOutputConfig(LenientModel):
    """``output_config`` (structured outputs): ``format``; ``effort`` is accepted and ignored."""

    format: Optional[AnthropicOutputFormat] = None
    effort: ignored(Optional[str], "a hint for Claude models' effort; the output is not bounded by it") = None


class AnthropicPromptFields(LenientModel):
    """What shapes the prompt: shared by /v1/messages and /v1/messages/count_tokens."""

    model: str = Field(description="any name: the server serves one model")
    messages: List[AnthropicMessage] = Field(min_length=1)
    system: Optional[Union[str, List[AnthropicTextBlock]]] = None
    tools: Optional[List[AnthropicToolDefinition]] = None
    tool_choice: Optional[AnthropicToolChoice] = None
    thinking: Optional[AnthropicThinkingConfig] = None


class AnthropicMessagesRequest(AnthropicPromptFields):
    """``POST /v1/messages``. ``max_tokens`` is required (as Anthropic's API has it); a final assistant turn is
    continued (Anthropic's prefill)."""

    max_tokens: PosInt32
    stop_sequences: Optional[List[str]] = None
    temperature: Optional[Temperature] = None
    top_p: Optional[TopP] = None
    top_k: Optional[NonNegInt32] = Field(None, description="0: disabled")
    stream: bool = False
    output_config: Optional[AnthropicOutputConfig] = None
    metadata: ignored(Optional[Dict[str, Any]], "metadata.user_id is for abuse detection") = None
    service_tier: ignored(Optional[str], "no capacity tiers here") = None


class AnthropicCountTokensRequest(AnthropicPromptFields):
    """``POST /v1/messages/count_tokens``: the prompt a /v1/messages request with these fields would render."""
