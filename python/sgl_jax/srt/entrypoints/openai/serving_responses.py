"""POST /v1/responses (OpenAI's Responses API, https://platform.openai.com/docs/api-reference/responses) served
through the chat path, as SGLang's and vLLM's adapters do: the request becomes a ``ChatCompletionRequest``
(`chat_request`), runs with serving_chat's `prepare_chat` / `chat_result` / `chat_chunks`, and the chat result
becomes a ``response`` object (`response_result`) or the Responses stream events (`response_events`).

Input to messages: ``instructions`` is a first system message; a string input is one user message; message
items keep their role (``developer`` is rendered as ``system``, which chat templates know); ``function_call``
items become the ``tool_calls`` of an assistant message (joined to the assistant message before them);
``function_call_output`` items become ``tool`` messages; ``reasoning`` items are left out. With
``previous_response_id`` the stored conversation (its input and output items) comes first; its instructions do
not (OpenAI's rule).

Output: a ``reasoning`` item (with ``--reasoning-parser``: the chat message's ``reasoning_content``), a
``message`` item with one ``output_text`` part (when there is text, or nothing else), then one
``function_call`` item per tool call. Cut by ``max_output_tokens``: status ``incomplete`` with
``incomplete_details.reason`` ``"max_output_tokens"`` (aborted by the operator, ``/abort_request``:
``incomplete`` with reason null). ``usage.output_tokens_details.reasoning_tokens`` is the
token count of the reasoning text (re-tokenized).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from typing import AsyncIterator, Awaitable, Callable, List, Optional

import orjson
from pydantic import ValidationError

from sgl_jax.srt.entrypoints.error_bodies import openai_error_body
from sgl_jax.srt.entrypoints.native_protocol import validation_message
from sgl_jax.srt.entrypoints.openai.protocol import ChatCompletionRequest
from sgl_jax.srt.entrypoints.openai.response_store import ResponseStore
from sgl_jax.srt.entrypoints.openai.responses_protocol import ResponsesRequest, ToolChoiceFunction
from sgl_jax.srt.entrypoints.openai.serving_chat import ChatCall, chat_chunks, chat_result, prepare_chat
from sgl_jax.srt.entrypoints.openai.serving_completions import Wait
from sgl_jax.srt.errors import RequestError


def new_id(prefix: str) -> str:
    """An OpenAI-style id: ``<prefix>_<32 hex digits>`` (``resp``, ``msg``, ``fc``, ``rs``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------- request -> chat request
def input_items(req: ResponsesRequest) -> List[dict]:
    """The request's input as Responses item dicts (a string input is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return [item.model_dump(mode="json", by_alias=True, exclude_none=True) for item in req.input]


def item_text(content) -> str:
    """A message item's ``content`` or a call output's ``output`` (a string or text / refusal parts) as text."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", p.get("refusal", "")) for p in content)


def chat_messages(items: List[dict], instructions: Optional[str] = None) -> List[dict]:
    """Responses items -> chat messages (see the module docstring)."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    names = {}  # call_id -> function name, for the tool messages (some templates show it)
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": item_text(item["content"])})
        elif kind == "function_call":
            names[item["call_id"]] = item["name"]
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            message = {"role": "tool", "content": item_text(item["output"])}
            if item.get("call_id") is not None:
                message["tool_call_id"] = item["call_id"]
                if item["call_id"] in names:
                    message["name"] = names[item["call_id"]]
            messages.append(message)
    return messages


def _response_format(req: ResponsesRequest) -> Optional[dict]:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": fmt.name or "schema", "schema": fmt.schema_, "description": fmt.description,
              "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": schema}


def chat_request(req: ResponsesRequest, items: List[dict]) -> ChatCompletionRequest:
    """The chat request that serves `req` on the conversation `items` (stored history + this input).

    Raises:
        RequestError: 400, the conversation has no message.
    """
    messages = chat_messages(items, req.instructions)
    if not messages:
        raise RequestError("input must not be empty (without instructions or previous_response_id)",
                           param="input")
    tool_choice = req.tool_choice
    if isinstance(tool_choice, ToolChoiceFunction):
        tool_choice = {"type": "function", "function": {"name": tool_choice.name}}
    body = {
        "model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream,
        "tools": [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                  for t in req.tools] or None,
        "tool_choice": tool_choice, "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req),
        "reasoning_effort": req.reasoning.effort if req.reasoning is not None else None,
    }
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # not expected: the Responses model checks the same ranges
        raise RequestError(validation_message(e.errors())) from None


# ---------------------------------------------------------------- the call and the response object
@dataclasses.dataclass
class ResponseCall:
    """One /v1/responses call once admitted.

    items: the conversation the prompt was rendered from (stored history + this request's input items).
    store: where the finished response goes (None: ``store`` false).
    count_tokens: async text -> token count (for ``reasoning_tokens``).
    """

    req: ResponsesRequest
    model: str
    items: List[dict]
    store: Optional[ResponseStore]
    count_tokens: Callable[[str], Awaitable[int]]
    chat: Optional[ChatCall] = None
    id: str = dataclasses.field(default_factory=lambda: new_id("resp"))
    created_at: int = dataclasses.field(default_factory=lambda: int(time.time()))


# chat finish reasons that leave a response incomplete -> OpenAI's incomplete_details.reason
INCOMPLETE_REASONS = {"length": "max_output_tokens", "abort": None}


def response_object(call: ResponseCall, status: str, output: List[dict], usage: Optional[dict] = None,
                    error: Optional[dict] = None, finish_reason: Optional[str] = None) -> dict:
    """The ``response`` object (openai's ``Response`` type) of `call` in `status` ("in_progress", "completed",
    "incomplete" -- `finish_reason` says why, see INCOMPLETE_REASONS -- or "failed" with `error`)."""
    req = call.req
    tool_choice = req.tool_choice
    if isinstance(tool_choice, ToolChoiceFunction):
        tool_choice = {"type": "function", "name": tool_choice.name}
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    return {
        "id": call.id, "object": "response", "created_at": call.created_at, "status": status,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        "error": error,
        "incomplete_details": {"reason": INCOMPLETE_REASONS.get(finish_reason)} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": call.model,
        "output": output, "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning is not None else None, "summary": None},
        "store": req.store, "temperature": req.temperature, "top_p": req.top_p,
        "text": {"format": fmt.echo() if fmt is not None else {"type": "text"}},
        "tool_choice": tool_choice,
        "tools": [t.model_dump(mode="json", exclude_none=True) for t in req.tools],
        "truncation": "disabled", "background": False, "service_tier": "default",
        "metadata": req.metadata or {}, "user": req.user, "usage": usage,
    }


def responses_usage(chat_usage: dict, reasoning_tokens: int = 0) -> dict:
    """Chat usage (prompt / completion tokens) -> the Responses usage object."""
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": chat_usage["prompt_tokens"] + chat_usage["completion_tokens"]}


def message_item(item_id: str, text: Optional[str], status: str) -> dict:
    """An assistant ``message`` output item; ``text`` None: no content part yet (in progress)."""
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def reasoning_item(item_id: str, text: Optional[str], status: str) -> dict:
    """A ``reasoning`` output item carrying the reasoning text (no summary); ``text`` None: in progress."""
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def function_call_item(item_id: str, call: dict, status: str, arguments: Optional[str] = None) -> dict:
    """A ``function_call`` output item from a chat tool call (``{"id", "function": {"name", "arguments"}}``)."""
    fn = call["function"]
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"] if arguments is None else arguments, "status": status}


def output_items(message: dict, incomplete: bool) -> List[dict]:
    """The output items of a finished chat message (see the module docstring)."""
    out = []
    if message.get("reasoning_content"):
        out.append(reasoning_item(new_id("rs"), message["reasoning_content"], "completed"))
    calls = message.get("tool_calls") or []
    text = message.get("content") or ""
    if text or not calls:
        out.append(message_item(new_id("msg"), text, "incomplete" if incomplete else "completed"))
    out += [function_call_item(new_id("fc"), c, "completed") for c in calls]
    return out


def reasoning_text(output: List[dict]) -> str:
    """The text of the reasoning items among `output`."""
    return "".join(p["text"] for item in output if item["type"] == "reasoning" for p in item["content"])


def finish(call: ResponseCall, output: List[dict], finish_reason: Optional[str], usage: dict) -> dict:
    """The finished response object (of the chat `finish_reason`), stored when the request asked so."""
    status = "incomplete" if finish_reason in INCOMPLETE_REASONS else "completed"
    response = response_object(call, status, output, usage, finish_reason=finish_reason)
    if call.store is not None:
        call.store.put(call.id, response, call.items + output)
    return response


# ---------------------------------------------------------------- serving
async def prepare_response(tm, req: ResponsesRequest, store: ResponseStore) -> ResponseCall:
    """Validate `req`, continue its ``previous_response_id`` conversation, render and admit it.

    Raises:
        RequestError: 400 naming the field (an unknown or expired previous_response_id, an empty input, and what
            the chat path refuses); 413 / 503 when it cannot be admitted.
    """
    history: List[dict] = []
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id)
        if previous is None:
            raise RequestError(f"Previous response with id {req.previous_response_id!r} not found (never stored, "
                               f"deleted or expired from this server's in-memory store)",
                               param="previous_response_id")
        history = previous.items

    async def count_tokens(text: str) -> int:
        if not text:
            return 0
        return len(await tm.run_blocking(lambda: tm.tokenizer.encode(text, add_special_tokens=False)))

    call = ResponseCall(req, tm.served_model_name, history + input_items(req), store if req.store else None,
                        count_tokens)
    call.chat = await prepare_chat(tm, chat_request(req, call.items))
    return call


async def response_result(call: ResponseCall, wait: Optional[Wait] = None) -> Optional[dict]:
    """The finished response object of a prepared, non-streamed call (stored if asked); None when `wait` saw the
    client leave (the request is then aborted)."""
    result = await chat_result(call.chat, wait)
    if result is None:
        return None
    choice = result["choices"][0]
    output = output_items(choice["message"], choice["finish_reason"] in INCOMPLETE_REASONS)
    usage = responses_usage(result["usage"], await call.count_tokens(reasoning_text(output)))
    return finish(call, output, choice["finish_reason"], usage)


class EventStream:
    """The Responses stream events of one call, built from its chat chunks: stamps ``sequence_number`` (0, 1,
    ...), tracks the output item being streamed (a reasoning item or the message) and the finished ones."""

    def __init__(self, call: ResponseCall):
        self.call = call
        self.seq = 0
        self.output: List[dict] = []  # the finished items
        self.open_kind: Optional[str] = None  # "reasoning" / "message" while one streams
        self.open_id = ""
        self.open_text = ""

    def event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _where(self) -> dict:
        return {"item_id": self.open_id, "output_index": len(self.output), "content_index": 0}

    def open(self, kind: str) -> List[dict]:
        """Close the item being streamed and open one of `kind` ("reasoning" / "message") with its one part."""
        events = self.close("completed")
        self.open_kind, self.open_id, self.open_text = kind, new_id("rs" if kind == "reasoning" else "msg"), ""
        item = (reasoning_item if kind == "reasoning" else message_item)(self.open_id, None, "in_progress")
        events.append(self.event("response.output_item.added", output_index=len(self.output), item=item))
        events.append(self.event("response.content_part.added", **self._where(), part=self._part("")))
        return events

    def text(self, kind: str, delta: str) -> List[dict]:
        """Events of a text delta of `kind` ("reasoning" / "message"), opening its item first if needed."""
        events = self.open(kind) if self.open_kind != kind else []
        self.open_text += delta
        if kind == "reasoning":
            events.append(self.event("response.reasoning_text.delta", **self._where(), delta=delta))
        else:
            events.append(self.event("response.output_text.delta", **self._where(), delta=delta, logprobs=[]))
        return events

    def _part(self, text: str) -> dict:
        if self.open_kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def close(self, status: str) -> List[dict]:
        """The done events of the item being streamed (none if none is); the message gets `status`."""
        if self.open_kind is None:
            return []
        text, where = self.open_text, self._where()
        if self.open_kind == "reasoning":
            events = [self.event("response.reasoning_text.done", **where, text=text)]
            item = reasoning_item(self.open_id, text, "completed")
        else:
            events = [self.event("response.output_text.done", **where, text=text, logprobs=[])]
            item = message_item(self.open_id, text, status)
        events.append(self.event("response.content_part.done", **where, part=self._part(text)))
        events.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        self.output.append(item)
        self.open_kind = None
        return events

    def calls(self, tool_calls: List[dict]) -> List[dict]:
        """The events of finished tool calls (each one function_call item, its arguments in one delta)."""
        events = self.close("completed")
        for call in tool_calls:
            item_id, index = new_id("fc"), len(self.output)
            args = call["function"]["arguments"]
            events.append(self.event("response.output_item.added", output_index=index,
                                     item=function_call_item(item_id, call, "in_progress", arguments="")))
            events.append(self.event("response.function_call_arguments.delta", item_id=item_id,
                                     output_index=index, delta=args))
            events.append(self.event("response.function_call_arguments.done", item_id=item_id,
                                     output_index=index, arguments=args))
            item = function_call_item(item_id, call, "completed")
            events.append(self.event("response.output_item.done", output_index=index, item=item))
            self.output.append(item)
        return events

    def chunk(self, chunk: dict) -> List[dict]:
        """The events of one chat chunk (its choice's delta)."""
        events = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self.text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self.text("message", delta["content"])
            if delta.get("tool_calls"):
                events += self.calls(delta["tool_calls"])
        return events

    def end(self, incomplete: bool) -> List[dict]:
        """Close the last item; a message item (empty if no text came) when there is neither text nor a call."""
        status = "incomplete" if incomplete else "completed"
        events = self.close(status)
        if not any(item["type"] in ("message", "function_call") for item in self.output):
            events += self.open("message") + self.close(status)
        return events


async def response_events(call: ResponseCall, chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """The Responses stream of `call` from its chat `chunks` (serving_chat.chat_chunks with include_usage):
    response.created, response.in_progress, per output item output_item.added, content_part.added,
    output_text.delta / reasoning_text.delta ... (or function_call_arguments.delta / .done), the done events,
    then response.completed -- response.incomplete when cut short (INCOMPLETE_REASONS) -- with the whole response
    (stored if asked). An engine error after the start ends it with an ``error`` event (the openai SDK's
    ``ResponseErrorEvent`` fields plus OpenAI's ``error`` object, on which the SDKs raise) and response.failed.
    Closing the iterator closes `chunks` (which aborts the request)."""
    stream = EventStream(call)
    yield stream.event("response.created", response=response_object(call, "in_progress", []))
    yield stream.event("response.in_progress", response=response_object(call, "in_progress", []))
    finish_reason, usage = None, None
    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                for event in stream.chunk(chunk):
                    yield event
                for choice in chunk.get("choices") or []:
                    finish_reason = choice.get("finish_reason") or finish_reason
                usage = chunk.get("usage") or usage
        except RequestError as e:  # the SDK type's fields, and OpenAI's error object (the SDKs raise with it)
            error = openai_error_body(e.message, e.status_code, e.param)["error"]
            yield stream.event("error", code=error["type"], message=e.message, param=e.param, error=error)
            error = {"code": "server_error" if e.status_code >= 500 else "invalid_prompt", "message": e.message}
            yield stream.event("response.failed", response=response_object(call, "failed", stream.output,
                                                                            error=error))
            return
    incomplete = finish_reason in INCOMPLETE_REASONS
    for event in stream.end(incomplete):
        yield event
    usage = responses_usage(usage or {"prompt_tokens": 0, "completion_tokens": 0},
                            await call.count_tokens(reasoning_text(stream.output)))
    response = finish(call, stream.output, finish_reason, usage)
    yield stream.event("response.incomplete" if incomplete else "response.completed", response=response)


def stream_events(call: ResponseCall) -> AsyncIterator[dict]:
    """`response_events` of a prepared, streamed call."""
    return response_events(call, chat_chunks(call.chat))


async def sse_frames(events: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """Server-sent events as OpenAI sends the Responses stream: ``event: <type>`` and ``data: <json>`` per event,
    no ``[DONE]``. Closing it closes `events`."""
    async with contextlib.aclosing(events):
        async for event in events:
            yield b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"
