"""Ollama's generation API on the chat machinery: /api/chat and /api/generate
(https://github.com/ollama/ollama/blob/main/docs/api.md).

An Ollama request is translated into a ``ChatCompletionRequest`` (options -> sampling fields, ``format`` ->
``response_format``, ``think`` -> the chat template's thinking switch, tool calls with object arguments ->
OpenAI's string arguments) and run through openai/serving_chat.py, whose streamed chunks are translated back
(SGLang's adapters work the same way). /api/generate renders ``system`` + ``prompt`` as one user turn with the
model's chat template (Ollama applies the model's template); with ``raw`` the prompt goes to the engine as it is.

Both endpoints stream by default, as Ollama: ``application/x-ndjson``, one JSON object a line, each
``{"model", "created_at", "message": {"role", "content"}, "done": false}`` (chat; generate has ``response``),
then one object with ``done: true``, ``done_reason`` ("stop", "length"; "load" for a request with no prompt) and
the counts and durations (nanoseconds). An error after the stream started is a line ``{"error": "..."}``. With
``stream: false`` the same final object carries the whole output; it is built from the same stream, as Ollama's
server builds it.

Durations are measured here, at the HTTP server: ``prompt_eval_duration`` from the request's arrival to the
first output, ``eval_duration`` from there to the end, ``load_duration`` 0 (the model is always loaded).
``prompt_eval_count`` is the whole prompt (cached prefix included), ``eval_count`` the generated tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import time
from typing import Any, AsyncIterator, Dict, List, Optional, Union

import orjson
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from sgl_jax.srt.entrypoints.field_types import truncation_values
from sgl_jax.srt.entrypoints.native_protocol import validation_message, validation_param
from sgl_jax.srt.entrypoints.ollama.protocol import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaMessage,
    OllamaOptions,
    OllamaRequest,
)
from sgl_jax.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from sgl_jax.srt.entrypoints.openai.serving_chat import ChatCall, chat_chunks, chat_prompt, prepare_chat
from sgl_jax.srt.entrypoints.openai.serving_completions import Wait
from sgl_jax.srt.entrypoints.openai.utils import (
    check_top_logprobs,
    finish_reason_str,
    sampling_params_from,
)
from sgl_jax.srt.entrypoints.routes.common import json_response, merge_streams
from sgl_jax.srt.errors import RequestError
from sgl_jax.srt.tokenizer.tokenizer_manager import GenerateReqInput, TokenizerManager

NDJSON = "application/x-ndjson"


def rfc3339_now() -> str:
    """The current UTC time as Ollama writes ``created_at`` (RFC 3339, microseconds, ``Z``)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


# ---------------------------------------------------------------- request translation
def sampling_fields(options: OllamaOptions) -> dict:
    """Ollama ``options`` -> the fields of an OpenAI request (ChatCompletionRequest / CompletionRequest) they
    mean: num_predict <= 0 -> no max_tokens (up to the context), top_k <= 0 -> -1 (off), seed -1 -> none,
    repeat_penalty -> repetition_penalty."""
    return {
        "temperature": options.temperature,
        "top_p": options.top_p,
        "top_k": options.top_k if options.top_k > 0 else -1,
        "max_tokens": options.num_predict if options.num_predict > 0 else None,
        "stop": options.stop,
        "seed": None if options.seed == -1 else options.seed,
        "repetition_penalty": options.repeat_penalty,
        "presence_penalty": options.presence_penalty,
        "frequency_penalty": options.frequency_penalty,
        **truncation_values(options),
    }


def response_format_of(fmt: Union[None, str, Dict[str, Any]]) -> Optional[dict]:
    """Ollama's ``format`` -> OpenAI's ``response_format``: "json" -> json_object, a JSON schema ->
    json_schema, "" or null -> none (free text)."""
    if not fmt:
        return None
    if fmt == "json":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": str(fmt.get("title", "format")), "schema": fmt}}


def think_fields(think: Union[None, bool, str], reasoning_parser: Optional[str], model: str) -> dict:
    """Ollama's ``think`` -> the chat request's thinking switches: false turns thinking off in the chat template
    (``reasoning_effort`` "none"); true or a level needs --reasoning-parser (Ollama refuses thinking for a model
    that cannot think) and turns it on.

    Raises:
        RequestError: 400, thinking asked of a server without --reasoning-parser.
    """
    if think is None:
        return {}
    if think is False:
        return {"reasoning_effort": "none"}
    if reasoning_parser is None:
        raise RequestError(f'"{model}" does not support thinking (the server runs without --reasoning-parser)',
                           param="think")
    if think is True:
        return {"chat_template_kwargs": {"thinking": True, "enable_thinking": True}}
    return {"reasoning_effort": think}


def _take_call_id(pending: List[list], name: Optional[str]) -> Optional[str]:
    """The id of the earliest unanswered call to `name` (any call when `name` is None), removed from
    `pending` ([id, name] pairs)."""
    for k, (call_id, call_name) in enumerate(pending):
        if name is None or call_name == name:
            del pending[k]
            return call_id
    return None


def openai_messages(messages: List[OllamaMessage]) -> List[dict]:
    """Ollama chat messages -> OpenAI's: tool calls get an id (``call_<message>_<call>`` where none was given)
    and their arguments as a JSON string; a tool turn without ``tool_call_id`` answers the earliest unanswered
    call to its ``tool_name`` (the order Ollama's clients send results in)."""
    out: List[dict] = []
    pending: List[list] = []
    for i, m in enumerate(messages):
        msg: Dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            msg["tool_calls"] = []
            for j, tc in enumerate(m.tool_calls):
                call_id = tc.id or f"call_{i}_{j}"
                pending.append([call_id, tc.function.name])
                msg["tool_calls"].append({"id": call_id, "type": "function", "function": {
                    "name": tc.function.name, "arguments": json.dumps(tc.function.arguments, ensure_ascii=False)}})
        if m.role == "tool":
            call_id = m.tool_call_id or _take_call_id(pending, m.tool_name)
            if call_id is not None:
                msg["tool_call_id"] = call_id
            if m.tool_name:
                msg["name"] = m.tool_name
        out.append(msg)
    return out


def validated(model: type, fields: dict):
    """`model` (an OpenAI request class) validated from `fields` translated from an Ollama request.

    Raises:
        RequestError: 400 naming the field, where a translated value does not validate.
    """
    try:
        return model.model_validate(fields)
    except ValidationError as e:
        errors = e.errors()
        raise RequestError(validation_message(errors), param=validation_param(errors)) from None


def chat_request(tm: TokenizerManager, req: OllamaRequest, messages: List[dict],
                 tools: Optional[list] = None) -> ChatCompletionRequest:
    """The streamed ChatCompletionRequest (usage chunk included) an Ollama chat or generate request means."""
    fields: Dict[str, Any] = {
        "model": req.model, "messages": messages, "stream": True, "stream_options": {"include_usage": True},
        "response_format": response_format_of(req.format), **sampling_fields(req.options),
        **think_fields(req.think, tm.server_args.reasoning_parser, req.model),
    }
    if tools:
        fields["tools"] = [t.model_dump(exclude_none=True) for t in tools]
    if req.logprobs:
        fields.update(logprobs=True, top_logprobs=req.top_logprobs)
    return validated(ChatCompletionRequest, fields)


def capped(num_predict: Optional[int], prompt_len: int, context_len: int) -> Optional[int]:
    """Ollama's ``num_predict`` is a cap, never an error: the output stops there or at the end of the context,
    whichever comes first (an OpenAI max_tokens past the context answers 400). A prompt that leaves no room
    keeps `num_predict`, so the engine refuses it with its own message."""
    room = context_len - prompt_len
    return min(num_predict, room) if num_predict is not None and room >= 1 else num_predict


async def fit_to_context(tm: TokenizerManager, creq: ChatCompletionRequest) -> ChatCompletionRequest:
    """`creq` with its max_tokens `capped` to the room the rendered prompt leaves: the messages are rendered
    here (with the tools, as prepare_chat would) and handed on as ``input_ids``, so they are rendered once."""
    if creq.max_tokens is None:
        return creq
    _, creq.input_ids = await chat_prompt(tm, creq)
    creq.max_tokens = capped(creq.max_tokens, len(creq.input_ids), tm.context_len)
    return creq


async def run_chat(tm: TokenizerManager, creq: ChatCompletionRequest) -> AsyncIterator[Union[Piece, Outcome]]:
    """Admit `creq` (prepare_chat, after `fit_to_context`) and return its pieces (`chat_pieces`).

    Raises:
        RequestError: 4xx naming the problem, before anything runs.
    """
    return chat_pieces(await prepare_chat(tm, await fit_to_context(tm, creq)))


# ---------------------------------------------------------------- the output, as pieces
@dataclasses.dataclass
class Piece:
    """Output that arrived: text, thinking, tool calls (Ollama's form) and logprobs (Ollama's form)."""

    content: str = ""
    thinking: str = ""
    tool_calls: List[dict] = dataclasses.field(default_factory=list)
    logprobs: List[dict] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.thinking or self.tool_calls or self.logprobs)

    def extend(self, other: "Piece") -> None:
        self.content += other.content
        self.thinking += other.thinking
        self.tool_calls += other.tool_calls
        self.logprobs += other.logprobs


@dataclasses.dataclass
class Outcome:
    """How the output ended: Ollama's done_reason and the token counts."""

    done_reason: str
    prompt_tokens: int
    completion_tokens: int


def done_reason_of(finish_reason: Optional[str]) -> str:
    """OpenAI's finish_reason -> Ollama's done_reason: "length" stays, a tool call or a stop is "stop" (as
    Ollama reports a tool call), "abort" (an admin abort) stays."""
    return finish_reason if finish_reason in ("length", "abort") else "stop"


def ollama_tool_call(tc: dict, index: int) -> dict:
    """An OpenAI tool call (arguments a JSON string) -> Ollama's (arguments an object)."""
    fn = tc["function"]
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except json.JSONDecodeError:
        args = {}
    return {"id": tc.get("id"), "function": {"index": tc.get("index", index), "name": fn["name"],
                                             "arguments": args if isinstance(args, dict) else {}}}


async def chat_pieces(call: ChatCall) -> AsyncIterator[Union[Piece, Outcome]]:
    """The pieces of a prepared chat call (its chunks translated), then its Outcome. Closing it aborts the
    request."""
    reason, prompt_tokens, completion_tokens = "stop", 0, 0
    chunks = chat_chunks(call)
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            if chunk.get("usage") is not None:
                prompt_tokens = chunk["usage"]["prompt_tokens"]
                completion_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                delta = choice["delta"]
                piece = Piece(delta.get("content") or "", delta.get("reasoning_content") or "",
                              [ollama_tool_call(tc, j) for j, tc in enumerate(delta.get("tool_calls") or [])],
                              list((choice.get("logprobs") or {}).get("content") or []))
                if piece:
                    yield piece
                if choice["finish_reason"] is not None:
                    reason = done_reason_of(choice["finish_reason"])
    yield Outcome(reason, prompt_tokens, completion_tokens)


def ollama_logprobs(entries: list, tops: list, top_n: int) -> List[dict]:
    """SGLang's (logprob, id, text) entries (and per-token alternatives) -> Ollama's logprobs list."""
    def item(e) -> dict:
        token = e[2] or ""
        return {"token": token, "logprob": e[0], "bytes": list(token.encode("utf-8"))}

    out = []
    for j, e in enumerate(entries):
        d = item(e)
        if top_n > 0:
            d["top_logprobs"] = [item(t) for t in tops[j]] if j < len(tops) and tops[j] else []
        out.append(d)
    return out


async def raw_pieces(tm: TokenizerManager, prepared, top_n: int) -> AsyncIterator[Union[Piece, Outcome]]:
    """The pieces of one prepared raw-prompt request, then its Outcome. Closing it aborts the request."""
    sent_text = sent_lp = 0
    meta: Dict[str, Any] = {}
    streams = merge_streams([tm.generate_request(prepared, admitted=True)])
    async with contextlib.aclosing(streams):
        async for _, r in streams:
            meta = r["meta_info"]
            piece = Piece(r["text"][sent_text:])
            sent_text = len(r["text"])
            if "output_token_logprobs" in meta:
                entries = meta["output_token_logprobs"]
                piece.logprobs = ollama_logprobs(entries[sent_lp:], (meta.get("output_top_logprobs") or [])[sent_lp:],
                                                 top_n)
                sent_lp = len(entries)
            if piece:
                yield piece
    yield Outcome(done_reason_of(finish_reason_str(meta.get("finish_reason"))), meta.get("prompt_tokens", 0),
                  meta.get("completion_tokens", 0))


# ---------------------------------------------------------------- Ollama's response objects
class Reply:
    """Builds the response objects of one request (`kind` "chat" or "generate") and times it (ns)."""

    def __init__(self, model: str, kind: str):
        self.model = model
        self.kind = kind
        self.start_ns = time.perf_counter_ns()
        self.first_ns: Optional[int] = None

    def note(self, piece: Piece, done: bool = False) -> None:
        """Time the first output (or the end, when there was none)."""
        if self.first_ns is None and (piece or done):
            self.first_ns = time.perf_counter_ns()

    def _object(self, piece: Piece, done: bool) -> dict:
        self.note(piece, done)
        obj: Dict[str, Any] = {"model": self.model, "created_at": rfc3339_now()}
        if self.kind == "chat":
            message: Dict[str, Any] = {"role": "assistant", "content": piece.content}
            if piece.thinking:
                message["thinking"] = piece.thinking
            if piece.tool_calls:
                message["tool_calls"] = piece.tool_calls
            obj["message"] = message
        else:
            obj["response"] = piece.content
            if piece.thinking:
                obj["thinking"] = piece.thinking
        if piece.logprobs:
            obj["logprobs"] = piece.logprobs
        obj["done"] = done
        return obj

    def chunk(self, piece: Piece) -> dict:
        """A streamed object (done false)."""
        return self._object(piece, False)

    def final(self, outcome: Outcome, piece: Optional[Piece] = None) -> dict:
        """The last object: done, done_reason, counts and durations (`piece`: the whole output, unstreamed)."""
        obj = self._object(piece or Piece(), True)
        end = time.perf_counter_ns()
        first = self.first_ns
        obj.update(done_reason=outcome.done_reason, total_duration=end - self.start_ns, load_duration=0,
                   prompt_eval_count=outcome.prompt_tokens, prompt_eval_duration=first - self.start_ns,
                   eval_count=outcome.completion_tokens, eval_duration=max(end - first, 1))
        return obj

    def loaded(self) -> dict:
        """Ollama's answer to a request with no prompt (it loads the model): done, done_reason "load"."""
        obj = self._object(Piece(), True)
        obj["done_reason"] = "load"
        return obj


def ndjson_line(obj: dict) -> bytes:
    return orjson.dumps(obj) + b"\n"


async def ndjson_stream(pieces: AsyncIterator[Union[Piece, Outcome]], reply: Reply) -> AsyncIterator[bytes]:
    """Ollama's NDJSON stream of `pieces`; an error after the stream started is the line ``{"error": msg}``.
    Closing it closes `pieces` (which aborts the request)."""
    async with contextlib.aclosing(pieces):
        try:
            async for p in pieces:
                yield ndjson_line(reply.final(p) if isinstance(p, Outcome) else reply.chunk(p))
        except RequestError as e:
            yield ndjson_line({"error": e.message})


async def collect(pieces: AsyncIterator[Union[Piece, Outcome]], reply: Reply) -> dict:
    """The one object of an unstreamed response: every piece joined, done with the counts.

    Raises:
        RequestError: the engine failed the request.
    """
    whole = Piece()
    async with contextlib.aclosing(pieces):
        async for p in pieces:
            if isinstance(p, Outcome):
                return reply.final(p, whole)
            reply.note(p)
            whole.extend(p)
    raise RequestError("the request ended without a result", 500)


async def respond(pieces: AsyncIterator[Union[Piece, Outcome]], reply: Reply, stream: bool,
                  wait: Optional[Wait]) -> Response:
    """The HTTP response: an NDJSON stream, or one JSON object (499 when `wait` saw the client leave)."""
    if stream:
        return StreamingResponse(ndjson_stream(pieces, reply), media_type=NDJSON)
    work = collect(pieces, reply)
    result = await (wait(work) if wait is not None else work)
    if result is None:
        return Response(status_code=499)
    return json_response(result)


# ---------------------------------------------------------------- the endpoints
async def ollama_chat(tm: TokenizerManager, req: OllamaChatRequest, wait: Optional[Wait] = None) -> Response:
    """Serve POST /api/chat (see the module docstring).

    Raises:
        RequestError: 4xx naming the problem (as /v1/chat/completions), before anything is streamed.
    """
    reply = Reply(tm.served_model_name, "chat")
    if not req.messages:
        return json_response(reply.loaded())
    pieces = await run_chat(tm, chat_request(tm, req, openai_messages(req.messages), req.tools))
    return await respond(pieces, reply, req.stream, wait)


def raw_request(tm: TokenizerManager, req: OllamaGenerateRequest) -> GenerateReqInput:
    """The engine request of a raw /api/generate: the prompt as it is (tokenized here, special tokens added as
    for any text prompt), the options as sampling params (num_predict `capped` to the context).

    Raises:
        RequestError: 400, an option out of range or a prompt longer than the context; 413 (memory preflight).
    """
    fields = {"model": req.model, "prompt": req.prompt, "response_format": response_format_of(req.format),
              **sampling_fields(req.options)}
    creq = validated(CompletionRequest, fields)
    top_n = req.top_logprobs if req.logprobs else 0
    check_top_logprobs("top_logprobs", top_n, tm.server_args.max_top_logprobs_num)
    ids = tm.encode_text(req.prompt)
    max_tokens = capped(creq.max_tokens, len(ids), tm.context_len)
    return GenerateReqInput(input_ids=ids, sampling_params=sampling_params_from(creq, max_tokens),
                            return_logprob=req.logprobs, top_logprobs_num=top_n, return_text_in_logprobs=True,
                            stream=True)


async def ollama_generate(tm: TokenizerManager, req: OllamaGenerateRequest, wait: Optional[Wait] = None) -> Response:
    """Serve POST /api/generate (see the module docstring).

    Raises:
        RequestError: 4xx naming the problem, before anything is streamed; raw with a system prompt (Ollama:
            "raw mode does not support template, system, or context").
    """
    if req.raw and req.system:
        raise RequestError("raw mode does not support template, system, or context", param="raw")
    reply = Reply(tm.served_model_name, "generate")
    if not req.prompt:
        return json_response(reply.loaded())
    if req.raw:
        obj = await tm.run_blocking(raw_request, tm, req)
        (prepared,) = await tm.prepare_fanout([obj])
        return await respond(raw_pieces(tm, prepared, obj.top_logprobs_num), reply, req.stream, wait)
    messages = ([{"role": "system", "content": req.system}] if req.system else []) + \
        [{"role": "user", "content": req.prompt}]
    pieces = await run_chat(tm, chat_request(tm, req, messages))
    return await respond(pieces, reply, req.stream, wait)
