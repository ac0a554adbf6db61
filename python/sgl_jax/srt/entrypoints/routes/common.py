"""What every route group shares: orjson request parsing, the error bodies, the app-state dependencies and
client-disconnect handling; and the HTTP helpers every API module uses (JSON responses, SSE events, merging and
gathering the streams of a request's prompts)."""

from __future__ import annotations

import asyncio
import contextlib
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


async def merge_stream_batches(gens: List[AsyncIterator[dict]]) -> AsyncIterator[List[Tuple[int, dict]]]:
    """Interleave several async generators, yielding what has arrived since the last yield: a list of one or more
    (index, item) pairs in arrival order. A consumer that falls behind (its client reads slowly, or the event loop
    is busy) so gets one list for many events and can write them as one chunk, not one write per event (a batch
    of 16 streams sends 16 events a decode step).

    One generator is iterated in the caller's task (one list per item; closed with the iterator), which saves a
    task switch and a queue round trip per event; its updates that arrive while the consumer is busy are merged
    by the generator itself (TokenizerManager.generate_request: one response for every output pending). Several
    run in tasks of their own. Closing the merged iterator (the client went away) then cancels those tasks; each
    source ends inside its own task (so its cleanup -- aborting its request -- runs there). Nothing is awaited
    during that cleanup: the response's cancel scope would cancel the wait, and `aclose` on a generator another
    task is running raises, which is what logged a traceback per disconnect. An exception a source raises is
    raised here once the pairs that arrived before it are yielded.
    """
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0]) as gen:
            async for item in gen:
                yield [(0, item)]
        return
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
            arrived = [await queue.get()]
            while not queue.empty():
                arrived.append(queue.get_nowait())
            out = []
            for i, item in arrived:
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    if out:
                        yield out
                    raise item
                else:
                    out.append((i, item))
            if out:
                yield out
    finally:
        for t in tasks:
            t.cancel()


async def merge_streams(gens: List[AsyncIterator[dict]]) -> AsyncIterator[Tuple[int, dict]]:
    """`merge_stream_batches` one (index, item) pair at a time, as items arrive."""
    async with contextlib.aclosing(merge_stream_batches(gens)) as batches:
        async for batch in batches:
            for pair in batch:
                yield pair


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
