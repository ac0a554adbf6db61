"""/v1/rerank (also /v2/rerank and /rerank): Cohere's and Jina's rerank API, as SGLang serves it.

Request: ``{model, query, documents: [str | {text}], top_n?, return_documents? (default true), instruct?,
max_tokens_per_doc?}``; unknown fields (Cohere's ``rank_fields``, ``priority``, ...) are ignored, as
OpenAI-compatible servers do. Response: ``{id, model, results: [{index, relevance_score, score, document?:
{text}}], usage: {prompt_tokens, total_tokens}, meta}``, best first: Cohere v1 / v2 and Jina read ``results``, SGLang's
clients ``score``. The scores come from the server's reranker (tokenizer/rerank.py).
"""

from __future__ import annotations

import uuid
from typing import Any, Dict, List, Optional, Union

from fastapi import Depends, Request
from fastapi.responses import Response
from pydantic import Field

from sgl_jax.srt.entrypoints.field_types import LenientModel, PosInt32
from sgl_jax.srt.entrypoints.routes.common import json_response
from sgl_jax.srt.entrypoints.routes.common import new_router, tokenizer_manager, until_disconnect
from sgl_jax.srt.tokenizer.rerank import document_texts, ranked_results
from sgl_jax.srt.tokenizer.tokenizer_manager import TokenizerManager

router = new_router()


class RerankRequest(LenientModel):
    """The rerank body (Cohere v1 / v2, Jina, SGLang's V1RerankReqInput)."""

    model: Optional[str] = None
    query: str = Field(min_length=1)
    documents: List[Union[str, Dict[str, Any]]] = Field(min_length=1)
    top_n: Optional[PosInt32] = None
    return_documents: Optional[bool] = True
    instruct: Optional[str] = Field(None, description="the reranker's instruction (Qwen3-Reranker's Instruct)")
    max_tokens_per_doc: Optional[PosInt32] = Field(None, description="documents are cut to this many tokens")


@router.post("/v1/rerank")
@router.post("/v2/rerank")
@router.post("/rerank")
async def rerank(req: RerankRequest, request: Request, tm: TokenizerManager = Depends(tokenizer_manager)):
    docs = document_texts(req.documents)
    result = await until_disconnect(request, tm.retrieval.rerank(req.query, docs, req.instruct,
                                                                req.max_tokens_per_doc))
    if result is None:
        return Response(status_code=499)
    n = result["prompt_tokens"]
    results: List[dict] = ranked_results(result["scores"], docs, req.top_n, req.return_documents is not False)
    return json_response({"id": f"rerank-{uuid.uuid4().hex}", "model": tm.served_model_name, "results": results,
                          "usage": {"prompt_tokens": n, "total_tokens": n},
                          "meta": {"billed_units": {"search_units": 1}, "tokens": {"input_tokens": n}}})
