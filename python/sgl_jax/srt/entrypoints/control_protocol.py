"""Request bodies of the RL and operator endpoints (SGLang's ``io_struct`` names and fields) as pydantic models:
/update_weights_from_disk, /get_weights_by_name, /release_memory_occupation, /resume_memory_occupation,
/pause_generation, /continue_generation, /start_profile, /stop_profile. Unknown fields answer 400; SGLang's
fields that concern only its CUDA runtime are accepted and ignored (each says why), so an RL framework's
requests pass unchanged.
"""

from __future__ import annotations

from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import Field

from sgl_jax.srt.entrypoints.field_types import StrictModel, default_only, ignored
from sgl_jax.srt.io_struct import (
    GetWeightsByNameReqInput,
    MemoryOccupationReqInput,
    PauseGenerationReqInput,
    ProfileReqInput,
    UpdateWeightsFromDiskReqInput,
)

Version = Annotated[str, Field(min_length=1, max_length=256)]
_CUDA = "CUDA-runtime housekeeping; nothing to do under JAX"


class ControlRequest(StrictModel):
    """SGLang's BaseReq fields, which every one of its request bodies carries."""

    rid: ignored(Optional[Union[str, List[str]]], "a control answer is matched to its request by the server's "
                                                  "own id") = None
    http_worker_ipc: ignored(Optional[str], "one HTTP process answers every request") = None


class UpdateWeightsFromDiskRequest(ControlRequest):
    """SGLang's UpdateWeightFromDiskReqInput. ``abort_all_requests``: abort what is in flight first; otherwise
    the update waits until the running requests finish (new ones wait), or, while generation is paused, happens at
    once (in_place requests keep their KV and continue with the new weights)."""

    model_path: Annotated[str, Field(min_length=1, max_length=4096)]
    load_format: Optional[Literal["auto", "safetensors", "gguf"]] = None
    revision: Optional[Annotated[str, Field(min_length=1, max_length=256)]] = None
    abort_all_requests: bool = False
    weight_version: Optional[Version] = None
    flush_cache: ignored(bool, "every update retires the prefix cache (nothing computed with the old weights "
                               "is matched again)") = True
    is_async: ignored(bool, "the update is applied between scheduler steps either way") = False
    torch_empty_cache: ignored(bool, _CUDA) = False
    keep_pause: ignored(bool, "a paused server stays paused until /continue_generation") = False
    recapture_cuda_graph: ignored(bool, _CUDA) = False
    token_step: ignored(int, "a label for SGLang's RL metrics") = 0
    manifest: default_only(Optional[Dict[str, Any]], description="SGLang's tensor metadata for a partial update "
                                                               "(the whole checkpoint is read)") = None

    def to_input(self) -> UpdateWeightsFromDiskReqInput:
        return UpdateWeightsFromDiskReqInput(self.model_path, self.load_format, self.revision,
                                             self.abort_all_requests, self.weight_version)


class GetWeightsByNameRequest(ControlRequest):
    """SGLang's GetWeightsByNameReqInput: the first ``truncate_size`` rows of parameter ``name`` (its HF name)."""

    name: Annotated[str, Field(min_length=1, max_length=512)]
    truncate_size: Annotated[int, Field(ge=1, le=100_000)] = 100

    def to_input(self) -> GetWeightsByNameReqInput:
        return GetWeightsByNameReqInput(self.name, self.truncate_size)


class MemoryOccupationRequest(ControlRequest):
    """SGLang's Release/ResumeMemoryOccupationReqInput: ``tags`` "kv_cache" and/or "weights" (null: both);
    SGLang's "cuda_graph" is accepted and ignored (the compiled programs always stay)."""

    tags: Optional[Annotated[List[Literal["kv_cache", "weights", "cuda_graph"]], Field(min_length=1,
                                                                                     max_length=3)]] = None

    def to_input(self, release: bool) -> MemoryOccupationReqInput:
        return MemoryOccupationReqInput(release, None if self.tags is None else list(self.tags))


class PauseGenerationRequest(ControlRequest):
    """SGLang's PauseGenerationReqInput: ``abort`` every request, ``retract`` the running ones to the queue (KV
    freed, recomputed on continue), or keep them ``in_place`` (KV kept)."""

    mode: Literal["abort", "retract", "in_place"] = "abort"

    def to_input(self) -> PauseGenerationReqInput:
        return PauseGenerationReqInput(self.mode)


class ContinueGenerationRequest(ControlRequest):
    """SGLang's ContinueGenerationReqInput."""

    torch_empty_cache: ignored(bool, _CUDA) = True

    def to_input(self) -> PauseGenerationReqInput:
        return PauseGenerationReqInput(resume=True)


class StartProfileRequest(ControlRequest):
    """SGLang's ProfileReqInput for /start_profile: a jax.profiler trace into ``output_dir`` (relative to, and
    inside, --profile-dir; default: a new timestamped directory), stopped after ``num_steps`` scheduler steps or
    ``duration_s`` seconds (default 30 s when neither is given; at most 600 s), or by /stop_profile."""

    output_dir: Optional[Annotated[str, Field(min_length=1, max_length=1024)]] = None
    num_steps: Optional[Annotated[int, Field(ge=1, le=1_000_000)]] = None
    duration_s: Optional[Annotated[float, Field(gt=0, le=600)]] = None
    start_step: ignored(Optional[int], "the trace starts at once") = None
    activities: ignored(Optional[List[str]], "jax.profiler records host and device activity together") = None
    with_stack: ignored(Optional[bool], "jax.profiler records Python stacks by its own options") = None
    record_shapes: ignored(Optional[bool], "XLA ops carry their shapes in the trace") = None
    profile_by_stage: ignored(bool, "steps are marked in the trace either way") = False
    merge_profiles: ignored(bool, "one trace holds every device of the host") = False
    profile_prefix: ignored(Optional[str], "the trace's directory is output_dir") = None
    profile_id: ignored(Optional[str], "the trace's directory is output_dir") = None
    profile_stages: ignored(Optional[List[str]], "every step is traced") = None

    def to_input(self) -> ProfileReqInput:
        return ProfileReqInput(True, self.output_dir, self.num_steps, self.duration_s)
