"""What every route group shares: orjson request parsing, the error bodies, the app-state dependencies and
client-disconnect handling."""

from __future__ import annotations

import asyncio
from typing import Optional

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from sgl_jax.srt.entrypoints.error_bodies import error_body
from sgl_jax.srt.entrypoints.openai.utils import json_response


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


def error_for(request: Request, message: str, status_code: int, param: Optional[str] = None) -> Response:
    """The error response in the shape of the request path's API (error_bodies.error_body)."""
    return json_response(error_body(request.url.path, message, status_code, param), status_code)


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
