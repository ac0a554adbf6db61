"""Ollama API request bodies (https://github.com/ollama/ollama/blob/main/docs/api.md): /api/chat, /api/generate,
/api/show.

Each field has the type and range of what it becomes (entrypoints/field_types.py); a wrong type or an
out-of-range value answers 400 naming the field (``options.temperature: ...``). Unknown fields and unknown
``options`` are ignored, as Ollama ignores options it does not know (it logs "invalid option provided"). A
field this server cannot honour (``images``, ``suffix``, ``template``, ``context``) is accepted only empty
(400 naming it otherwise); ``keep_alive``, ``truncate`` and ``shift`` are accepted and ignored (the model stays
loaded; a prompt longer than the context is refused with 400, never cut). ``null`` means a field's default.

Options left out take Ollama's defaults (``api.DefaultOptions`` in ollama/api/types.go): temperature 0.8,
top_k 40, top_p 0.9, repeat_penalty 1.0, num_predict -1 (no limit but the context).
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import Field, field_validator

from sgl_jax.srt.entrypoints.field_types import (
    Int32,
    LenientModel,
    NonNegFloat32,
    NonNegInt32,
    NullMeansDefault,
    Penalty,
    RepetitionPenalty,
    Seed,
    TopP,
    TruncationFields,
    default_only,
    ignored,
)
from sgl_jax.srt.entrypoints.openai.protocol import Tool

# Ollama's DefaultOptions (ollama/api/types.go), used where a request leaves an option out
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.9

ThinkLevel = Literal["low", "medium", "high", "max"]
# "json": any JSON object; an object: a JSON schema the output must satisfy; "" (the Python client's empty
# default) and null: free text
Format = Optional[Union[Literal["", "json"], Dict[str, Any]]]
KeepAlive = ignored(Optional[Union[int, float, str]], "the model is always loaded")


class OllamaOptions(NullMeansDefault, TruncationFields, LenientModel):
    """Ollama's runtime ``options`` that change the output. ``num_predict`` <= 0 (Ollama: -1 no limit, -2 fill
    the context) means up to the context; ``top_k`` <= 0 disables top-k; ``seed`` -1 means none (Ollama's
    default). Load-time options (``num_ctx``, ``num_gpu``, ``num_thread``, ...), ``num_keep`` and
    ``repeat_last_n`` are ignored: the server's context and placement are fixed at launch, and the repetition
    penalty covers the whole output."""

    temperature: NonNegFloat32 = DEFAULT_TEMPERATURE
    top_k: Int32 = DEFAULT_TOP_K
    top_p: TopP = DEFAULT_TOP_P
    num_predict: Int32 = -1
    stop: Optional[Union[str, List[str]]] = None
    seed: Optional[Seed] = None
    repeat_penalty: RepetitionPenalty = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0


class OllamaToolCallFunction(LenientModel):
    """A call's function: ``arguments`` is a JSON object (Ollama's wire form; OpenAI's is a string)."""

    name: str = Field(min_length=1)
    arguments: Dict[str, Any] = Field(default_factory=dict)
    index: Optional[NonNegInt32] = None


class OllamaToolCall(LenientModel):
    id: Optional[str] = None
    function: OllamaToolCallFunction


class OllamaMessage(NullMeansDefault, LenientModel):
    """One chat message: ``role`` is one of system, user, assistant, tool (case-insensitive, as Ollama lowers
    it); an assistant turn may carry ``tool_calls``, a tool turn names its function in ``tool_name`` (and, newer
    Ollama, the call's ``tool_call_id``). ``thinking`` of an earlier turn is accepted and not rendered."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: ignored(Optional[str], "earlier turns' thinking is not rendered into the prompt") = None
    images: default_only(Optional[List[str]], None, [], description="images (multimodal input)") = None
    tool_calls: Optional[List[OllamaToolCall]] = None
    tool_name: Optional[str] = None
    tool_call_id: Optional[str] = None

    @field_validator("role", mode="before")
    @classmethod
    def _lower_role(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value


class OllamaRequest(NullMeansDefault, LenientModel):
    """Fields /api/chat and /api/generate share. ``stream`` defaults to true, as in Ollama."""

    model: str = Field(min_length=1, description="any name: the server serves one model")
    stream: bool = True
    format: Format = None
    options: OllamaOptions = Field(default_factory=OllamaOptions)
    think: Optional[Union[bool, ThinkLevel]] = Field(
        None, description="with --reasoning-parser: the thinking part comes back as `thinking`; false turns "
                          "thinking off in the chat template; true or a level without a reasoning parser: 400")
    logprobs: bool = False
    top_logprobs: NonNegInt32 = Field(0, description="alternatives per token, at most --max-top-logprobs-num "
                                                     "(default 20); only with logprobs")
    keep_alive: KeepAlive = None
    truncate: ignored(Optional[bool], "a prompt longer than the context is refused (400), never cut") = None
    shift: ignored(Optional[bool], "generation stops at the context length (done_reason length)") = None


class OllamaChatRequest(OllamaRequest):
    """POST /api/chat. No messages: Ollama's "load the model" request, answered done with done_reason load."""

    messages: List[OllamaMessage] = Field(default_factory=list)
    tools: Optional[List[Tool]] = None


class OllamaGenerateRequest(OllamaRequest):
    """POST /api/generate. Without ``raw`` the prompt (and ``system``) are rendered with the model's chat
    template as one user turn (Ollama applies the model's template); with ``raw`` the prompt is sent as it is.
    An empty prompt: Ollama's "load the model" request."""

    prompt: str = ""
    system: Optional[str] = None
    raw: bool = False
    suffix: default_only(Optional[str], None, "", description="text after the insertion (fill-in-the-middle)") = None
    template: default_only(Optional[str], None, "", description="a Go template overriding the prompt template") = None
    context: default_only(Optional[List[int]], None, [], description="deprecated token context of an earlier "
                                                           "response") = None
    images: default_only(Optional[List[str]], None, [], description="images (multimodal input)") = None


class OllamaShowRequest(NullMeansDefault, LenientModel):
    """POST /api/show: ``model`` (or the older ``name``)."""

    model: Optional[str] = None
    name: Optional[str] = None
    verbose: ignored(Optional[bool], "no tokenizer arrays are listed either way") = None
