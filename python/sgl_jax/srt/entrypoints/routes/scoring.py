"""SGLang's /v1/score (reranking: label-token probabilities after query + item, for many items)."""

from __future__ import annotations

from fastapi import Depends, Request
from fastapi.responses import Response

from sgl_jax.srt.entrypoints.native_protocol import ScoreRequest
from sgl_jax.srt.entrypoints.routes.common import json_response
from sgl_jax.srt.entrypoints.routes.common import new_router, tokenizer_manager, until_disconnect
from sgl_jax.srt.tokenizer.tokenizer_manager import TokenizerManager

router = new_router()


@router.post("/v1/score")
async def score(req: ScoreRequest, request: Request, tm: TokenizerManager = Depends(tokenizer_manager)):
    result = await until_disconnect(request, tm.score_request(req.to_input()))
    if result is None:
        return Response(status_code=499)
    n = result["prompt_tokens"]
    return json_response({"object": "scoring", "model": tm.served_model_name, "scores": result["scores"],
                          "usage": {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n}})
