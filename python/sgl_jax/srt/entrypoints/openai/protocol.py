"""OpenAI API request bodies (https://platform.openai.com/docs/api-reference), plus SGLang's extras.

Unknown fields are ignored, as the OpenAI server does; wrongly typed fields are rejected with HTTP 400.
SGLang's sampling extensions (top_k, min_p, min_tokens, ignore_eos, stop_token_ids, ...) are accepted.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Union

from pydantic import BaseModel


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingExtras(BaseModel):
    """SGLang extensions shared by /v1/completions and /v1/chat/completions."""

    top_k: int = -1
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[List[int]] = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    repetition_penalty: float = 1.0
    rid: Optional[str] = None


class CompletionRequest(SamplingExtras):
    model: Optional[str] = None
    prompt: Union[str, List[str], List[int], List[List[int]]]
    max_tokens: Optional[int] = 16
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[int] = None
    echo: bool = False
    stop: Optional[Union[str, List[str]]] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    logit_bias: Optional[Dict[str, float]] = None
    user: Optional[str] = None


class ContentPart(BaseModel):
    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    role: str
    content: Optional[Union[str, List[ContentPart]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(SamplingExtras):
    model: Optional[str] = None
    messages: List[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, List[str]]] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    logit_bias: Optional[Dict[str, float]] = None
    tools: Optional[list] = None
    tool_choice: Optional[Union[str, dict]] = None
    response_format: Optional[dict] = None
    user: Optional[str] = None
