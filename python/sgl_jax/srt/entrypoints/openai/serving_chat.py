"""POST /v1/chat/completions: the model's chat template, streaming (SSE, ``[DONE]``) and not, usage.

With ``--reasoning-parser`` (parsers/reasoning_parser.py), the thinking part of each choice's output is split
off as SGLang does: ``message.reasoning_content`` (non-streaming) or ``delta.reasoning_content`` chunks
(streaming), the rest being ``content``; the tool-call parser reads only the content. The request's
``separate_reasoning`` false keeps all output in ``content``; ``stream_reasoning`` false sends the reasoning in
one delta when it ends. A grammar-constrained output (response_format, json_schema, regex, ebnf, a forced tool
call) is never split: the grammar decides the whole output, which has no free thinking part. With a
reasoning parser, every message carries ``reasoning_content`` (null when there is none), and an empty content
is null (SGLang's response).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import time
import uuid
from typing import AsyncIterator, List, Optional, Tuple, Union

from fastapi.responses import Response, StreamingResponse

from sgl_jax.srt.constrained.grammar_backend import GRAMMAR_KINDS
from sgl_jax.srt.entrypoints.openai.protocol import ChatCompletionRequest, ContentPart
from sgl_jax.srt.entrypoints.openai.serving_completions import Wait
from sgl_jax.srt.entrypoints.openai.serving_tools import (
    ToolPlan,
    ToolStream,
    message_for,
    plan_tools,
    template_renders_tools,
    with_tools_in_system_prompt,
)
from sgl_jax.srt.entrypoints.openai.utils import (
    check_n,
    check_top_logprobs,
    finish_reason_str,
    sampling_params_from,
    lora_of,
    session_params_of,
    sse_stream,
    usage,
)
from sgl_jax.srt.entrypoints.parsers.reasoning_parser import ReasoningDetector, get_detector
from sgl_jax.srt.entrypoints.routes.common import gather_or_cancel, json_response, merge_streams
from sgl_jax.srt.tokenizer.tokenizer_manager import GenerateReqInput, RequestError, TokenizerManager

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=8)
def _template_params(tokenizer_class) -> frozenset:
    """The parameter names of a tokenizer class's apply_chat_template (read once per class, not per request)."""
    params = set(inspect.signature(tokenizer_class.apply_chat_template).parameters) - {"self", "kwargs"}
    return frozenset(params | {"messages"})


def template_vars(req: ChatCompletionRequest) -> dict:
    """The extra variables the chat template renders with, as SGLang passes them: ``chat_template_kwargs``,
    plus ``thinking`` and ``enable_thinking`` (the names models' templates read) from ``reasoning_effort``
    (false for "none", else true) unless chat_template_kwargs sets them."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        thinking = req.reasoning_effort != "none"
        kwargs.setdefault("thinking", thinking)
        kwargs.setdefault("enable_thinking", thinking)
    return kwargs


def chat_template_kwargs(tok, req: ChatCompletionRequest) -> dict:
    """`template_vars`, checked against the tokenizer's apply_chat_template.

    Raises:
        RequestError: a key that names a parameter of the tokenizer's apply_chat_template (set by the server).
    """
    kwargs = template_vars(req)
    reserved = sorted(set(req.chat_template_kwargs or {}) & _template_params(type(tok)))
    if reserved:
        raise RequestError(f"chat_template_kwargs: {', '.join(reserved)} cannot be set (the server sets them)")
    return kwargs


def message_text(content: Union[None, str, List[ContentPart]]) -> str:
    """A message's content as text (text parts joined).

    Raises:
        RequestError: a content part that is not text.
    """
    if isinstance(content, list):
        if any(p.type != "text" for p in content):
            raise RequestError("only text content parts are supported")
        content = "".join(p.text or "" for p in content)
    return content or ""


def chat_prompt_ids(tm: TokenizerManager, req: ChatCompletionRequest, plan: Optional[ToolPlan] = None) -> List[int]:
    """Render the messages (and the tools of `plan`, when given) with the model's chat template (generation
    prompt appended; with SGLang's continue_final_message, a final assistant message continued instead) and
    tokenize. A template that does not render tools gets them in the system prompt
    (serving_tools.with_tools_in_system_prompt). SGLang's ``input_ids`` are the prompt as they are (no template).

    Raises:
        RequestError: an embedding server, no messages, no chat template, unsupported features, tools neither the
            template nor the parser can put in the prompt, or a template error.
    """
    tm.check_generates()
    if not req.messages:
        raise RequestError("messages must not be empty")
    if req.input_ids is not None:  # SGLang: a pre-tokenized prompt bypasses the chat template
        return list(req.input_ids)
    tok = tm.tokenizer
    if not getattr(tok, "chat_template", None):
        raise RequestError("This model has no chat template; use /v1/completions")
    messages = []
    for m in req.messages:
        message = {"role": m.role, "content": message_text(m.content)}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(m, key) is not None:
                message[key] = getattr(m, key)
        messages.append(message)
    kwargs = chat_template_kwargs(tok, req)
    cont = continues_final_message(req)
    tools = plan.template_tools if plan is not None else None
    if tools and not template_renders_tools(tok):
        messages, tools = with_tools_in_system_prompt(messages, plan), None
        logger.info("Chat request with %d tools: rendered into the system prompt (the chat template does not render "
                    "tools; the %s parser's format)", len(plan.template_tools), plan.parser.name)
    try:
        text = tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                       add_generation_prompt=req.add_generation_prompt and not cont,
                                       continue_final_message=cont, **kwargs)
    except Exception as e:  # jinja2 errors: unsupported roles and the like
        raise RequestError(f"Chat template error: {e}") from None
    return tm.encode_text(text, add_special_tokens=False)


def with_tool_grammar(sampling_params: dict, plan: Optional[ToolPlan]) -> dict:
    """Constrain the output to the forced calls' schema (tool_choice required / named)."""
    if plan is not None and plan.forced_schema is not None:
        sampling_params = {**sampling_params, "json_schema": plan.forced_schema}
    return sampling_params


def continues_final_message(req: ChatCompletionRequest) -> bool:
    """SGLang's continue_final_message: the output continues a final assistant message instead of starting a new
    turn."""
    return bool(req.continue_final_message and req.messages and req.messages[-1].role == "assistant")


def is_constrained(sampling_params: dict) -> bool:
    """Whether a grammar (json_schema, regex, ebnf) decides the whole output."""
    return any(sampling_params.get(k) is not None for k in GRAMMAR_KINDS)


def reasoning_detectors(parser_name: Optional[str], req: ChatCompletionRequest, n: int,
                        constrained: bool) -> List[Optional[ReasoningDetector]]:
    """One reasoning detector per choice (SGLang keeps one per choice index), each None where the output is
    not split: no --reasoning-parser, ``separate_reasoning`` false, a grammar-constrained output, or a
    template rendered without thinking (qwen3 with ``enable_thinking`` false, also from ``reasoning_effort``
    "none")."""
    if parser_name is None or not req.separate_reasoning or constrained:
        return [None] * n
    continuing = continues_final_message(req)
    previous = message_text(req.messages[-1].content) if continuing else ""
    new_turn = req.add_generation_prompt and not continuing
    return [get_detector(parser_name, stream_reasoning=req.stream_reasoning, template_kwargs=template_vars(req),
                         previous_content=previous, new_turn=new_turn) for _ in range(n)]


def _chat_logprobs(entries, tops, top_n: int) -> dict:
    def item(e):
        token = e[2] or ""
        return {"token": token, "logprob": e[0], "bytes": list(token.encode("utf-8"))}

    content = []
    for j, e in enumerate(entries):
        d = item(e)
        d["top_logprobs"] = [item(t) for t in tops[j]] if top_n > 0 and j < len(tops) else []
        content.append(d)
    return {"content": content}


@dataclasses.dataclass
class ChatCall:
    """One chat call once its requests are admitted: what building its response needs. The other chat-shaped
    APIs (/v1/responses, /v1/messages, Ollama's /api/chat) translate their request into a
    ChatCompletionRequest and their responses from `chat_result` / `chat_chunks` (SGLang's adapters do the
    same)."""

    tm: TokenizerManager
    req: ChatCompletionRequest
    plan: Optional[ToolPlan]  # None without tools
    detectors: list  # per choice, its reasoning detector (None: no split)
    prepared: list  # the admitted GenerateReqInputs, one per choice
    top_n: int
    rid: str = dataclasses.field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def chunk(self, choices, **extra) -> dict:
        return {"id": self.rid, "object": "chat.completion.chunk", "created": self.created,
                "model": self.tm.served_model_name, "choices": choices, **extra}


async def chat_prompt(tm: TokenizerManager, req: ChatCompletionRequest) -> Tuple[Optional[ToolPlan], List[int]]:
    """The request's tool plan (serving_tools.plan_tools) and its prompt token ids (`chat_prompt_ids`, rendered
    off the event loop): what prepare_chat runs, for the APIs that need the prompt first (Anthropic's
    count_tokens, Ollama's num_predict cap).

    Raises:
        RequestError: see plan_tools and chat_prompt_ids.
    """
    plan = plan_tools(req, tm.server_args.tool_call_parser, tm.info.architecture)
    return plan, await tm.run_blocking(chat_prompt_ids, tm, req, plan)


async def prepare_chat(tm: TokenizerManager, req: ChatCompletionRequest) -> ChatCall:
    """Validate, render and admit one chat request (all n choices), as /v1/chat/completions does.

    Raises:
        RequestError: 4xx naming the problem (see ChatCompletionRequest and the module docstring); 413/503 when
            the fan-out cannot be admitted.
    """
    check_n("n", req.n, tm.server_args.max_n)
    tm.check_admission(req.n)  # the whole fan-out, before rendering and tokenizing
    plan, input_ids = await chat_prompt(tm, req)
    top_n = req.top_logprobs or 0
    check_top_logprobs("top_logprobs", req.top_logprobs, tm.server_args.max_top_logprobs_num)
    if top_n and not req.logprobs:
        raise RequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    sampling_params = [with_tool_grammar(sampling_params_from(req, max_tokens, seed_offset=k), plan)
                       for k in range(req.n)]
    detectors = reasoning_detectors(tm.server_args.reasoning_parser, req, req.n, is_constrained(sampling_params[0]))
    lora = lora_of(tm, req)
    prepared = await tm.prepare_fanout([GenerateReqInput(
        input_ids=input_ids,
        sampling_params=sampling_params[k],
        return_logprob=req.logprobs,
        top_logprobs_num=top_n,
        return_text_in_logprobs=True,
        stream=req.stream,
        rid=f"{req.rid}-{k}" if req.rid else None,
        session_params=session_params_of(req, req.n),
        lora_path=lora,
    ) for k in range(req.n)])
    return ChatCall(tm, req, plan, detectors, prepared, top_n)


async def chat_result(call: ChatCall, wait: Optional[Wait] = None) -> Optional[dict]:
    """The ``chat.completion`` object of a prepared, non-streamed call; None when `wait` saw the client leave
    (the requests are then aborted)."""
    work = gather_or_cancel(call.tm.generate(p, admitted=True) for p in call.prepared)
    results = await (wait(work) if wait is not None else work)
    if results is None:
        return None
    meta0 = results[0]["meta_info"]
    return {
        "id": call.rid, "object": "chat.completion", "created": call.created, "model": call.tm.served_model_name,
        "choices": [_choice(call, i, r) for i, r in enumerate(results)],
        "usage": usage(meta0["prompt_tokens"], sum(r["meta_info"]["completion_tokens"] for r in results),
                       meta0["cached_tokens"]),
    }


async def create_chat_completion(tm: TokenizerManager, req: ChatCompletionRequest,
                                 wait: Optional[Wait] = None) -> Response:
    """Serve one /v1/chat/completions request (`wait`: see serving_completions.create_completion)."""
    call = await prepare_chat(tm, req)
    if req.stream:
        return StreamingResponse(sse_stream(chat_chunks(call)), media_type="text/event-stream")
    result = await chat_result(call, wait)
    if result is None:
        return Response(status_code=499)
    return json_response(result)


def _choice(call: ChatCall, i: int, result: dict) -> dict:
    """Choice `i` of a non-streamed response: the message (reasoning split, tool calls parsed), logprobs, finish."""
    meta = result["meta_info"]
    text, reasoning = result["text"], None
    if call.detectors[i] is not None:
        reasoning, text = call.detectors[i].parse_non_stream(text)
    message, finish_reason = message_for(call.plan, text, finish_reason_str(meta["finish_reason"]))
    if call.tm.server_args.reasoning_parser is not None:
        message["reasoning_content"] = reasoning or None
        if call.detectors[i] is not None and not message["content"]:
            message["content"] = None
    logprobs = None
    if call.req.logprobs:
        logprobs = _chat_logprobs(meta.get("output_token_logprobs", []), meta.get("output_top_logprobs", []),
                                  call.top_n)
    return {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
            "matched_stop": (meta["finish_reason"] or {}).get("matched")}


async def chat_chunks(call: ChatCall) -> AsyncIterator[dict]:
    """The ``chat.completion.chunk`` objects of a prepared, streamed call: a role chunk per choice, then each
    choice's deltas (reasoning split and tool calls streamed as they parse), and the usage chunk with
    include_usage. Closing the iterator aborts the requests.

    Raises:
        RequestError: the engine failed a request after the stream started.
    """
    n = len(call.prepared)
    sent_text, content_text, sent_lp, completion_tokens = [0] * n, [""] * n, [0] * n, [0] * n
    prompt_tokens = cached = 0
    tool_streams = [ToolStream(call.plan) if call.plan else None for _ in range(n)]
    for i in range(n):
        yield call.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None}])
    streams = merge_streams([call.tm.generate_request(p, admitted=True) for p in call.prepared])
    async with contextlib.aclosing(streams):
        async for i, r in streams:
            meta = r["meta_info"]
            fr = finish_reason_str(meta["finish_reason"])
            new_text = r["text"][sent_text[i]:]
            sent_text[i] = len(r["text"])
            reasoning_delta, content_delta = "", new_text
            if call.detectors[i] is not None:
                reasoning_delta, content_delta = call.detectors[i].parse_stream_chunk(new_text)
                if fr is not None:  # what the detector still holds back
                    r_end, c_end = call.detectors[i].parse_stream_end()
                    reasoning_delta, content_delta = reasoning_delta + r_end, content_delta + c_end
            content_text[i] += content_delta
            delta = tool_streams[i].feed(content_text[i]) if tool_streams[i] is not None else content_delta
            logprobs = None
            if call.req.logprobs:
                entries, tops = meta.get("output_token_logprobs", []), meta.get("output_top_logprobs", [])
                logprobs = _chat_logprobs(entries[sent_lp[i]:], tops[sent_lp[i]:], call.top_n)
                sent_lp[i] = len(entries)
            prompt_tokens, cached = meta["prompt_tokens"], meta["cached_tokens"]
            completion_tokens[i] = meta["completion_tokens"]
            message = {"reasoning_content": reasoning_delta} if reasoning_delta else {}
            if delta:
                message["content"] = delta
            if fr is not None and tool_streams[i] is not None:
                if message:
                    yield call.chunk([{"index": i, "delta": message, "logprobs": None, "finish_reason": None}])
                message, fr = tool_streams[i].finish(fr)
            if message or fr or (logprobs and logprobs["content"]):
                choice = {"index": i, "delta": message, "logprobs": logprobs, "finish_reason": fr}
                if fr is not None:  # SGLang's streamed choices carry matched_stop too
                    choice["matched_stop"] = (meta["finish_reason"] or {}).get("matched")
                yield call.chunk([choice])
    if call.req.stream_options and call.req.stream_options.include_usage:
        yield call.chunk([], usage=usage(prompt_tokens, sum(completion_tokens), cached))
