"""Anthropic's routes: POST /v1/messages and /v1/messages/count_tokens (the work is in entrypoints/anthropic/).

Anthropic's clients send ``x-api-key`` (accepted as the API key by http_guards), ``anthropic-version`` (any
value accepted) and ``anthropic-beta`` (ignored). Errors have Anthropic's body (error_bodies.py, by path).
"""

from __future__ import annotations

from typing import Optional

from fastapi import Depends, Header, Request

from sgl_jax.srt.entrypoints.anthropic.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
from sgl_jax.srt.entrypoints.anthropic.serving import count_tokens, create_message
from sgl_jax.srt.entrypoints.routes.common import json_response
from sgl_jax.srt.entrypoints.routes.common import new_router, tokenizer_manager, until_disconnect
from sgl_jax.srt.tokenizer.tokenizer_manager import TokenizerManager

router = new_router()

VERSION_HEADER = Header(None, description="accepted at any value (the server speaks one version)")
BETA_HEADER = Header(None, description="accepted and ignored")


@router.post("/v1/messages")
async def messages(req: AnthropicMessagesRequest, request: Request, tm: TokenizerManager = Depends(tokenizer_manager),
                   anthropic_version: Optional[str] = VERSION_HEADER, anthropic_beta: Optional[str] = BETA_HEADER):
    return await create_message(tm, req, lambda coro: until_disconnect(request, coro))


@router.post("/v1/messages/count_tokens")
async def messages_count_tokens(req: AnthropicCountTokensRequest, tm: TokenizerManager = Depends(tokenizer_manager),
                                anthropic_version: Optional[str] = VERSION_HEADER,
                                anthropic_beta: Optional[str] = BETA_HEADER):
    return json_response(await count_tokens(tm, req))
