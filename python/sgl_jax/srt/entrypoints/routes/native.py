"""SGLang's native routes: / (a short JSON: version and links), /health, /health_generate, /get_model_info,
/tokenize and /detokenize (also under /v1/), /generate."""

from __future__ import annotations

import asyncio
from typing import List, Optional, Union

from fastapi import Depends, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import Field

from sgl_jax.srt.entrypoints.field_types import LenientModel, TokenId
from sgl_jax.srt.entrypoints.native_protocol import GenerateRequest
from sgl_jax.srt.entrypoints.openai.utils import check_n
from sgl_jax.srt.entrypoints.routes.common import SSE_DONE, gather_or_cancel, json_response, merge_stream_batches, sse
from sgl_jax.srt.entrypoints.routes.common import new_router, tokenizer_manager, until_disconnect
from sgl_jax.srt.tokenizer.tokenizer_manager import GenerateReqInput, RequestError, TokenizerManager
from sgl_jax.version import __version__

HEALTH_GENERATE_TIMEOUT_S = 30.0

router = new_router()


class TokenizeRequest(LenientModel):
    """The /tokenize (and /v1/tokenize) body, as SGLang's ``TokenizeRequest``: one text or a list of texts.
    Unknown fields are ignored, as upstream."""

    prompt: Union[str, List[str]]
    add_special_tokens: bool = Field(True, description="add the tokenizer's special tokens (e.g. BOS)")
    model: Optional[str] = Field(None, description="ignored (one model is served)")


class DetokenizeRequest(LenientModel):
    """The /detokenize (and /v1/detokenize) body, as SGLang's ``DetokenizeRequest``: one token-id list or a
    list of them. Unknown fields are ignored, as upstream."""

    tokens: Union[List[TokenId], List[List[TokenId]]]
    skip_special_tokens: bool = True
    model: Optional[str] = Field(None, description="ignored (one model is served)")


def tokenize_texts(tm: TokenizerManager, texts: List[str], add_special_tokens: bool,
                   batch: bool = True) -> List[List[int]]:
    """Token ids of each text, the whole text (no truncation; SGLang's /tokenize). Runs the tokenizer on the
    calling thread: call it through ``tm.run_blocking``.

    A text so long that it cannot fit the context whatever its tokenization (``tm.max_chars_per_token``,
    see TokenizerManager.encode_text) is refused without tokenizing it, so one request cannot hold the
    tokenizer thread for seconds.

    Args:
        batch: the texts came as a list (errors name the index: ``prompt[i]``).
    Raises:
        RequestError: 400 naming the text and the context length.
    """
    cap = tm.max_chars_per_token
    for i, text in enumerate(texts):
        if cap and len(text) > tm.context_len * cap:
            where = f"prompt[{i}]" if batch else "prompt"
            raise RequestError(f"{where} ({len(text)} characters, at least {-(-len(text) // cap)} tokens) is "
                               f"longer than the model's context length ({tm.context_len} tokens)")
    if not texts:
        return []
    return [list(ids) for ids in tm.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]


def detokenize_ids(tm: TokenizerManager, seqs: List[List[int]], skip_special_tokens: bool,
                   batch: bool = True) -> List[str]:
    """The text of each token-id list (``tokenizer.decode``). Runs the tokenizer on the calling thread: call
    it through ``tm.run_blocking``.

    Args:
        batch: the lists came as a list of lists (errors name the index: ``tokens[i]``).
    Raises:
        RequestError: 400 naming the ids outside the vocabulary [0, vocab_size) (the first five).
    """
    for i, ids in enumerate(seqs):
        bad = [t for t in ids if not 0 <= t < tm.vocab_size]
        if bad:
            where = f"tokens[{i}]" if batch else "tokens"
            raise RequestError(f"{where} contains ids outside the vocabulary [0, {tm.vocab_size}): {bad[:5]}")
    return [tm.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) for ids in seqs]


@router.get("/")
async def root(tm: TokenizerManager = Depends(tokenizer_manager)):
    """A short description of the server, for people and uptime probes: name, version, the served model and
    where the APIs and their documentation are."""
    return json_response({"name": "sgl-jax", "version": __version__, "model": tm.served_model_name,
                          "links": {"health": "/health", "models": "/v1/models", "openapi": "/openapi.json",
                                    "docs": "/docs", "server_info": "/get_server_info"}})


@router.get("/health")
async def health(tm: TokenizerManager = Depends(tokenizer_manager)):
    if tm.dead_reason is not None:
        return Response(f"unhealthy: {tm.dead_reason}", status_code=503)
    if tm.draining is not None:  # (so that load balancers stop sending work here)
        return Response(f"shutting down: {tm.draining}", status_code=503)
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(tm: TokenizerManager = Depends(tokenizer_manager)):
    obj = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0})
    try:  # (an embedding server computes a one-token input instead: it generates nothing)
        probe = tm.retrieval.probe() if tm.retrieval.is_embedding else tm.generate(obj)
        await asyncio.wait_for(probe, HEALTH_GENERATE_TIMEOUT_S)
    except (RequestError, asyncio.TimeoutError) as e:
        return Response(f"unhealthy: {e!r}", status_code=503)
    return Response(status_code=200)


@router.get("/get_model_info")
@router.get("/model_info")
async def get_model_info(tm: TokenizerManager = Depends(tokenizer_manager)):
    """SGLang's /get_model_info (newer releases: /model_info, with the served weights' ``weight_version``)."""
    return json_response({"model_path": tm.served_model_name, "tokenizer_path": tm.served_model_name,
                          "served_model_name": tm.served_model_name,
                          "is_generation": not tm.retrieval.is_embedding,
                          "context_length": tm.context_len, "weight_version": tm.weight_version})


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(req: TokenizeRequest, tm: TokenizerManager = Depends(tokenizer_manager)):
    """SGLang's /tokenize: {"tokens": ids or [ids per prompt], "count": n or [n per prompt],
    "max_model_len": context length in tokens}. Tokenizes on the TokenizerManager's thread."""
    one = isinstance(req.prompt, str)
    texts = [req.prompt] if one else req.prompt
    ids = await tm.run_blocking(tokenize_texts, tm, texts, req.add_special_tokens, not one)
    return json_response({"tokens": ids[0] if one else ids,
                          "count": len(ids[0]) if one else [len(x) for x in ids],
                          "max_model_len": tm.context_len})


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize(req: DetokenizeRequest, tm: TokenizerManager = Depends(tokenizer_manager)):
    """SGLang's /detokenize: {"text": str} for one id list (``[]`` gives ""), {"text": [str, ...]} for a
    list of lists. Ids outside the vocabulary answer 400."""
    one = not req.tokens or isinstance(req.tokens[0], int)
    seqs = [req.tokens] if one else req.tokens
    texts = await tm.run_blocking(detokenize_ids, tm, seqs, req.skip_special_tokens, not one)
    return json_response({"text": texts[0] if one else texts})


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(req: GenerateRequest, request: Request, tm: TokenizerManager = Depends(tokenizer_manager)):
    """SGLang's /generate: one prompt or a batch, each with n samples; streamed as SSE with ``stream``."""
    check_n("sampling_params.n", req.samples_per_prompt(), tm.server_args.max_n)
    objs = req.to_inputs()
    batch = isinstance(objs, list)
    items = objs if batch else [objs]
    for o in items:  # refuse a taken rid before any prompt of the batch starts
        if o.rid is not None:
            tm.reserve_rid(o.rid)
    prepared = await tm.prepare_fanout(items)  # the whole fan-out (batch x n) is admitted or refused
    if not items[0].stream:
        results = await until_disconnect(request, gather_or_cancel(tm.generate(p, admitted=True) for p in prepared))
        if results is None:
            return Response(status_code=499)
        return json_response(results if batch else results[0])

    async def stream():
        try:
            async for pairs in merge_stream_batches([tm.generate_request(p, admitted=True) for p in prepared]):
                yield b"".join(sse({**r, "index": i} if batch else r) for i, r in pairs)  # (one write for them all)
        except RequestError as e:
            yield sse({"error": {"message": e.message, "code": e.status_code}})
        yield SSE_DONE

    return StreamingResponse(stream(), media_type="text/event-stream")
