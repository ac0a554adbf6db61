"""OpenAI API request bodies (https://platform.openai.com/docs/api-reference), plus SGLang's extras.

Unknown fields are ignored, as OpenAI-compatible servers (SGLang's included) do; wrongly typed or
out-of-range fields are rejected with HTTP 400 naming the field. Each field's type carries its range (see
entrypoints/field_types.py): ``n`` in [1, 128], ``seed`` a 64-bit integer, sampling floats finite float32,
token ids and counts int32. SGLang's sampling extensions (top_k, min_p, min_tokens, ignore_eos,
stop_token_ids, ...) are accepted.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Union

from pydantic import Field

from sgl_jax.srt.entrypoints.field_types import (
    INT32_MAX,
    Float32,
    LenientModel,
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
    logit_bias: Optional[Dict[str, Float32]] = None
    user: Optional[str] = None


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
    logit_bias: Optional[Dict[str, Float32]] = None
    tools: Optional[list] = None
    tool_choice: Optional[Union[str, dict]] = None
    response_format: Optional[dict] = None
    user: Optional[str] = None
