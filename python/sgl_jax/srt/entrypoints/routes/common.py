"""What every route group shares: orjson request parsing, the error bodies, the app-state dependencies and
client-disconnect handling."""

from __future__ import annotations

import asyncio
from typing import Optional

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from sgl_jax.srt.entrypoints.openai.utils import json_response, openai_error


class ORJSONRequest(Request):
    """A Request whose JSON body is parsed by orjson: NaN, Infinity and lone UTF-16 surrogates are
    refused as invalid JSON (400), so no such value ever reaches a field or the tokenizer."""

    async def json(self):
        if not hasattr(self, "_json"):
            self._json = orjson.loads(await self.body())
        return self._json


class ORJSONRoute(APIRoute):
    """FastAPI's documented way to swap the Request class of a route."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route_handler(request: Request):
            return await handler(ORJSONRequest(request.scope, request.receive))

        return route_handler


def new_router() -> APIRouter:
    """An APIRouter whose routes parse bodies with orjson (`ORJSONRoute`)."""
    return APIRouter(route_class=ORJSONRoute)


def tokenizer_manager(request: Request):
    """FastAPI dependency: the app's TokenizerManager (set by `http_server.build_app`)."""
    return request.app.state.tokenizer_manager


def native_error(message: str, status_code: int = 400) -> Response:
    """SGLang's native error body: {"error": {"message", "code"}}."""
    return json_response({"error": {"message": message, "code": status_code}}, status_code)


def error_for(request: Request, message: str, status_code: int) -> Response:
    """OpenAI's error object on /v1/*, the native one elsewhere."""
    if request.url.path.startswith("/v1/"):
        return openai_error(message, status_code)
    return native_error(message, status_code)


async def until_disconnect(request: Request, coro, poll_s: float = 0.25) -> Optional[object]:
    """Await `coro`, cancelling it (which aborts its work in the scheduler) if the client disconnects
    first; returns None then (SGLang checks ``request.is_disconnected()`` the same way)."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():  # (the aborted request logs one line with its rid)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return None
    finally:
        if not task.done():
            task.cancel()
