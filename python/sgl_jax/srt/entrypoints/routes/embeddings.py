"""/v1/embeddings: OpenAI's embeddings API, on a server started with --is-embedding (tokenizer/embedding.py).

Request: ``{model, input: str | [str] | [int] | [[int]], encoding_format: "float" | "base64", dimensions?, user?}``
(``user`` and unknown fields ignored, as OpenAI-compatible servers do). Response: ``{object: "list", data:
[{object: "embedding", index, embedding}], model, usage: {prompt_tokens, total_tokens}}``.
"""

from __future__ import annotations

from typing import List, Literal, Optional, Union

from fastapi import Depends, Request
from fastapi.responses import Response
from pydantic import Field

from sgl_jax.srt.entrypoints.field_types import LenientModel, PosInt32, TokenId
from sgl_jax.srt.entrypoints.routes.common import json_response
from sgl_jax.srt.entrypoints.routes.common import new_router, tokenizer_manager, until_disconnect
from sgl_jax.srt.tokenizer.embedding import encode_vector
from sgl_jax.srt.tokenizer.tokenizer_manager import TokenizerManager

router = new_router()


class EmbeddingRequest(LenientModel):
    """OpenAI's embeddings body."""

    model: Optional[str] = None
    input: Union[str, List[str], List[TokenId], List[List[TokenId]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[PosInt32] = Field(None, description="the first n values, renormalized (Matryoshka)")
    user: Optional[str] = None


@router.post("/v1/embeddings")
async def embeddings(req: EmbeddingRequest, request: Request, tm: TokenizerManager = Depends(tokenizer_manager)):
    result = await until_disconnect(request, tm.retrieval.embed(req.input, req.dimensions))
    if result is None:
        return Response(status_code=499)
    data = [{"object": "embedding", "index": i, "embedding": encode_vector(v, req.encoding_format)}
            for i, v in enumerate(result["embeddings"])]
    n = result["prompt_tokens"]
    return json_response({"object": "list", "data": data, "model": tm.served_model_name,
                          "usage": {"prompt_tokens": n, "total_tokens": n}})
