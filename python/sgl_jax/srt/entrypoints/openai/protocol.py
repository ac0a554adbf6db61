"""OpenAI API request bodies (https://platform.openai.com/docs/api-reference), plus SGLang's extras.

Unknown fields are ignored, as OpenAI-compatible servers (SGLang's included) do; wrongly typed or
out-of-range fields are rejected with HTTP 400 naming the field. Each field's type carries its range (see
entrypoints/field_types.py): ``n`` in [1, 128], ``seed`` a 64-bit integer, sampling floats finite float32,
token ids and counts int32. SGLang's sampling extensions (top_k, min_p, min_tokens, ignore_eos,
stop_token_ids, ...) are accepted.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import Field, field_validator

from sgl_jax.srt.entrypoints.field_types import (
    INT32_MAX,
    LenientModel,
    LogitBiasMap,
    NonNegFloat32,
    NonNegInt32,
    NumChoices,
    Penalty,
    PosFloat32,
    Probability,
    Rid,
    Seed,
    TokenId,
    TopP,
)


class StreamOptions(LenientModel):
    include_usage: bool = False


class SamplingExtras(LenientModel):
    """SGLang extensions shared by /v1/completions and /v1/chat/completions."""

    top_k: int = Field(-1, ge=-1, le=INT32_MAX, description="-1 or 0: disabled")
    min_p: Probability = 0.0
    min_tokens: NonNegInt32 = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[List[TokenId]] = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    repetition_penalty: PosFloat32 = 1.0
    rid: Optional[Rid] = None
    # SGLang's structured-output extensions (at most one; response_format maps onto json_schema)
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    logit_bias: Optional[LogitBiasMap] = Field(None, description="token id -> bias in [-100, 100]")
    # OpenAI fields accepted at their defaults only
    user: Optional[str] = None
    metadata: Optional[Dict[str, str]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None

    @field_validator("store")
    @classmethod
    def _no_store(cls, v):
        if v:
            raise ValueError("store is not supported by this server (only false or null)")
        return v

    @field_validator("service_tier")
    @classmethod
    def _tier(cls, v):
        if v not in (None, "auto", "default"):
            raise ValueError("service_tier must be 'auto' or 'default' on this server")
        return v


class JsonSchemaFormat(LenientModel):
    name: str = "schema"
    description: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(LenientModel):
    """OpenAI's ``response_format``: text, json_object (any JSON object) or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    def to_json_schema(self) -> Optional[str]:
        """The ``json_schema`` sampling parameter this format means (None for text).

        Raises:
            ValueError: type json_schema without a schema.
        """
        if self.type == "text":
            return None
        if self.type == "json_object":
            return json.dumps({"type": "object"})
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise ValueError("response_format json_schema needs json_schema.schema")
        return json.dumps(self.json_schema.schema_)


class FunctionDefinition(LenientModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(LenientModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoice(LenientModel):
    type: Literal["function"] = "function"
    function: Dict[str, str]


class CompletionRequest(SamplingExtras):
    model: Optional[str] = None
    prompt: Union[str, List[str], List[TokenId], List[List[TokenId]]]
    max_tokens: Optional[NonNegInt32] = 16
    temperature: NonNegFloat32 = 1.0
    top_p: TopP = 1.0
    n: NumChoices = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[NonNegInt32] = Field(None, description="at most --max-top-logprobs-num (default 20)")
    echo: bool = False
    stop: Optional[Union[str, List[str]]] = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    seed: Optional[Seed] = None
    suffix: Optional[str] = None
    best_of: Optional[NumChoices] = None
    response_format: Optional[ResponseFormat] = None


class ContentPart(LenientModel):
    type: str
    text: Optional[str] = None


class ChatMessage(LenientModel):
    role: str
    content: Optional[Union[str, List[ContentPart]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(SamplingExtras):
    model: Optional[str] = None
    messages: List[ChatMessage]
    max_tokens: Optional[NonNegInt32] = None
    max_completion_tokens: Optional[NonNegInt32] = None
    temperature: NonNegFloat32 = 1.0
    top_p: TopP = 1.0
    n: NumChoices = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, List[str]]] = None
    logprobs: bool = False
    top_logprobs: Optional[NonNegInt32] = Field(None, description="at most --max-top-logprobs-num (default 20)")
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    seed: Optional[Seed] = None
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: bool = True
    response_format: Optional[ResponseFormat] = None
