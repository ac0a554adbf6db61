"""What every route group shares: orjson request parsing, the error bodies, the app-state dependencies and
client-disconnect handling; and the HTTP helpers every API module uses (JSON responses, SSE events, merging and
gathering the streams of a request's prompts)."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, List, Optional, Tuple

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from sgl_jax.srt.entrypoints.error_bodies import error_body


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


# ---- the HTTP helpers every route group and API module uses
def json_response(obj, status_code: int = 200) -> Response:
    """`obj` serialized by orjson as an application/json response with `status_code`."""
    return Response(orjson.dumps(obj), status_code=status_code, media_type="application/json")


def sse(obj) -> bytes:
    """One server-sent event carrying `obj` as JSON (``data: ...`` and a blank line)."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"  # OpenAI's end of stream


async def merge_streams(gens: List[AsyncIterator[dict]]) -> AsyncIterator[Tuple[int, dict]]:
    """Interleave several async generators, yielding (index, item) as items arrive.

    Closing the merged iterator (the client went away) cancels the tasks that drive the sources; each
    source then ends inside its own task (so its cleanup -- aborting its request -- runs there). Nothing is
    awaited during that cleanup: the response's cancel scope would cancel the wait, and `aclose` on a
    generator another task is running raises, which is what logged a traceback per disconnect.
    """
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, gen):
        try:
            async for item in gen:
                await queue.put((i, item))
            await queue.put((i, done))
        except BaseException as e:  # forwarded to the consumer
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    remaining = len(gens)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def gather_or_cancel(coros) -> list:
    """asyncio.gather that cancels the remaining work when one fails (so their requests are aborted)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
