"""OpenAI's Responses API routes: ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}`` and
``POST /v1/responses/{id}/cancel`` (the work is in entrypoints/openai/serving_responses.py; the stored responses
live in the app's bounded in-memory `ResponseStore`, openai/response_store.py).

Cancel: this server runs no background responses (``background: true`` answers 400), so every stored response
is a finished synchronous one and cancelling it answers 400 "Cannot cancel a synchronous response." -- what
OpenAI answers for a response created without ``background`` (vLLM and SGLang answer the same); an unknown or
expired id answers 404, as GET and DELETE do.
"""

from __future__ import annotations

from fastapi import Depends, Request
from fastapi.responses import Response, StreamingResponse

from sgl_jax.srt.entrypoints.openai.response_store import ResponseStore
from sgl_jax.srt.entrypoints.openai.responses_protocol import ResponsesRequest
from sgl_jax.srt.entrypoints.openai.serving_responses import (
    prepare_response,
    response_result,
    sse_frames,
    stream_events,
)
from sgl_jax.srt.entrypoints.http_guards import bodyless_endpoint
from sgl_jax.srt.entrypoints.routes.common import json_response
from sgl_jax.srt.entrypoints.routes.common import new_router, tokenizer_manager, until_disconnect
from sgl_jax.srt.errors import RequestError
from sgl_jax.srt.tokenizer.tokenizer_manager import TokenizerManager

router = new_router()


def response_store(request: Request) -> ResponseStore:
    """FastAPI dependency: the app's response store (made on first use, with the documented default bounds)."""
    state = request.app.state
    store = getattr(state, "response_store", None)
    if store is None:
        store = state.response_store = ResponseStore()
    return store


def stored(store: ResponseStore, response_id: str):
    """The stored entry of `response_id`.

    Raises:
        RequestError: 404, none (never stored, deleted, evicted or expired).
    """
    entry = store.get(response_id)
    if entry is None:
        raise RequestError(f"Response with id {response_id!r} not found", status_code=404, param="response_id")
    return entry


@router.post("/v1/responses")
async def create_response(req: ResponsesRequest, request: Request, tm: TokenizerManager = Depends(tokenizer_manager),
                          store: ResponseStore = Depends(response_store)):
    call = await prepare_response(tm, req, store)
    if req.stream:
        return StreamingResponse(sse_frames(stream_events(call)), media_type="text/event-stream")
    result = await response_result(call, lambda coro: until_disconnect(request, coro))
    if result is None:
        return Response(status_code=499)
    return json_response(result)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, store: ResponseStore = Depends(response_store)):
    return json_response(stored(store, response_id).response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, store: ResponseStore = Depends(response_store)):
    stored(store, response_id)
    store.delete(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


@router.post("/v1/responses/{response_id}/cancel")
@bodyless_endpoint
async def cancel_response(response_id: str, store: ResponseStore = Depends(response_store)):
    stored(store, response_id)
    raise RequestError("Cannot cancel a synchronous response.", param="response_id")
