"""RL and operator routes (SGLang's): /update_weights_from_disk, /get_weights_by_name, /get_weight_version (also
/weight_version), /release_memory_occupation, /resume_memory_occupation, /pause_generation, /continue_generation,
/start_profile, /stop_profile. All but the weight version are admin endpoints (marked `admin_endpoint`: entrypoints/http_guards.py);
what each does to requests in flight is in scheduler/engine_control.py and docs/api.md."""

from __future__ import annotations

from typing import Optional

from fastapi import Depends, Query

from sgl_jax.srt.entrypoints.control_protocol import (
    ContinueGenerationRequest,
    GetWeightsByNameRequest,
    MemoryOccupationRequest,
    PauseGenerationRequest,
    StartProfileRequest,
    UpdateWeightsFromDiskRequest,
)
from sgl_jax.srt.entrypoints.http_guards import admin_endpoint, bodyless_endpoint
from sgl_jax.srt.entrypoints.routes.common import json_response
from sgl_jax.srt.entrypoints.routes.common import new_router, tokenizer_manager
from sgl_jax.srt.io_struct import ControlOutput, ProfileReqInput
from sgl_jax.srt.tokenizer.tokenizer_manager import TokenizerManager

router = new_router()


def control_response(out: ControlOutput, **extra) -> object:
    """SGLang's answer body (``success``, ``message``) plus the operation's fields, with its HTTP status."""
    return json_response({"success": out.success, "message": out.message, **extra, **out.data},
                         status_code=out.status_code)


@router.post("/update_weights_from_disk")
@admin_endpoint
async def update_weights_from_disk(req: UpdateWeightsFromDiskRequest,
                                   tm: TokenizerManager = Depends(tokenizer_manager)):
    """Replace the weights with a checkpoint of the same architecture and shapes (400 naming the first mismatch;
    the served weights stay). No compile; the prefix cache is retired; ``weight_version`` labels the new weights."""
    out = await tm.control(req.to_input())
    return control_response(out, num_paused_requests=out.data.get("num_paused_requests", 0))


@router.get("/get_weights_by_name")
@admin_endpoint
async def get_weights_by_name_get(name: str = Query(..., min_length=1, max_length=512),
                                  truncate_size: int = Query(100, ge=1, le=100_000),
                                  tm: TokenizerManager = Depends(tokenizer_manager)):
    """The first ``truncate_size`` rows of parameter ``name`` (a JSON array), for checking an update."""
    return await _weights_by_name(GetWeightsByNameRequest(name=name, truncate_size=truncate_size), tm)


@router.post("/get_weights_by_name")
@admin_endpoint
async def get_weights_by_name_post(req: GetWeightsByNameRequest, tm: TokenizerManager = Depends(tokenizer_manager)):
    """As the GET, with a JSON body (SGLang's clients send one)."""
    return await _weights_by_name(req, tm)


async def _weights_by_name(req: GetWeightsByNameRequest, tm: TokenizerManager):
    out = await tm.control(req.to_input())
    if not out.success:
        return control_response(out)
    return json_response(out.data["parameter"])


@router.get("/get_weight_version")
@router.get("/weight_version")
async def get_weight_version(tm: TokenizerManager = Depends(tokenizer_manager)):
    """The served weights' label (--weight-version, then each update's ``weight_version``); SGLang serves it at
    both paths (newer releases in /model_info too)."""
    return json_response({"weight_version": tm.weight_version})


@router.post("/release_memory_occupation")
@admin_endpoint
async def release_memory_occupation(req: Optional[MemoryOccupationRequest] = None,
                                    tm: TokenizerManager = Depends(tokenizer_manager)):
    """Free the KV buffers (the prefix cache is flushed) and/or the weights on the devices; 409 while requests
    run. New requests get 503 with Retry-After until /resume_memory_occupation; queued ones wait."""
    return control_response(await tm.control((req or MemoryOccupationRequest()).to_input(release=True)))


@router.post("/resume_memory_occupation")
@admin_endpoint
async def resume_memory_occupation(req: Optional[MemoryOccupationRequest] = None,
                                   tm: TokenizerManager = Depends(tokenizer_manager)):
    """Restore what /release_memory_occupation freed (the weights from their host copy, unless an update placed
    new ones meanwhile; the KV buffers zeroed). No compile."""
    return control_response(await tm.control((req or MemoryOccupationRequest()).to_input(release=False)))


@router.post("/pause_generation")
@admin_endpoint
async def pause_generation(req: Optional[PauseGenerationRequest] = None,
                           tm: TokenizerManager = Depends(tokenizer_manager)):
    """Stop running steps: ``abort`` every request, ``retract`` the running ones (KV freed), or keep them
    ``in_place``. New requests queue until /continue_generation."""
    out = await tm.control((req or PauseGenerationRequest()).to_input())
    return control_response(out, status="ok" if out.success else "error")


@router.post("/continue_generation")
@admin_endpoint
@bodyless_endpoint
async def continue_generation(req: Optional[ContinueGenerationRequest] = None,
                              tm: TokenizerManager = Depends(tokenizer_manager)):
    """Run steps again after /pause_generation."""
    out = await tm.control((req or ContinueGenerationRequest()).to_input())
    return control_response(out, status="ok" if out.success else "error")


@router.post("/start_profile")
@admin_endpoint
async def start_profile(req: Optional[StartProfileRequest] = None, tm: TokenizerManager = Depends(tokenizer_manager)):
    """Start a jax.profiler trace (TensorBoard xplane and Perfetto JSON) under --profile-dir."""
    return control_response(await tm.control((req or StartProfileRequest()).to_input()))


@router.post("/stop_profile")
@admin_endpoint
@bodyless_endpoint
async def stop_profile(tm: TokenizerManager = Depends(tokenizer_manager)):
    """Stop the trace now; the answer lists its files."""
    return control_response(await tm.control(ProfileReqInput(start=False)))
