"""OpenAI API request bodies (https://platform.openai.com/docs/api-reference), plus SGLang's extras.

Every field of OpenAI's chat / completions request and of SGLang's ``ChatCompletionRequest`` /
``CompletionRequest`` (python/sglang/srt/entrypoints/openai/protocol.py) is declared, so /openapi.json lists
it. Each field's type carries its range (see entrypoints/field_types.py): ``n`` in [1, 128], ``seed`` a 64-bit
integer, sampling floats finite float32, token ids and counts int32; a wrongly typed or out-of-range value
answers HTTP 400 naming the field. ``null`` means a field's default (OpenAI's fields are nullable, SGLang's
sampling fields Optional). A field this server cannot honour is accepted only at its default
(`field_types.default_only`: 400 naming it otherwise), and a hint that does not change the output (``user``,
``metadata``, ...) is accepted and ignored (`field_types.ignored`). Unknown fields are ignored, as SGLang's
OpenAI server does (its request models keep pydantic's default ``extra="ignore"``).
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import Field, model_validator
from typing_extensions import Annotated

from sgl_jax.srt.entrypoints.field_types import (
    INT32_MAX,
    LenientModel,
    LogitBiasMap,
    NonNegFloat32,
    NonNegInt32,
    NullMeansDefault,
    SGLangSharedFields,
    NumChoices,
    Penalty,
    RepetitionPenalty,
    Rid,
    Seed,
    StrOrList,
    TokenId,
    TopP,
    TruncationFields,
    default_only,
    ignored,
)


class StreamOptions(NullMeansDefault, LenientModel):
    """OpenAI's ``stream_options`` (plus SGLang's ``continuous_usage_stats``, accepted only as false)."""

    include_usage: bool = False
    continuous_usage_stats: default_only(bool, False, description="usage in every chunk") = False


class JsonSchemaFormat(LenientModel):
    """``response_format.json_schema`` (OpenAI): ``schema`` is the JSON Schema the output must satisfy. ``strict``
    is accepted and the output is always constrained (SGLang does the same for chat templates that do not
    render response_format themselves)."""

    name: str = "schema"
    description: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(LenientModel):
    """OpenAI's ``response_format``: ``text``, ``json_object`` (any JSON object) or ``json_schema``.

    As SGLang, ``{"type": "json_schema", "schema": {...}}`` (the schema at the top level) is read as
    ``{"type": "json_schema", "json_schema": {"name": <its title>, "schema": {...}}}``. SGLang's
    ``structural_tag`` type is not supported (400).
    """

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="before")
    @classmethod
    def _top_level_schema(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") == "json_schema" and data.get("json_schema") is None \
                and isinstance(data.get("schema"), dict):
            schema = data["schema"]
            data = {**data, "json_schema": {"name": str(schema.get("title", "Schema")), "schema": schema}}
        return data

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("type json_schema needs json_schema.schema (the JSON Schema of the output)")
        return self

    def to_json_schema(self) -> Optional[str]:
        """The ``json_schema`` sampling parameter this format means, as SGLang maps it: None for text, the schema
        ``{"type": "object"}`` for json_object, the JSON text of ``json_schema.schema`` for json_schema."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return '{"type": "object"}'
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


class OpenAIRequest(NullMeansDefault, SGLangSharedFields, TruncationFields, LenientModel):
    """Fields shared by /v1/completions and /v1/chat/completions: OpenAI's sampling fields and SGLang's
    extensions of both (top_k, the truncation filters, min_tokens, json_schema / regex / ebnf, repetition_penalty,
    ...)."""

    model: Optional[str] = Field(None, description="any name: the server serves one model")
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    logit_bias: Optional[LogitBiasMap] = None
    n: NumChoices = 1
    seed: Optional[Seed] = None
    stop: Optional[Union[str, List[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    temperature: NonNegFloat32 = 1.0
    top_p: TopP = 1.0
    response_format: Optional[ResponseFormat] = Field(None, description="json_object / json_schema constrain the "
                                                                        "output (one grammar per request)")
    user: ignored(Optional[str], "an end-user id for abuse monitoring") = None
    # SGLang's extensions
    top_k: int = Field(-1, ge=-1, le=INT32_MAX, description="-1 or 0: disabled")
    min_tokens: NonNegInt32 = 0
    json_schema: Optional[str] = Field(None, description="a JSON schema the output must satisfy")
    regex: Optional[str] = Field(None, description="a regular expression the whole output must match")
    ebnf: Optional[str] = Field(None, description="a GBNF / Lark grammar the output must match")
    repetition_penalty: RepetitionPenalty = 1.0
    stop_token_ids: Optional[List[TokenId]] = None
    no_stop_trim: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    rid: Optional[Rid] = None
    stop_regex: default_only(Optional[Union[str, List[str]]], description="stop regular expressions") = None
    custom_params: default_only(Optional[Dict[str, Any]], description="custom logit processors") = None
    images_config: default_only(Optional[Dict[str, Any]], description="multimodal input") = None
    return_hidden_states: default_only(Union[bool, str], False, description="hidden states") = False
    return_cached_tokens_details: default_only(bool, False, description="per-tier cached-token counts") = False
    return_token_ids: default_only(bool, False, description="token ids in the choices") = False
    ngram_corpus_id: ignored(StrOrList, "an n-gram speculative-decoding corpus; no speculative decoding here") = None


class CompletionRequest(OpenAIRequest):
    """/v1/completions (OpenAI's legacy completions, SGLang's extensions). ``best_of`` > ``n`` generates best_of
    candidates per prompt and returns the n with the highest mean token log-probability (not with stream)."""

    prompt: Union[str, List[str], List[TokenId], List[List[TokenId]]]
    max_tokens: Optional[NonNegInt32] = Field(16, description="null: up to the context length")
    logprobs: Optional[NonNegInt32] = Field(None, description="at most --max-top-logprobs-num (default 20)")
    echo: bool = False
    best_of: Optional[NumChoices] = Field(None, description="candidates per prompt, at least n")
    suffix: default_only(Optional[str], description="text after the completion (insertion)") = None


class ContentPart(LenientModel):
    type: str
    text: Optional[str] = None


# OpenAI's message roles (chat completions); any other answers 400 naming messages.<i>.role
ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(LenientModel):
    """One chat message: OpenAI's roles only (the chat template decides how each renders)."""

    role: ChatRole
    content: Optional[Union[str, List[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[List[Dict[str, Any]]] = None  # an assistant turn that called tools
    tool_call_id: Optional[str] = None  # a "tool" turn: the result of that call


ReasoningEffort = Union[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"],
                        Annotated[float, Field(ge=0.0, le=0.99, allow_inf_nan=False)]]


class ChatCompletionRequest(OpenAIRequest):
    """/v1/chat/completions (OpenAI's chat completions, SGLang's extensions).

    ``reasoning_effort`` is handed to the chat template as SGLang does (``thinking`` and ``enable_thinking`` in
    ``chat_template_kwargs``: false for "none", else true, unless set there). ``continue_final_message``
    continues a final assistant message instead of starting a new one, and ``add_generation_prompt: false``
    (vLLM's) leaves the template's generation prompt out; ``input_ids`` bypasses the chat
    template (SGLang's pre-tokenized prompt). With ``--reasoning-parser``, ``separate_reasoning`` and
    ``stream_reasoning`` decide how the thinking part is returned (see openai/serving_chat.py).
    """

    messages: List[ChatMessage]
    max_tokens: Optional[NonNegInt32] = None
    max_completion_tokens: Optional[NonNegInt32] = None
    logprobs: bool = False
    top_logprobs: Optional[NonNegInt32] = Field(None, description="at most --max-top-logprobs-num (default 20)")
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: bool = True
    reasoning_effort: Optional[ReasoningEffort] = None
    # OpenAI's other fields
    metadata: ignored(Optional[Dict[str, str]], "metadata of stored completions; nothing is stored") = None
    store: default_only(Optional[bool], None, False, description="stored completions") = None
    service_tier: default_only(Optional[str], None, "auto", "default", description="processing tiers") = None
    modalities: default_only(Optional[List[str]], None, ["text"], description="audio output") = None
    audio: default_only(Optional[Dict[str, Any]], description="audio output") = None
    prediction: ignored(Optional[Dict[str, Any]], "a predicted output only speeds generation up; the output is the "
                                                  "same without it") = None
    prompt_cache_key: ignored(Optional[str], "a prompt-cache routing hint; the radix cache finds shared prefixes "
                                             "itself") = None
    safety_identifier: ignored(Optional[str], "an end-user id for abuse monitoring") = None
    verbosity: default_only(Optional[str], None, "medium", description="answer length of reasoning models") = None
    web_search_options: default_only(Optional[Dict[str, Any]], description="web search") = None
    functions: default_only(Optional[List[Dict[str, Any]]], description="deprecated; use tools") = None
    function_call: default_only(Optional[Union[str, Dict[str, Any]]], None, "none", "auto",
                                description="deprecated; use tool_choice") = None
    # SGLang's chat extensions
    continue_final_message: bool = False
    add_generation_prompt: bool = Field(True, description="vLLM's: false renders the messages without the "
                                                         "template's generation prompt (an assistant turn opened)")
    chat_template_kwargs: Optional[Dict[str, Any]] = Field(None, description="extra variables of the chat template")
    input_ids: Optional[List[TokenId]] = Field(None, description="the prompt's token ids: no chat template")
    separate_reasoning: bool = Field(True, description="with --reasoning-parser: the thinking part of the output in "
                                                      "reasoning_content (false: all of it in content); without "
                                                      "one, ignored")
    stream_reasoning: bool = Field(True, description="with --reasoning-parser and stream: reasoning_content deltas "
                                                    "as it is generated (false: in one delta when the thinking "
                                                    "part ends); without one, ignored")
    max_dynamic_patch: default_only(Optional[int], description="multimodal input") = None
    min_dynamic_patch: default_only(Optional[int], description="multimodal input") = None
    use_audio_in_video: default_only(bool, False, description="multimodal input") = False
    return_prompt_token_ids: default_only(bool, False, description="prompt token ids in the choices") = False
    return_meta_info: default_only(bool, False, description="meta_info in the choices") = False
    task: default_only(Optional[str], description="DeepSeek-V4 quick-instruction tasks") = None
