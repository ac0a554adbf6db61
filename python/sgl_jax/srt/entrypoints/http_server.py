"""The HTTP server: FastAPI routes over a TokenizerManager, grouped in APIRouters (entrypoints/routes/: native,
openai, responses, anthropic, ollama, scoring, sessions, admin).

Native: /, /generate, /health, /health_generate, /get_model_info, /tokenize and /detokenize (also under /v1/).
OpenAI: /v1/models, /v1/models/{id}, /v1/completions, /v1/chat/completions, /v1/responses. Anthropic:
/v1/messages. Ollama: /api/*. Scoring: /v1/score. Sessions: /open_session, /close_session. Admin:
/get_server_info, /get_load, /flush_cache (POST), /abort_request, and /metrics (Prometheus, with --enable-metrics;
404 otherwise). HEAD is answered wherever GET is; CORS only with --allowed-origins.

Every request body is parsed by orjson (no NaN, no lone surrogates) and validated by a pydantic model
(entrypoints/native_protocol.py, entrypoints/openai/protocol.py, ...), so /openapi.json documents each field's
type and range. Errors: invalid requests get 400 (never FastAPI's 422) with a message naming the field, in
the shape of the path's API (error_bodies.py: OpenAI's error object on /v1/*, Anthropic's on /v1/messages,
Ollama's on /api/*, ``{"error": {"message": ...}}`` elsewhere); 401 without the API key (http_guards.py); 404
for an unknown rid in /abort_request; 413 when a body exceeds --max-request-body-bytes or a request cannot fit;
415 for a POST that is not JSON; 500 when the engine failed one request (the others go on); 503 while the
engine is down. Responses name the served model, never its path on disk. If the scheduler or detokenizer
process dies, the server logs it, fails /health, and exits with a non-zero status.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException

from sgl_jax.srt.entrypoints.http_guards import GuardMiddleware, HeadAsGet, KeyChecker, RouteMarks
from sgl_jax.srt.entrypoints.native_protocol import validation_message, validation_param
from sgl_jax.srt.entrypoints.routes import (admin, anthropic, control, embeddings, native, ollama, openai,
                                            rerank, responses, scoring, sessions)
from sgl_jax.srt.entrypoints.routes.common import ORJSONRoute, error_for
from sgl_jax.srt.io_struct import SchedulerInfo
from sgl_jax.srt.server_args import ServerArgs
from sgl_jax.srt.startup_phases import StartupPhases, process_started_at
from sgl_jax.srt.tokenizer.tokenizer_manager import RequestError, TokenizerManager
from sgl_jax.version import __version__

logger = logging.getLogger(__name__)

ROUTERS = (native.router, openai.router, responses.router, anthropic.router, ollama.router, scoring.router,
           rerank.router, embeddings.router, sessions.router, admin.router, control.router)


def build_app(tm: TokenizerManager, server_args: ServerArgs, scheduler_info: SchedulerInfo) -> FastAPI:
    """The FastAPI application serving `tm`: the route groups of entrypoints/routes (/metrics only with a metrics
    collector, --enable-metrics), the guards (API keys, JSON content type, body size) and 400 / 4xx error bodies
    that name the field (OpenAI's shape on /v1/*)."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        tm.start()
        yield
        await tm.close()

    app = FastAPI(lifespan=lifespan, title="sgl-jax", version=__version__)
    app.router.route_class = ORJSONRoute
    app.state.tokenizer_manager = tm
    app.state.server_args = server_args
    app.state.scheduler_info = scheduler_info

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return error_for(request, validation_message(exc.errors()), 400, validation_param(exc.errors()))

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, exc: RequestError):
        response = error_for(request, exc.message, exc.status_code, exc.param)
        if exc.retry_after_s:  # 503 while overloaded or shutting down (RFC 9110 Retry-After, seconds)
            response.headers["Retry-After"] = str(exc.retry_after_s)
        return response

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        return error_for(request, str(exc.detail), exc.status_code)

    routers = ROUTERS + ((admin.metrics_router,) if tm.metrics is not None else ())
    for router in routers:
        app.include_router(router)
    # the guards read the admin and body-less marks on the routes (the routers' own: FastAPI keeps an included
    # router's routes behind a wrapper)
    marks = RouteMarks([route for router in routers for route in router.routes])
    keys = KeyChecker(server_args.api_key, server_args.admin_api_key, marks)
    app.add_middleware(GuardMiddleware, keys=keys, max_body_bytes=server_args.max_request_body_bytes)
    app.add_middleware(HeadAsGet)
    add_cors(app, server_args)  # (after the guards: outside them, so a preflight never needs the key)
    return app


def add_cors(app: FastAPI, server_args: ServerArgs) -> None:
    """Opt-in CORS (vLLM's --allowed-origins, --allowed-methods, --allowed-headers) through Starlette's
    CORSMiddleware: preflights are answered only for the allowed origins (400 for others), and responses carry
    Access-Control-Allow-Origin only for them. Off without --allowed-origins (a preflight then answers 405,
    docs/security.md). ``*`` without --api-key lets any web page the user opens drive the server: warned."""
    origins = server_args.allowed_origins
    if not origins:
        return
    if "*" in origins and server_args.api_key is None:
        logger.warning("CORS: --allowed-origins * without --api-key lets any web page open in a browser on this "
                       "machine call the server; set --api-key or list the origins")
    methods, headers = server_args.allowed_methods or ["*"], server_args.allowed_headers or ["*"]
    app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=methods, allow_headers=headers)
    logger.info("CORS on: origins %s, methods %s, headers %s", origins, methods, headers)


def launch_server(server_args: ServerArgs) -> None:
    """Start the engine processes and serve HTTP until a signal: SIGTERM/SIGINT drain running requests (up to
    --graceful-shutdown-timeout s; entrypoints/shutdown.py), then the processes stop and the exit status is 0.
    Exits non-zero (within ~1 s, every process gone) if a child process dies."""
    import uvicorn

    from sgl_jax.srt.entrypoints.launch import ChildWatcher, launch_with_tokenizer, log_ready, stop_subprocesses
    from sgl_jax.srt.entrypoints.shutdown import DrainingServer
    from sgl_jax.srt.utils import configure_logging

    if server_args.node_rank > 0:  # a multi-host follower: only a scheduler, fed by node 0
        from sgl_jax.srt.scheduler.process import run_follower_node

        run_follower_node(server_args)
        return
    configure_logging(server_args.log_level, "Server")
    phases = StartupPhases(process_started_at())  # this process's start-up, from its interpreter's start
    phases.since_start("process start and imports")

    def stop_during_startup(sig, _frame) -> None:  # (launch_subprocesses stops the children it started)
        logger.info("%s received during start-up: stopping", signal.Signals(sig).name)
        raise SystemExit(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_during_startup)
    port_args, info, procs, tokenizer = launch_with_tokenizer(server_args, phases)
    try:
        with phases.phase("HTTP app"):
            tm = TokenizerManager(server_args, port_args, info, tokenizer=tokenizer)
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
    log_ready(info, phases)
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
