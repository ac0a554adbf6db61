"""POST /v1/completions (OpenAI legacy completions), streaming and not."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Awaitable, Callable, List, Optional, Union

from fastapi.responses import Response, StreamingResponse

from sgl_jax.srt.entrypoints.openai.protocol import CompletionRequest
from sgl_jax.srt.entrypoints.openai.utils import (
    SSE_DONE,
    check_top_logprobs,
    finish_reason_str,
    json_response,
    merge_streams,
    sampling_params_from,
    sse,
    usage,
)
from sgl_jax.srt.managers.tokenizer_manager import GenerateReqInput, RequestError, TokenizerManager

Wait = Callable[[Awaitable], Awaitable[Optional[object]]]  # awaits work, None when the client went away


def _prompts(prompt) -> List[Union[str, List[int]]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestError("prompt must not be empty")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def _legacy_logprobs(meta: dict, echo: bool, top_n: int, offset0: int) -> dict:
    """OpenAI's completions logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""
    entries = (meta.get("input_token_logprobs") or [] if echo else []) + meta.get("output_token_logprobs", [])
    tops = (meta.get("input_top_logprobs") or [] if echo else []) + meta.get("output_top_logprobs", [])
    tokens = [e[2] for e in entries]
    offsets, pos = [], offset0
    for t in tokens:
        offsets.append(pos)
        pos += len(t or "")
    return {
        "tokens": tokens,
        "token_logprobs": [e[0] for e in entries],
        "top_logprobs": [({e[2]: e[0] for e in top} if top else None) for top in tops] if top_n > 0 else None,
        "text_offset": offsets,
    }


def _objs(req: CompletionRequest, prompts, top_logprobs_cap: int) -> List[GenerateReqInput]:
    if req.suffix:
        raise RequestError("suffix is not supported")
    check_top_logprobs("logprobs", req.logprobs, top_logprobs_cap)
    objs = []
    for p in prompts:
        for k in range(req.n):
            objs.append(GenerateReqInput(
                text=p if isinstance(p, str) else None,
                input_ids=p if not isinstance(p, str) else None,
                sampling_params=sampling_params_from(req, req.max_tokens, seed_offset=k),
                return_logprob=req.logprobs is not None,
                logprob_start_len=0 if (req.echo and req.logprobs is not None) else -1,
                top_logprobs_num=req.logprobs or 0,
                return_text_in_logprobs=True,
                stream=req.stream,
                rid=f"{req.rid}-{len(objs)}" if req.rid else None,
            ))
    return objs


async def gather_or_cancel(coros) -> list:
    """asyncio.gather that cancels the remaining work when one fails (so their requests are aborted)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def create_completion(tm: TokenizerManager, req: CompletionRequest, wait: Optional[Wait] = None) -> Response:
    """Serve one /v1/completions request; `wait` awaits the non-streaming work (the HTTP server passes
    one that aborts it when the client disconnects; a None result means it did)."""
    prompts = _prompts(req.prompt)
    prepared = [await tm.prepare_async(o) for o in _objs(req, prompts, tm.server_args.max_top_logprobs_num)]
    prompt_texts = [p if isinstance(p, str) else tm.tokenizer.decode(p) for p in prompts]
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = tm.served_model_name
    top_n = req.logprobs or 0

    def prompt_of(i: int) -> str:
        return prompt_texts[i // req.n]

    if not req.stream:
        work = gather_or_cancel(tm.generate(p) for p in prepared)
        results = await (wait(work) if wait is not None else work)
        if results is None:
            return Response(status_code=499)
        choices, completion_tokens = [], 0
        for i, r in enumerate(results):
            meta = r["meta_info"]
            prefix = prompt_of(i) if req.echo else ""
            choices.append({
                "index": i,
                "text": prefix + r["text"],
                "logprobs": _legacy_logprobs(meta, req.echo, top_n, 0 if req.echo else len(prefix))
                if req.logprobs is not None else None,
                "finish_reason": finish_reason_str(meta["finish_reason"]),
                "matched_stop": (meta["finish_reason"] or {}).get("matched"),
            })
            completion_tokens += meta["completion_tokens"]
        prompt_tokens = sum(results[i * req.n]["meta_info"]["prompt_tokens"] for i in range(len(prompts)))
        cached = sum(results[i * req.n]["meta_info"]["cached_tokens"] for i in range(len(prompts)))
        return json_response({"id": rid, "object": "text_completion", "created": created, "model": model,
                              "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached)})

    async def stream():
        sent_text = [0] * len(prepared)
        sent_lp = [0] * len(prepared)
        started = [False] * len(prepared)
        prompt_tokens: dict = {}
        completion_tokens = [0] * len(prepared)
        cached: dict = {}
        try:
            async for i, r in merge_streams([tm.generate_request(p) for p in prepared]):
                meta = r["meta_info"]
                delta = r["text"][sent_text[i]:]
                if req.echo and not started[i]:
                    delta = prompt_of(i) + delta
                started[i] = True
                sent_text[i] = len(r["text"])
                logprobs = None
                if req.logprobs is not None:
                    full = _legacy_logprobs(meta, req.echo, top_n, 0)
                    logprobs = {k: (v[sent_lp[i]:] if v is not None else None) for k, v in full.items()}
                    sent_lp[i] = len(full["tokens"])
                prompt_tokens[i // req.n] = meta["prompt_tokens"]
                cached[i // req.n] = meta["cached_tokens"]
                completion_tokens[i] = meta["completion_tokens"]
                choice = {"index": i, "text": delta, "logprobs": logprobs,
                          "finish_reason": finish_reason_str(meta["finish_reason"])}
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": [choice]})
            if req.stream_options and req.stream_options.include_usage:
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": [], "usage": usage(sum(prompt_tokens.values()), sum(completion_tokens),
                                                         sum(cached.values()))})
        except RequestError as e:
            yield sse({"error": {"message": e.message, "code": e.status_code}})
        yield SSE_DONE

    return StreamingResponse(stream(), media_type="text/event-stream")
