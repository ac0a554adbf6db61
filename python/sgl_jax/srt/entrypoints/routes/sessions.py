"""SGLang's session routes: /open_session and /close_session (GET or POST)."""

from __future__ import annotations

from fastapi import Depends
from fastapi.responses import Response

from sgl_jax.srt.entrypoints.native_protocol import CloseSessionRequest, OpenSessionRequest
from sgl_jax.srt.entrypoints.routes.common import json_response
from sgl_jax.srt.entrypoints.routes.common import new_router, tokenizer_manager
from sgl_jax.srt.tokenizer.tokenizer_manager import TokenizerManager

router = new_router()


@router.api_route("/open_session", methods=["GET", "POST"])
async def open_session(req: OpenSessionRequest, tm: TokenizerManager = Depends(tokenizer_manager)):
    """SGLang's /open_session: the body is the new session's id as a JSON string. 400: the id is taken,
    streaming without --enable-streaming-session, or no room for another streaming session."""
    return json_response(await tm.open_session(req.to_input()))


@router.api_route("/close_session", methods=["GET", "POST"])
async def close_session(req: CloseSessionRequest, tm: TokenizerManager = Depends(tokenizer_manager)):
    """SGLang's /close_session: 200 with an empty body; 404 when no open session has the id (upstream
    answers 200 either way)."""
    await tm.close_session(req.session_id)
    return Response(status_code=200)
