"""The HTTP server: FastAPI routes over a TokenizerManager, SGLang's native API plus OpenAI's.

Native: /generate, /health, /health_generate, /get_model_info, /get_server_info, /flush_cache,
/abort_request. OpenAI: /v1/models, /v1/completions, /v1/chat/completions. Scoring: /v1/score.
Errors: malformed or invalid requests get 400 (never FastAPI's 422) with a message -- OpenAI's error
object on /v1/*, ``{"error": {"message": ...}}`` elsewhere; 413 when a request cannot fit; 503 while
the engine is down. If the scheduler or detokenizer process dies, the server logs it, fails /health,
and exits with a non-zero status.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse

from sgl_jax import __version__
from sgl_jax.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from sgl_jax.srt.entrypoints.openai.serving_chat import create_chat_completion
from sgl_jax.srt.entrypoints.openai.serving_completions import create_completion, gather_or_cancel
from sgl_jax.srt.entrypoints.openai.utils import SSE_DONE, json_response, merge_streams, openai_error, sse
from sgl_jax.srt.managers.scoring import ScoreReqInput
from sgl_jax.srt.managers.tokenizer_manager import GenerateReqInput, RequestError, TokenizerManager, split_batch
from sgl_jax.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 30.0


def _native_error(message: str, status_code: int = 400) -> Response:
    return json_response({"error": {"message": message, "code": status_code}}, status_code)


def _error_for(request: Request, message: str, status_code: int) -> Response:
    if request.url.path.startswith("/v1/"):
        return openai_error(message, status_code)
    return _native_error(message, status_code)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "Invalid request: " + "; ".join(parts)


def build_app(tm: TokenizerManager, server_args: ServerArgs, scheduler_info: dict) -> FastAPI:
    """The FastAPI application serving `tm`."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        tm.start()
        yield
        await tm.close()

    app = FastAPI(lifespan=lifespan, title="sgl-jax", version=__version__)
    app.state.tokenizer_manager = tm

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return _error_for(request, _validation_message(exc), 400)

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, exc: RequestError):
        return _error_for(request, exc.message, exc.status_code)

    # ---------------------------------------------------------------- health and info
    @app.get("/health")
    async def health():
        if tm.dead_reason is not None:
            return Response(f"unhealthy: {tm.dead_reason}", status_code=503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        obj = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0})
        try:
            await asyncio.wait_for(tm.generate(obj), HEALTH_GENERATE_TIMEOUT_S)
        except (RequestError, asyncio.TimeoutError) as e:
            return Response(f"unhealthy: {e!r}", status_code=503)
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info():
        return json_response({"model_path": tm.model_path, "tokenizer_path": tm.tokenizer_path,
                              "served_model_name": tm.served_model_name, "is_generation": True,
                              "context_length": tm.context_len})

    @app.get("/get_server_info")
    async def get_server_info():
        state = await tm.get_internal_state()
        return json_response({**dataclasses.asdict(server_args), "scheduler_info": scheduler_info,
                              "internal_states": [state], "version": __version__})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        out = await tm.flush_cache()
        return Response(out.message, status_code=200 if out.success else 400)

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await _json_body(request)
        if body.get("abort_all"):
            for rid in list(tm.rid_to_state):
                tm.abort_request(rid)
        elif isinstance(body.get("rid"), str):
            tm.abort_request(body["rid"])
        else:
            raise RequestError("'rid' (string) or 'abort_all': true is required")
        return Response(status_code=200)

    # ---------------------------------------------------------------- native generation
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        body = await _json_body(request)
        objs = split_batch(body)
        batch = isinstance(objs, list)
        items = objs if batch else [objs]
        prepared = [tm.prepare(o) for o in items]
        if not items[0].stream:
            results = await gather_or_cancel(tm.generate(p) for p in prepared)
            return json_response(results if batch else results[0])

        async def stream():
            try:
                async for i, r in merge_streams([tm.generate_request(p) for p in prepared]):
                    if batch:
                        r = {**r, "index": i}
                    yield sse(r)
            except RequestError as e:
                yield sse({"error": {"message": e.message, "code": e.status_code}})
            yield SSE_DONE

        return StreamingResponse(stream(), media_type="text/event-stream")

    # ---------------------------------------------------------------- OpenAI
    @app.get("/v1/models")
    async def models():
        return json_response({"object": "list", "data": [{
            "id": tm.served_model_name, "object": "model", "created": int(time.time()), "owned_by": "sgl-jax",
            "root": tm.model_path, "max_model_len": tm.context_len}]})

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        return await create_completion(tm, req)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        return await create_chat_completion(tm, req)

    @app.post("/v1/score")
    async def score(request: Request):
        body = await _json_body(request)
        fields = {f.name for f in dataclasses.fields(ScoreReqInput)}
        unknown = sorted(set(body) - fields)
        if unknown:
            raise RequestError(f"Unknown fields: {unknown}")
        result = await _until_disconnect(request, tm.score_request(ScoreReqInput(**body)))
        if result is None:
            return Response(status_code=499)
        n = result["prompt_tokens"]
        return json_response({"object": "scoring", "model": tm.served_model_name, "scores": result["scores"],
                              "usage": {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n}})

    return app


async def _until_disconnect(request: Request, coro, poll_s: float = 0.25):
    """Await `coro`, cancelling it (which aborts its work in the scheduler) if the client disconnects
    first; returns None then."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                logger.info("Client disconnected; aborting %s", request.url.path)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return None
    finally:
        if not task.done():
            task.cancel()


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise RequestError(f"Request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError("Request body must be a JSON object")
    return body


def launch_server(server_args: ServerArgs) -> None:
    """Start the engine processes and serve HTTP until interrupted. Exits the process non-zero if a
    child process dies."""
    import uvicorn

    from sgl_jax.srt.entrypoints.launch import ChildWatcher, launch_subprocesses
    from sgl_jax.srt.utils import configure_logging, kill_processes

    configure_logging(server_args.log_level, "Server")
    port_args, info, procs = launch_subprocesses(server_args)
    tm = TokenizerManager(server_args, port_args, info)
    app = build_app(tm, server_args, info)
    def on_death(name: str, exitcode: int) -> None:
        logger.error("%s exited unexpectedly with code %s; shutting the server down", name, exitcode)
        if tm.loop is not None:
            tm.loop.call_soon_threadsafe(tm.mark_dead, f"{name} exited with code {exitcode}")

        def finish():
            kill_processes(procs)
            logging.shutdown()
            os._exit(1)

        threading.Timer(1.0, finish).start()

    watcher = ChildWatcher(procs, on_death)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal under the previous
    # handler: make that a clean exit so the children are stopped below and the status is 0.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    logger.info("Serving %s on http://%s:%d", tm.served_model_name, server_args.host, server_args.port)
    try:
        uvicorn.run(app, host=server_args.host, port=server_args.port, log_level="warning",
                    timeout_keep_alive=5, loop="uvloop")
    except KeyboardInterrupt:
        pass
    finally:
        watcher.stop()
        kill_processes(procs)
        logger.info("Server stopped")
