"""The HTTP server: FastAPI routes over a TokenizerManager, SGLang's native API plus OpenAI's.

Native: /generate, /health, /health_generate, /get_model_info, /get_server_info, /get_load, /flush_cache (POST),
/abort_request, /tokenize and /detokenize (also under /v1/), /metrics (Prometheus, with --enable-metrics;
404 otherwise). OpenAI: /v1/models, /v1/completions, /v1/chat/completions. Scoring: /v1/score.

Every request body is parsed by orjson (no NaN, no lone surrogates) and validated by a pydantic model
(entrypoints/native_protocol.py, entrypoints/openai/protocol.py), so /openapi.json documents each field's
type and range. Errors: invalid requests get 400 (never FastAPI's 422) with a message naming the field --
OpenAI's error object on /v1/*, ``{"error": {"message": ...}}`` elsewhere; 401 without the API key
(http_guards.py); 404 for an unknown rid in /abort_request; 413 when a body exceeds
--max-request-body-bytes or a request cannot fit; 415 for a POST that is not JSON; 500 when the engine
failed one request (the others go on); 503 while the engine is down. Responses name the served model,
never its path on disk. If the scheduler or detokenizer process dies, the server logs it, fails /health,
and exits with a non-zero status.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from typing import List, Optional, Union

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from sgl_jax.version import __version__
from sgl_jax.srt.entrypoints.field_types import LenientModel, TokenId
from sgl_jax.srt.entrypoints.http_guards import GuardMiddleware, KeyChecker
from sgl_jax.srt.entrypoints.native_protocol import (
    AbortRequest,
    CloseSessionRequest,
    GenerateRequest,
    OpenSessionRequest,
    ScoreRequest,
    validation_message,
)
from sgl_jax.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from sgl_jax.srt.entrypoints.openai.serving_chat import create_chat_completion
from sgl_jax.srt.entrypoints.openai.serving_completions import create_completion, gather_or_cancel
from sgl_jax.srt.entrypoints.openai.utils import (
    SSE_DONE,
    check_n,
    json_response,
    merge_streams,
    openai_error,
    sse,
)
from sgl_jax.srt.tokenizer.tokenizer_manager import GenerateReqInput, RequestError, TokenizerManager
from sgl_jax.srt.metrics.collector import METRICS_CONTENT_TYPE
from sgl_jax.srt.io_struct import SchedulerInfo
from sgl_jax.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 30.0
# ServerArgs fields /get_server_info never shows: secrets, and paths on this machine's disk
PRIVATE_SERVER_ARGS = ("api_key", "admin_api_key", "model_path", "tokenizer_path", "chat_template",
                       "compilation_cache_dir")


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


def _native_error(message: str, status_code: int = 400) -> Response:
    return json_response({"error": {"message": message, "code": status_code}}, status_code)


def _error_for(request: Request, message: str, status_code: int) -> Response:
    if request.url.path.startswith("/v1/"):
        return openai_error(message, status_code)
    return _native_error(message, status_code)


class TokenizeRequest(LenientModel):
    """The /tokenize (and /v1/tokenize) body, as SGLang's ``TokenizeRequest``: one text or a list of texts.
    Unknown fields are ignored, as upstream."""

    prompt: Union[str, List[str]]
    add_special_tokens: bool = Field(True, description="add the tokenizer's special tokens (e.g. BOS)")
    model: Optional[str] = Field(None, description="ignored (one model is served)")


class DetokenizeRequest(LenientModel):
    """The /detokenize (and /v1/detokenize) body, as SGLang's ``DetokenizeRequest``: one token-id list or a
    list of them. Unknown fields are ignored, as upstream."""

    tokens: Union[List[TokenId], List[List[TokenId]]]
    skip_special_tokens: bool = True
    model: Optional[str] = Field(None, description="ignored (one model is served)")


def tokenize_texts(tm: TokenizerManager, texts: List[str], add_special_tokens: bool,
                   batch: bool = True) -> List[List[int]]:
    """Token ids of each text, the whole text (no truncation; SGLang's /tokenize). Runs the tokenizer on the
    calling thread: call it through ``tm.run_blocking``.

    A text so long that it cannot fit the context whatever its tokenization (``tm.max_chars_per_token``,
    see TokenizerManager.encode_text) is refused without tokenizing it, so one request cannot hold the
    tokenizer thread for seconds.

    Args:
        batch: the texts came as a list (errors name the index: ``prompt[i]``).
    Raises:
        RequestError: 400 naming the text and the context length.
    """
    cap = tm.max_chars_per_token
    for i, text in enumerate(texts):
        if cap and len(text) > tm.context_len * cap:
            where = f"prompt[{i}]" if batch else "prompt"
            raise RequestError(f"{where} ({len(text)} characters, at least {-(-len(text) // cap)} tokens) is "
                               f"longer than the model's context length ({tm.context_len} tokens)")
    if not texts:
        return []
    return [list(ids) for ids in tm.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]


def detokenize_ids(tm: TokenizerManager, seqs: List[List[int]], skip_special_tokens: bool,
                   batch: bool = True) -> List[str]:
    """The text of each token-id list (``tokenizer.decode``). Runs the tokenizer on the calling thread: call
    it through ``tm.run_blocking``.

    Args:
        batch: the lists came as a list of lists (errors name the index: ``tokens[i]``).
    Raises:
        RequestError: 400 naming the ids outside the vocabulary [0, vocab_size) (the first five).
    """
    for i, ids in enumerate(seqs):
        bad = [t for t in ids if not 0 <= t < tm.vocab_size]
        if bad:
            where = f"tokens[{i}]" if batch else "tokens"
            raise RequestError(f"{where} contains ids outside the vocabulary [0, {tm.vocab_size}): {bad[:5]}")
    return [tm.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) for ids in seqs]


def public_server_args(server_args: ServerArgs, served_model_name: str) -> dict:
    """The server's configuration as /get_server_info shows it: no keys, no paths on disk."""
    out = {k: v for k, v in dataclasses.asdict(server_args).items() if k not in PRIVATE_SERVER_ARGS}
    out["served_model_name"] = served_model_name
    out["api_key_set"] = server_args.api_key is not None
    out["admin_api_key_set"] = server_args.admin_api_key is not None
    return out


def build_app(tm: TokenizerManager, server_args: ServerArgs, scheduler_info: SchedulerInfo) -> FastAPI:
    """The FastAPI application serving `tm`."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        tm.start()
        yield
        await tm.close()

    app = FastAPI(lifespan=lifespan, title="sgl-jax", version=__version__)
    app.router.route_class = ORJSONRoute
    app.add_middleware(GuardMiddleware, keys=KeyChecker(server_args.api_key, server_args.admin_api_key),
                       max_body_bytes=server_args.max_request_body_bytes)
    app.state.tokenizer_manager = tm

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return _error_for(request, validation_message(exc.errors()), 400)

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, exc: RequestError):
        response = _error_for(request, exc.message, exc.status_code)
        if exc.retry_after_s:  # 503 while overloaded or shutting down (RFC 9110 Retry-After, seconds)
            response.headers["Retry-After"] = str(exc.retry_after_s)
        return response

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        return _error_for(request, str(exc.detail), exc.status_code)

    # ---------------------------------------------------------------- health and info
    @app.get("/health")
    async def health():
        if tm.dead_reason is not None:
            return Response(f"unhealthy: {tm.dead_reason}", status_code=503)
        if tm.draining is not None:  # (so that load balancers stop sending work here)
            return Response(f"shutting down: {tm.draining}", status_code=503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        obj = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0})
        try:
            await asyncio.wait_for(tm.generate(obj), HEALTH_GENERATE_TIMEOUT_S)
        except (RequestError, asyncio.TimeoutError) as e:
            return Response(f"unhealthy: {e!r}", status_code=503)
        return Response(status_code=200)

    if tm.metrics is not None:
        @app.get("/metrics")
        async def metrics():
            """Prometheus text format (see sgl_jax.srt.metrics.collector). The gauges are refreshed from the
            scheduler first; if it does not answer (engine down or busy), the last values are served."""
            try:
                tm.metrics.update_gauges(await tm.get_internal_state())
            except RequestError as e:
                logger.warning("/metrics: gauges not refreshed: %s", e.message)
            return Response(tm.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/get_model_info")
    async def get_model_info():
        return json_response({"model_path": tm.served_model_name, "tokenizer_path": tm.served_model_name,
                              "served_model_name": tm.served_model_name, "is_generation": True,
                              "context_length": tm.context_len})

    @app.get("/get_server_info")
    async def get_server_info():
        state = await tm.get_internal_state()  # internal_states: one entry per DP rank (SGLang's shape)
        return json_response({**public_server_args(server_args, tm.served_model_name),
                              "scheduler_info": scheduler_info.to_json(), "internal_states": state["dp_ranks"],
                              "version": __version__, **admission_state(tm, state)})

    @app.get("/get_load")
    async def get_load():
        """SGLang's load report, one entry per data-parallel rank (sglang-router polls it): requests running
        or waiting, those waiting, and KV tokens in use."""
        ranks = (await tm.get_internal_state())["dp_ranks"]
        return json_response([{"dp_rank": st["dp_rank"], "num_reqs": st["num_running_reqs"] + st["num_waiting_reqs"],
                               "num_waiting_reqs": st["num_waiting_reqs"], "num_tokens": st["kv_tokens_in_use"]}
                              for st in ranks])

    @app.post("/flush_cache")
    async def flush_cache():
        out = await tm.flush_cache()
        return Response(out.message, status_code=200 if out.success else 400)

    @app.post("/abort_request")
    async def abort_request(req: AbortRequest):
        if req.abort_all:
            n = tm.abort_all()
            logger.info("abort_all: aborting %d requests", n)
            return Response(status_code=200)
        if req.rid is None:
            raise RequestError("'rid' (string) or 'abort_all': true is required")
        if not tm.abort_request(req.rid):
            raise RequestError(f"No running generation request has rid {req.rid!r}", 404)
        return Response(status_code=200)

    # ---------------------------------------------------------------- sessions
    @app.api_route("/open_session", methods=["GET", "POST"])
    async def open_session(req: OpenSessionRequest):
        """SGLang's /open_session: the body is the new session's id as a JSON string. 400: the id is taken,
        streaming without --enable-streaming-session, or no room for another streaming session."""
        return json_response(await tm.open_session(req.to_input()))

    @app.api_route("/close_session", methods=["GET", "POST"])
    async def close_session(req: CloseSessionRequest):
        """SGLang's /close_session: 200 with an empty body; 404 when no open session has the id (upstream
        answers 200 either way)."""
        await tm.close_session(req.session_id)
        return Response(status_code=200)

    # ---------------------------------------------------------------- tokenizer
    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(req: TokenizeRequest):
        """SGLang's /tokenize: {"tokens": ids or [ids per prompt], "count": n or [n per prompt],
        "max_model_len": context length in tokens}. Tokenizes on the TokenizerManager's thread."""
        one = isinstance(req.prompt, str)
        texts = [req.prompt] if one else req.prompt
        ids = await tm.run_blocking(tokenize_texts, tm, texts, req.add_special_tokens, not one)
        return json_response({"tokens": ids[0] if one else ids,
                              "count": len(ids[0]) if one else [len(x) for x in ids],
                              "max_model_len": tm.context_len})

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(req: DetokenizeRequest):
        """SGLang's /detokenize: {"text": str} for one id list (``[]`` gives ""), {"text": [str, ...]} for a
        list of lists. Ids outside the vocabulary answer 400."""
        one = not req.tokens or isinstance(req.tokens[0], int)
        seqs = [req.tokens] if one else req.tokens
        texts = await tm.run_blocking(detokenize_ids, tm, seqs, req.skip_special_tokens, not one)
        return json_response({"text": texts[0] if one else texts})

    # ---------------------------------------------------------------- native generation
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(req: GenerateRequest, request: Request):
        check_n("sampling_params.n", req.samples_per_prompt(), tm.server_args.max_n)
        objs = req.to_inputs()
        batch = isinstance(objs, list)
        items = objs if batch else [objs]
        for o in items:  # refuse a taken rid before any prompt of the batch starts
            if o.rid is not None:
                tm.reserve_rid(o.rid)
        prepared = await tm.prepare_fanout(items)  # the whole fan-out (batch x n) is admitted or refused
        if not items[0].stream:
            results = await until_disconnect(request, gather_or_cancel(tm.generate(p, admitted=True)
                                                                       for p in prepared))
            if results is None:
                return Response(status_code=499)
            return json_response(results if batch else results[0])

        async def stream():
            try:
                async for i, r in merge_streams([tm.generate_request(p, admitted=True) for p in prepared]):
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
            "root": tm.served_model_name, "max_model_len": tm.context_len}]})

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await create_completion(tm, req, lambda coro: until_disconnect(request, coro))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await create_chat_completion(tm, req, lambda coro: until_disconnect(request, coro))

    @app.post("/v1/score")
    async def score(req: ScoreRequest, request: Request):
        result = await until_disconnect(request, tm.score_request(req.to_input()))
        if result is None:
            return Response(status_code=499)
        n = result["prompt_tokens"]
        return json_response({"object": "scoring", "model": tm.served_model_name, "scores": result["scores"],
                              "usage": {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n}})

    return app


def admission_state(tm: TokenizerManager, state: dict) -> dict:
    """/get_server_info's view of admission: requests queued (waiting in the scheduler, all ranks), in flight
    (sent, not finished), refused because the queue was full (since start), the queue's capacity
    (--max-queued-requests; None: unbounded) and whether the server is draining (shutting down)."""
    return {"num_queued_reqs": state["num_waiting_reqs"], "num_in_flight_reqs": tm.num_in_flight(),
            "num_rejected_reqs": tm.num_rejected_reqs, "queue_capacity": tm.queue_capacity(),
            "draining": tm.draining is not None}


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


def launch_server(server_args: ServerArgs) -> None:
    """Start the engine processes and serve HTTP until a signal: SIGTERM/SIGINT drain running requests (up to
    --graceful-shutdown-timeout s; entrypoints/shutdown.py), then the processes stop and the exit status is 0.
    Exits non-zero (within ~1 s, every process gone) if a child process dies."""
    import uvicorn

    from sgl_jax.srt.entrypoints.launch import ChildWatcher, launch_subprocesses, stop_subprocesses
    from sgl_jax.srt.entrypoints.shutdown import DrainingServer
    from sgl_jax.srt.utils import configure_logging

    if server_args.node_rank > 0:  # a multi-host follower: only a scheduler, fed by node 0
        from sgl_jax.srt.scheduler.scheduler import run_follower_node

        run_follower_node(server_args)
        return
    configure_logging(server_args.log_level, "Server")

    def stop_during_startup(sig, _frame) -> None:  # (launch_subprocesses stops the children it started)
        logger.info("%s received during start-up: stopping", signal.Signals(sig).name)
        raise SystemExit(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_during_startup)
    port_args, info, procs = launch_subprocesses(server_args)
    try:
        tm = TokenizerManager(server_args, port_args, info)
        app = build_app(tm, server_args, info)
    except BaseException:
        stop_subprocesses(procs, port_args)
        raise

    def on_death(name: str, exitcode: int) -> None:
        logger.error("%s exited unexpectedly with code %s; shutting the server down", name, exitcode)
        if tm.loop is not None:
            tm.loop.call_soon_threadsafe(tm.mark_dead, f"{name} exited with code {exitcode}")

        def finish():
            stop_subprocesses(procs, port_args)
            logging.shutdown()
            os._exit(1)

        threading.Timer(1.0, finish).start()

    def exit_now(sig, _frame) -> None:  # a signal while the processes are being stopped: do not wait
        logger.info("%s received while stopping: exiting now", signal.Signals(sig).name)
        stop_subprocesses(procs, port_args, timeout=0.0)
        logging.shutdown()
        os._exit(0)

    watcher = ChildWatcher(procs, on_death)
    logger.info("Serving %s on http://%s:%d", tm.served_model_name, server_args.host, server_args.port)
    # log_config=None: uvicorn's loggers go through ours (one line per event, our format); its access log
    # (one line per HTTP request, at INFO) only with --enable-request-log
    config = uvicorn.Config(app, host=server_args.host, port=server_args.port, log_level="warning",
                            log_config=None, access_log=server_args.enable_request_log, timeout_keep_alive=5,
                            loop="uvloop", timeout_graceful_shutdown=5)
    if server_args.enable_request_log:
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    server = DrainingServer(config, tm, server_args.graceful_shutdown_timeout)
    try:
        server.run()  # (uvicorn installs the drain's SIGTERM/SIGINT handlers while it serves)
    except KeyboardInterrupt:
        pass
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, exit_now)
        watcher.stop()
        stop_subprocesses(procs, port_args)
        logger.info("Server stopped: engine processes %s", "stopped" if not any(p.is_alive() for p in procs)
                    else "still running")
