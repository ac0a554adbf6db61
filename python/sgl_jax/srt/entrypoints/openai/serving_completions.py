"""POST /v1/completions (OpenAI legacy completions), streaming and not; best_of ranks candidates by mean logprob."""

from __future__ import annotations

import time
import uuid
from typing import Awaitable, Callable, List, Optional, Union

from fastapi.responses import Response, StreamingResponse

from sgl_jax.srt.entrypoints.openai.protocol import CompletionRequest
from sgl_jax.srt.entrypoints.openai.utils import (
    check_n,
    check_top_logprobs,
    error_event,
    finish_reason_str,
    sampling_params_from,
    lora_of,
    session_params_of,
    usage,
)
from sgl_jax.srt.entrypoints.routes.common import SSE_DONE, gather_or_cancel, json_response, merge_stream_batches, sse
from sgl_jax.srt.tokenizer.tokenizer_manager import GenerateReqInput, RequestError, TokenizerManager

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


def candidates_per_prompt(req: CompletionRequest, cap: int = 128) -> int:
    """How many completions are generated per prompt: OpenAI's ``best_of`` when given (at least ``n``; more than n
    only without streaming, as OpenAI), else ``n``.

    Raises:
        RequestError: best_of < n, best_of > n with stream, or n / best_of above `cap` (--max-n).
    """
    best_of = req.best_of if req.best_of is not None else req.n
    check_n("n", req.n, cap)
    check_n("best_of", req.best_of, cap)
    if best_of < req.n:
        raise RequestError(f"best_of ({best_of}) must be at least n ({req.n})")
    if best_of > req.n and req.stream:
        raise RequestError("best_of greater than n cannot be used with stream")
    return best_of


def mean_logprob(result: dict) -> float:
    """The mean log-probability of a completion's tokens (OpenAI's best_of ranking; 0 for no tokens)."""
    lps = [e[0] for e in result["meta_info"].get("output_token_logprobs") or [] if e[0] is not None]
    return sum(lps) / len(lps) if lps else 0.0


def best_completions(results: list, n: int, per_prompt: int) -> list:
    """Of each prompt's `per_prompt` candidates (consecutive in `results`), the `n` with the highest
    `mean_logprob`, best first (all of them, in order, when per_prompt == n)."""
    if per_prompt == n:
        return results
    chosen = []
    for i in range(0, len(results), per_prompt):
        chosen += sorted(results[i:i + per_prompt], key=mean_logprob, reverse=True)[:n]
    return chosen


def _objs(req: CompletionRequest, prompts, top_logprobs_cap: int, max_n: int = 128,
          lora: Optional[str] = None) -> List[GenerateReqInput]:
    check_top_logprobs("logprobs", req.logprobs, top_logprobs_cap)
    per_prompt = candidates_per_prompt(req, max_n)
    objs = []
    for p in prompts:
        for k in range(per_prompt):
            objs.append(GenerateReqInput(
                text=p if isinstance(p, str) else None,
                input_ids=p if not isinstance(p, str) else None,
                sampling_params=sampling_params_from(req, req.max_tokens, seed_offset=k),
                return_logprob=req.logprobs is not None or per_prompt > req.n,  # best_of ranks by logprob
                logprob_start_len=0 if (req.echo and req.logprobs is not None) else -1,
                top_logprobs_num=req.logprobs or 0,
                return_text_in_logprobs=True,
                session_params=session_params_of(req, len(prompts) * per_prompt),
                lora_path=lora,
                stream=req.stream,
                rid=f"{req.rid}-{len(objs)}" if req.rid else None,
            ))
    return objs


async def create_completion(tm: TokenizerManager, req: CompletionRequest, wait: Optional[Wait] = None) -> Response:
    """Serve one /v1/completions request; `wait` awaits the non-streaming work (the HTTP server passes
    one that aborts it when the client disconnects; a None result means it did)."""
    prompts = _prompts(req.prompt)
    objs = _objs(req, prompts, tm.server_args.max_top_logprobs_num, tm.server_args.max_n, lora_of(tm, req))
    prepared = await tm.prepare_fanout(objs)  # the whole fan-out (prompts x best_of) is admitted or refused
    prompt_texts = [p if isinstance(p, str) else tm.tokenizer.decode(p) for p in prompts]
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = tm.served_model_name
    top_n = req.logprobs or 0

    def prompt_of(i: int) -> str:
        return prompt_texts[i // req.n]

    if not req.stream:
        work = gather_or_cancel(tm.generate(p, admitted=True) for p in prepared)
        results = await (wait(work) if wait is not None else work)
        if results is None:
            return Response(status_code=499)
        per_prompt = len(results) // len(prompts)
        completion_tokens = sum(r["meta_info"]["completion_tokens"] for r in results)  # every candidate
        choices = []
        for i, r in enumerate(best_completions(results, req.n, per_prompt)):
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
        prompt_tokens = sum(results[i * per_prompt]["meta_info"]["prompt_tokens"] for i in range(len(prompts)))
        cached = sum(results[i * per_prompt]["meta_info"]["cached_tokens"] for i in range(len(prompts)))
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
            async for pairs in merge_stream_batches([tm.generate_request(p, admitted=True) for p in prepared]):
                chunks = []  # (the events that arrived together go out as one write)
                for i, r in pairs:
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
                    chunks.append(sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                       "choices": [choice]}))
                yield b"".join(chunks)
            if req.stream_options and req.stream_options.include_usage:
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": [], "usage": usage(sum(prompt_tokens.values()), sum(completion_tokens),
                                                         sum(cached.values()))})
        except RequestError as e:
            yield error_event(e)
        yield SSE_DONE

    return StreamingResponse(stream(), media_type="text/event-stream")
