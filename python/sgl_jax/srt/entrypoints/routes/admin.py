"""Operator routes: /get_server_info, /get_load, /flush_cache, /abort_request, /load_lora_adapter,
/unload_lora_adapter, and /metrics (a router of its own,
included only with --enable-metrics). The admin key guards the mutating ones (entrypoints/http_guards.py)."""

from __future__ import annotations

import dataclasses
import logging

from fastapi import Depends, Request
from fastapi.responses import Response

from sgl_jax.srt.entrypoints.native_protocol import AbortRequest, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from sgl_jax.srt.entrypoints.http_guards import admin_endpoint, bodyless_endpoint
from sgl_jax.srt.entrypoints.routes.common import json_response
from sgl_jax.srt.entrypoints.routes.common import new_router, tokenizer_manager
from sgl_jax.srt.metrics.collector import METRICS_CONTENT_TYPE
from sgl_jax.srt.server_args import ServerArgs
from sgl_jax.srt.tokenizer.tokenizer_manager import RequestError, TokenizerManager
from sgl_jax.version import __version__

logger = logging.getLogger(__name__)

# ServerArgs fields /get_server_info never shows: secrets, and paths on this machine's disk
PRIVATE_SERVER_ARGS = ("api_key", "admin_api_key", "model_path", "tokenizer_path", "chat_template",
                       "compilation_cache_dir", "profile_dir")

router = new_router()
metrics_router = new_router()


def public_server_args(server_args: ServerArgs, served_model_name: str) -> dict:
    """The server's configuration as /get_server_info shows it: no keys, no paths on disk."""
    out = {k: v for k, v in dataclasses.asdict(server_args).items() if k not in PRIVATE_SERVER_ARGS}
    out["served_model_name"] = served_model_name
    out["api_key_set"] = server_args.api_key is not None
    out["admin_api_key_set"] = server_args.admin_api_key is not None
    return out


def admission_state(tm: TokenizerManager, state: dict) -> dict:
    """/get_server_info's view of admission: requests queued (waiting in the scheduler, all ranks), in flight
    (sent, not finished), refused because the queue was full (since start), the queue's capacity
    (--max-queued-requests; None: unbounded) and whether the server is draining (shutting down)."""
    return {"num_queued_reqs": state["num_waiting_reqs"], "num_in_flight_reqs": tm.num_in_flight(),
            "num_rejected_reqs": tm.num_rejected_reqs, "queue_capacity": tm.queue_capacity(),
            "draining": tm.draining is not None}


@router.get("/get_server_info")
async def get_server_info(request: Request, tm: TokenizerManager = Depends(tokenizer_manager)):
    """The flags (no secrets or paths), the scheduler's start-up info, one internal state per DP rank (SGLang's
    ``internal_states``: queues, KV accounting, memory errors, compiles after warm-up) and admission."""
    state = await tm.get_internal_state()
    app_state = request.app.state
    return json_response({**public_server_args(app_state.server_args, tm.served_model_name),
                          "weight_version": state["weight_version"],
                          "scheduler_info": app_state.scheduler_info.to_json(), "internal_states": state["dp_ranks"],
                          "version": __version__, **admission_state(tm, state)})


@router.get("/get_load")
async def get_load(tm: TokenizerManager = Depends(tokenizer_manager)):
    """SGLang's load report, one entry per data-parallel rank (sglang-router polls it): requests running
    or waiting, those waiting, and KV tokens in use."""
    ranks = (await tm.get_internal_state())["dp_ranks"]
    return json_response([{"dp_rank": st["dp_rank"], "num_reqs": st["num_running_reqs"] + st["num_waiting_reqs"],
                           "num_waiting_reqs": st["num_waiting_reqs"], "num_tokens": st["kv_tokens_in_use"]}
                          for st in ranks])


@router.post("/flush_cache")
@admin_endpoint
@bodyless_endpoint
async def flush_cache(tm: TokenizerManager = Depends(tokenizer_manager)):
    out = await tm.flush_cache()
    return Response(out.message, status_code=200 if out.success else 400)


def lora_update_response(out) -> Response:
    """SGLang's LoRAUpdateOutput body (success, error_message, loaded_adapters) with the scheduler's status: 200,
    400 (a bad or unknown adapter) or 409 (an adapter still in use)."""
    return json_response({"success": out.success, "error_message": out.error_message,
                          "loaded_adapters": out.loaded_adapters}, status_code=out.status_code)


@router.post("/load_lora_adapter")
@admin_endpoint
async def load_lora_adapter(req: LoadLoRAAdapterRequest, tm: TokenizerManager = Depends(tokenizer_manager)):
    """Load a PEFT LoRA adapter at run time (no compile: it goes into a fixed slot when first used)."""
    return lora_update_response(await tm.update_lora(req.to_input()))


@router.post("/unload_lora_adapter")
@admin_endpoint
async def unload_lora_adapter(req: UnloadLoRAAdapterRequest, tm: TokenizerManager = Depends(tokenizer_manager)):
    """Unload an adapter; 409 while queued or running requests use it."""
    return lora_update_response(await tm.update_lora(req.to_input()))


@router.post("/abort_request")
@admin_endpoint
async def abort_request(req: AbortRequest, tm: TokenizerManager = Depends(tokenizer_manager)):
    if req.abort_all:
        n = tm.abort_all()
        logger.info("abort_all: aborting %d requests", n)
        return Response(status_code=200)
    if req.rid is None:
        raise RequestError("'rid' (string) or 'abort_all': true is required")
    if not tm.abort_request(req.rid):
        raise RequestError(f"No running generation request has rid {req.rid!r}", 404)
    return Response(status_code=200)


@metrics_router.get("/metrics")
async def metrics(tm: TokenizerManager = Depends(tokenizer_manager)):
    """Prometheus text format (see sgl_jax.srt.metrics.collector). The gauges are refreshed from the scheduler
    first; if it does not answer (engine down or busy), the last values are served."""
    try:
        tm.metrics.update_gauges(await tm.get_internal_state())
    except RequestError as e:
        logger.warning("/metrics: gauges not refreshed: %s", e.message)
    return Response(tm.metrics.render(), media_type=METRICS_CONTENT_TYPE)
