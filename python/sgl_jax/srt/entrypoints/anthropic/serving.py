"""Anthropic's Messages API (https://docs.anthropic.com/en/api/messages) on the chat completions machinery.

As SGLang's adapter does, a ``/v1/messages`` request is translated into a `ChatCompletionRequest`, run with
`serving_chat.prepare_chat` and `chat_result` / `chat_chunks`, and the result translated back:

- ``system`` (a string or text blocks, joined by newlines) becomes the system message; each message's text
  blocks are joined by newlines; an assistant's ``tool_use`` blocks become OpenAI ``tool_calls`` (``input`` as
  the arguments' JSON); a user's ``tool_result`` blocks become ``tool`` messages (text blocks joined, an
  ``is_error`` result prefixed with ``"Error: "``), in the order the blocks come; earlier turns' ``thinking``
  blocks are left out. A final assistant turn is continued (Anthropic's prefill: SGLang's
  continue_final_message).
- ``tools`` ({name, description, input_schema}) become function tools; ``tool_choice`` auto / any / tool / none
  become OpenAI's "auto" / "required" / a named function / "none" (any and tool are grammar-forced, so they
  always come back as calls); ``disable_parallel_tool_use`` is ``parallel_tool_calls: false``.
- ``stop_reason``: "end_turn" (an end-of-sequence token), "stop_sequence" (with ``stop_sequence`` the string
  matched), "max_tokens", "tool_use".
- ``usage``, as Anthropic counts: ``input_tokens`` are the prompt tokens *not* read from the prefix cache,
  ``cache_read_input_tokens`` those that were (so the prompt is their sum, which /v1/messages/count_tokens
  answers), ``cache_creation_input_tokens`` 0 (nothing is written on request), ``output_tokens``.
- ``output_config.format`` (structured outputs, a JSON schema) constrains the text as OpenAI's
  ``response_format`` json_schema does.
- With ``--reasoning-parser``, the reasoning comes first as a ``thinking`` block (empty ``signature``).
- ``stream``: Anthropic's events (``message_start``, then per block ``content_block_start``,
  ``content_block_delta`` with ``text_delta`` / ``input_json_delta`` / ``thinking_delta``,
  ``content_block_stop``, then ``message_delta`` with the stop reason and usage, ``message_stop``), each as
  ``event: <type>\\ndata: <json>\\n\\n``; an error after the stream started is an ``error`` event with
  Anthropic's error body. ``message_start`` carries the prompt's length as ``input_tokens`` (the cache split
  is known at the end); ``message_delta``'s usage has the final counts.
"""

from __future__ import annotations

import contextlib
import json
from typing import AsyncIterator, List, Optional, Tuple

import orjson
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from sgl_jax.srt.entrypoints.anthropic.protocol import (
    AnthropicContentBlock,
    AnthropicCountTokensRequest,
    AnthropicMessage,
    AnthropicMessagesRequest,
    AnthropicPromptFields,
)
from sgl_jax.srt.entrypoints.error_bodies import anthropic_error_body
from sgl_jax.srt.entrypoints.native_protocol import validation_message, validation_param
from sgl_jax.srt.entrypoints.openai.protocol import ChatCompletionRequest
from sgl_jax.srt.entrypoints.openai.serving_chat import chat_chunks, chat_prompt, chat_result, prepare_chat
from sgl_jax.srt.entrypoints.openai.serving_completions import Wait
from sgl_jax.srt.entrypoints.routes.common import json_response
from sgl_jax.srt.errors import RequestError
from sgl_jax.srt.tokenizer.tokenizer_manager import TokenizerManager

Event = Tuple[str, dict]  # (the SSE event name, its data)


# ---------------------------------------------------------------- request: Anthropic -> OpenAI chat
def _join_text(parts: List[str]) -> str:
    return "\n".join(parts)


def _tool_result_text(block: AnthropicContentBlock, where: str) -> str:
    """A ``tool_result``'s content as text (text blocks joined; ``is_error`` prefixed with "Error: ").

    Raises:
        RequestError: a content block that is not text.
    """
    content = block.content
    if isinstance(content, list):
        for k, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise RequestError(f"{where}.content.{k}: tool_result content blocks of type {part.type!r} are "
                                   f"not supported (only text)", param=f"{where}.content.{k}.type")
        content = _join_text([p.text for p in content])
    text = content or ""
    return f"Error: {text}" if block.is_error else text


def _require(block: AnthropicContentBlock, where: str, *fields: str) -> None:
    for f in fields:
        if getattr(block, f) is None:
            raise RequestError(f"{where}.{f}: a {block.type} block needs {f}", param=f"{where}.{f}")


def _user_messages(msg: AnthropicMessage, where: str) -> List[dict]:
    """A user turn -> OpenAI messages: its ``tool_result`` blocks as ``tool`` messages and its text as user
    messages, in the order of the blocks (consecutive text blocks joined)."""
    out, text = [], []
    for j, block in enumerate(msg.content):
        at = f"{where}.content.{j}"
        if block.type == "text":
            _require(block, at, "text")
            text.append(block.text)
        elif block.type == "tool_result":
            _require(block, at, "tool_use_id")
            if text:
                out.append({"role": "user", "content": _join_text(text)})
                text = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _tool_result_text(block, at)})
        else:
            raise RequestError(f"{at}: content blocks of type {block.type!r} are not supported in a user turn "
                               f"(text and tool_result are)", param=f"{at}.type")
    if text or not out:
        out.append({"role": "user", "content": _join_text(text)})
    return out


def _assistant_message(msg: AnthropicMessage, where: str) -> dict:
    """An assistant turn -> one OpenAI assistant message (text joined, ``tool_use`` blocks as tool_calls)."""
    text, calls = [], []
    for j, block in enumerate(msg.content):
        at = f"{where}.content.{j}"
        if block.type == "text":
            _require(block, at, "text")
            text.append(block.text)
        elif block.type == "tool_use":
            _require(block, at, "id", "name", "input")
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif block.type not in ("thinking", "redacted_thinking"):  # earlier turns' thinking: left out
            raise RequestError(f"{at}: content blocks of type {block.type!r} are not supported in an assistant "
                               f"turn (text, tool_use and thinking are)", param=f"{at}.type")
    message = {"role": "assistant", "content": _join_text(text) if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def chat_messages(req: AnthropicPromptFields) -> List[dict]:
    """The request's ``system`` and ``messages`` as OpenAI chat messages (see the module docstring).

    Raises:
        RequestError: 400 naming the block (``messages.<i>.content.<j>``) of a type not supported or missing a
            field its type needs.
    """
    out = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _join_text([b.text for b in req.system])
        out.append({"role": "system", "content": system})
    for i, msg in enumerate(req.messages):
        if isinstance(msg.content, str):
            out.append({"role": msg.role, "content": msg.content})
        elif msg.role == "user":
            out.extend(_user_messages(msg, f"messages.{i}"))
        else:
            out.append(_assistant_message(msg, f"messages.{i}"))
    return out


def _tool_fields(req: AnthropicPromptFields) -> dict:
    """``tools`` / ``tool_choice`` as OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``.

    Raises:
        RequestError: a server tool (a ``type`` other than "custom"), a tool without ``input_schema``, or
            ``tool_choice`` tool without ``name``.
    """
    tools = None
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if t.type not in (None, "custom"):
                raise RequestError(f"tools.{i}.type: server tools ({t.type!r}) are not supported; only client "
                                   f"tools ({{name, description, input_schema}})", param=f"tools.{i}.type")
            if t.input_schema is None:
                raise RequestError(f"tools.{i}.input_schema: required", param=f"tools.{i}.input_schema")
            tools.append({"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}})
    out = {"tools": tools}
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if choice.name is None:
                raise RequestError("tool_choice.name: required when tool_choice.type is \"tool\"",
                                   param="tool_choice.name")
            out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            out["tool_choice"] = {"any": "required"}.get(choice.type, choice.type)
        out["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return out


def chat_request(req: AnthropicPromptFields, **fields) -> ChatCompletionRequest:
    """The `ChatCompletionRequest` a Messages request (or a count_tokens request) means; `fields` are its
    sampling fields (OpenAI's names: max_tokens, stop, temperature, ...).

    Raises:
        RequestError: 400 naming the field (`chat_messages`, `_tool_fields`, or a value the chat request
            refuses).
    """
    messages = chat_messages(req)
    body = {"model": req.model, "messages": messages, **_tool_fields(req), **fields}
    last = messages[-1]
    if last["role"] == "assistant" and "tool_calls" not in last:
        body["continue_final_message"] = True  # Anthropic's prefill: the reply continues this turn
    if req.thinking is not None:
        on = req.thinking.type != "disabled"
        body["chat_template_kwargs"] = {"thinking": on, "enable_thinking": on}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise RequestError(validation_message(e.errors()), param=validation_param(e.errors())) from None


def sampling_fields(req: AnthropicMessagesRequest) -> dict:
    """The Messages request's sampling fields under OpenAI's names (None: the default)."""
    fields = {"max_tokens": req.max_tokens, "stop": req.stop_sequences or None, "temperature": req.temperature,
              "top_p": req.top_p, "top_k": req.top_k, "stream": req.stream}
    if req.stream:
        fields["stream_options"] = {"include_usage": True}
    if req.output_config is not None and req.output_config.format is not None:
        fields["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": "output", "schema": req.output_config.format.schema_}}
    return fields


# ---------------------------------------------------------------- response: OpenAI chat -> Anthropic
def message_id(chat_id: str) -> str:
    """Anthropic's ``msg_...`` id for a chat call's ``chatcmpl-...`` id."""
    return "msg_" + chat_id.split("-", 1)[-1]


def stop_reason(finish_reason: Optional[str], matched,
                stop_sequences: Optional[List[str]]) -> Tuple[str, Optional[str]]:
    """(stop_reason, stop_sequence) for an OpenAI finish_reason and the engine's matched stop (a stop string,
    or a token id)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    return "end_turn", None


def usage_of(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    """Anthropic's usage (see the module docstring: the cache read is not part of ``input_tokens``)."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}


def message_from_chat(result: dict, stop_sequences: Optional[List[str]]) -> dict:
    """A ``chat.completion`` object (one choice) -> Anthropic's ``message`` object."""
    choice = result["choices"][0]
    msg = choice["message"]
    content = []
    if msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or ():
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"])})
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("matched_stop"), stop_sequences)
    u = result["usage"]
    return {"id": message_id(result["id"]), "type": "message", "role": "assistant", "model": result["model"],
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage_of(u["prompt_tokens"], u["completion_tokens"], u["prompt_tokens_details"]["cached_tokens"])}


# ---------------------------------------------------------------- streaming
def _event(kind: str, **data) -> Event:
    return kind, {"type": kind, **data}


class BlockStream:
    """The content blocks of a streamed message, from chat chunk deltas: a block of each kind (thinking, text,
    tool_use) opens when its first delta comes, and the open one closes when another opens or the stream ends."""

    def __init__(self):
        self.index = -1
        self.kind: Optional[str] = None

    def _open(self, block: dict) -> List[Event]:
        events = self.close()
        self.index += 1
        self.kind = block["type"]
        return events + [_event("content_block_start", index=self.index, content_block=block)]

    def _into(self, kind: str, block: dict) -> List[Event]:
        return self._open(block) if self.kind != kind else []

    def close(self) -> List[Event]:
        """The ``content_block_stop`` of the open block, if one is."""
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", index=self.index)]

    def feed(self, delta: dict) -> List[Event]:
        """The events of one chat delta (``reasoning_content``, ``content``, ``tool_calls``)."""
        events = []
        if delta.get("reasoning_content"):
            events += self._into("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(_event("content_block_delta", index=self.index,
                                 delta={"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            events += self._into("text", {"type": "text", "text": ""})
            events.append(_event("content_block_delta", index=self.index,
                                 delta={"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or ():
            fn = call.get("function") or {}
            if call.get("id") or fn.get("name") or self.kind != "tool_use":  # a new call
                events += self._open({"type": "tool_use", "id": call.get("id"), "name": fn.get("name"), "input": {}})
            if fn.get("arguments"):
                events.append(_event("content_block_delta", index=self.index,
                                     delta={"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return events


async def message_events(chunks: AsyncIterator[dict], start: dict,
                         stop_sequences: Optional[List[str]]) -> AsyncIterator[Event]:
    """Anthropic's stream events for the ``chat.completion.chunk`` objects of one streamed choice (with a final
    usage chunk); `start` is the message of ``message_start``. Closing it closes `chunks`.

    Raises:
        RequestError: from `chunks`.
    """
    yield _event("message_start", message=start)
    blocks = BlockStream()
    finish = matched = None
    prompt, output, cached = start["usage"]["input_tokens"], 0, 0
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            if not chunk["choices"]:  # the usage chunk
                u = chunk.get("usage") or {}
                prompt, output = u.get("prompt_tokens", prompt), u.get("completion_tokens", output)
                cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                continue
            choice = chunk["choices"][0]
            for event in blocks.feed(choice.get("delta") or {}):
                yield event
            if choice.get("finish_reason") is not None:
                finish, matched = choice["finish_reason"], choice.get("matched_stop")
    for event in blocks.close():
        yield event
    reason, sequence = stop_reason(finish, matched, stop_sequences)
    yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                 usage=usage_of(prompt, output, cached))
    yield _event("message_stop")


def sse_event(kind: str, data: dict) -> bytes:
    """One server-sent event as Anthropic sends them: ``event: <kind>`` and ``data: <json>``."""
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


async def sse_events(events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    """The SSE stream of `events`; a RequestError after the stream started ends it with an ``error`` event
    (Anthropic's error body; the SDKs raise an APIStatusError with it). Closing it closes `events`."""
    async with contextlib.aclosing(events):
        try:
            async for kind, data in events:
                yield sse_event(kind, data)
        except RequestError as e:
            yield sse_event("error", anthropic_error_body(e.message, e.status_code))


# ---------------------------------------------------------------- the endpoints
async def create_message(tm: TokenizerManager, req: AnthropicMessagesRequest, wait: Optional[Wait] = None) -> Response:
    """Serve one ``POST /v1/messages`` (`wait`: see serving_completions.create_completion; a client that left
    before a non-streamed answer gets 499).

    Raises:
        RequestError: 4xx naming the problem (`chat_request`, `prepare_chat`), before any output.
    """
    call = await prepare_chat(tm, chat_request(req, **sampling_fields(req)))
    mid = message_id(call.rid)
    if req.stream:
        start = {"id": mid, "type": "message", "role": "assistant", "model": tm.served_model_name, "content": [],
                 "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": len(call.prepared[0].input_ids), "output_tokens": 0}}
        events = message_events(chat_chunks(call), start, req.stop_sequences)
        return StreamingResponse(sse_events(events), media_type="text/event-stream", headers={"request-id": mid})
    result = await chat_result(call, wait)
    if result is None:
        return Response(status_code=499)
    response = json_response(message_from_chat(result, req.stop_sequences))
    response.headers["request-id"] = mid
    return response


async def count_tokens(tm: TokenizerManager, req: AnthropicCountTokensRequest) -> dict:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens": n}``, the length of the prompt /v1/messages renders
    for the same fields (the same translation, tool plan and chat template as `prepare_chat`; nothing is
    admitted or generated, so what /v1/messages checks later -- grammars, the context length with max_tokens --
    is not checked here).

    Raises:
        RequestError: 400 naming the problem when the prompt cannot be rendered (`chat_request`, `plan_tools`,
            `chat_prompt`).
    """
    chat = chat_request(req)
    _, ids = await chat_prompt(tm, chat)
    return {"input_tokens": len(ids)}
