"""Messages exchanged over ZMQ between TokenizerManager, Scheduler and DetokenizerManager (pickled).

TokenizerManager -> Scheduler: TokenizedGenerateReqInput, TokenizedScoreReqInput, ScorePrefillReq,
ScoreReleaseReq, AbortReq, FlushCacheReq, GetInternalStateReq, OpenSessionReqInput, CloseSessionReqInput,
Load/UnloadLoRAAdapterReqInput, and the control requests of CONTROL_REPLIES (weights, memory, pause, profile).
Scheduler -> DetokenizerManager: BatchTokenIDOut (new token ids per request).
DetokenizerManager -> TokenizerManager: BatchStrOut (new text per request).
Scheduler -> TokenizerManager: ScoreOut, ScoreReleaseOut, FlushCacheReqOutput, GetInternalStateReqOutput,
OpenSessionReqOutput, CloseSessionReqOutput, LoRAUpdateOutput, and a ControlOutput subclass per control request
(CONTROL_REPLIES) (a ZMQ PUSH socket of its own, straight to the TokenizerManager).
Scheduler -> launcher, once, over the start-up pipe: SchedulerInfo (ready), or SchedulerStartupError.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from sgl_jax.srt.sampling.sampling_params import SamplingParams


@dataclasses.dataclass
class TokenizedGenerateReqInput:
    """One generation request after tokenization. Logprob fields follow SGLang's GenerateReqInput."""

    rid: str
    input_ids: List[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: Optional[List[int]] = None
    stream: bool = False
    session_params: Optional[SessionParams] = None
    return_routed_experts: bool = False
    lora_path: Optional[str] = None  # the LoRA adapter's name (None: the base model)


@dataclasses.dataclass
class SessionParams:
    """``session_params`` of a generation request (SGLang's SessionParams): the turn belongs to session `id`;
    `rid`: the earlier turn it continues (classic sessions; None: none); `offset`: cut the parent's tokens
    to their first `offset` (a Python slice end; None or 0: no cut); `replace`: abort and drop the parent's
    other branches; `drop_previous_output`: continue the parent's prompt without its output."""

    id: str
    rid: Optional[str] = None
    offset: Optional[int] = None
    replace: Optional[bool] = None
    drop_previous_output: Optional[bool] = None


@dataclasses.dataclass
class OpenSessionReqInput:
    """SGLang's /open_session body. capacity_of_str_len: accepted as upstream (which stores it and never
    uses it); session_id: None -> a new uuid; streaming: a streaming session (--enable-streaming-session);
    timeout: seconds of inactivity after which the session is closed (None: never)."""

    capacity_of_str_len: int = 0
    session_id: Optional[str] = None
    streaming: bool = False
    timeout: Optional[float] = None
    request_id: str = ""  # matches the answer to its request (TokenizerManager.control)


@dataclasses.dataclass
class OpenSessionReqOutput:
    session_id: Optional[str]
    success: bool
    message: str = ""
    request_id: str = ""  # the request's (set by the scheduler)


@dataclasses.dataclass
class CloseSessionReqInput:
    session_id: str
    request_id: str = ""  # matches the answer to its request (TokenizerManager.control)


@dataclasses.dataclass
class CloseSessionReqOutput:
    session_id: str
    success: bool
    message: str = ""
    request_id: str = ""  # the request's (set by the scheduler)


@dataclasses.dataclass
class LoadLoRAAdapterReqInput:
    """SGLang's /load_lora_adapter body: register the PEFT adapter at `lora_path` (a directory or a hub id) as
    `lora_name`; `pinned`: never evicted to make room under --max-loaded-loras."""

    lora_name: str
    lora_path: str
    pinned: bool = False
    request_id: str = ""  # matches the answer to its request (TokenizerManager.control)


@dataclasses.dataclass
class UnloadLoRAAdapterReqInput:
    """SGLang's /unload_lora_adapter body."""

    lora_name: str
    request_id: str = ""  # matches the answer to its request (TokenizerManager.control)


@dataclasses.dataclass
class LoRAUpdateOutput:
    """SGLang's answer to a load or unload: `success`, `error_message`, and `loaded_adapters` (name -> path of
    every adapter loaded afterwards). `status_code`: the HTTP status (400 a bad adapter, 409 one still in use).
    `load_seconds`: what reading the adapter took (seconds)."""

    success: bool
    error_message: Optional[str] = None
    loaded_adapters: Optional[Dict[str, str]] = None
    status_code: int = 200
    load_seconds: Optional[float] = None
    request_id: str = ""  # the request's (set by the scheduler)


@dataclasses.dataclass
class AbortReq:
    rid: str
    message: str = "Aborted by the client"


@dataclasses.dataclass
class FlushCacheReq:
    request_id: str = ""  # matches the answer to its request (TokenizerManager.control)


@dataclasses.dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""
    request_id: str = ""  # the request's (set by the scheduler)


@dataclasses.dataclass
class GetInternalStateReq:
    request_id: str = ""  # matches the answer to its request (TokenizerManager.control)


@dataclasses.dataclass
class GetInternalStateReqOutput:
    internal_state: Dict[str, object]
    request_id: str = ""  # the request's (set by the scheduler)


# ---- RL and operator control (scheduler/engine_control.py); each answered by a ControlOutput subclass
@dataclasses.dataclass
class UpdateWeightsFromDiskReqInput:
    """/update_weights_from_disk (SGLang's fields): the checkpoint, and what happens to requests in flight:
    `abort_all_requests` aborts them; otherwise the update waits until the running ones finish (new ones wait),
    unless generation is paused (then it happens at once: in_place requests keep their KV and go on)."""

    model_path: str
    load_format: Optional[str] = None
    revision: Optional[str] = None
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    flush_cache: bool = True
    request_id: str = ""  # matches the answer to its request (TokenizerManager.control)


@dataclasses.dataclass
class UpdateWeightsFromTensorReqInput:
    """`Engine.update_weights_from_tensor`: (HF name, host array) pairs; the rest as the disk update's."""

    named_tensors: List[tuple]
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    flush_cache: bool = True
    request_id: str = ""  # matches the answer to its request (TokenizerManager.control)


@dataclasses.dataclass
class GetWeightsByNameReqInput:
    name: str
    truncate_size: int = 100
    request_id: str = ""  # matches the answer to its request (TokenizerManager.control)


@dataclasses.dataclass
class MemoryOccupationReqInput:
    """/release_memory_occupation (`release` True) or /resume_memory_occupation; `tags`: "kv_cache", "weights"
    (None: both, SGLang's default)."""

    release: bool
    tags: Optional[List[str]] = None
    request_id: str = ""  # matches the answer to its request (TokenizerManager.control)


@dataclasses.dataclass
class PauseGenerationReqInput:
    """/pause_generation (`mode`: "abort", "retract", "in_place") or, with `resume` True, /continue_generation."""

    mode: str = "abort"
    resume: bool = False
    request_id: str = ""  # matches the answer to its request (TokenizerManager.control)


@dataclasses.dataclass
class ProfileReqInput:
    """/start_profile (`start` True) or /stop_profile: a jax.profiler trace under `output_dir`, stopped after
    `num_steps` scheduler steps or `duration_s` seconds, whichever comes first."""

    start: bool
    output_dir: Optional[str] = None
    num_steps: Optional[int] = None
    duration_s: Optional[float] = None
    request_id: str = ""  # matches the answer to its request (TokenizerManager.control)


@dataclasses.dataclass
class ControlOutput:
    """The scheduler's answer to a control request: `success`, `message`, the HTTP `status_code`, and the
    operation's own fields in `data`."""

    success: bool
    message: str = ""
    status_code: int = 200
    data: Dict[str, object] = dataclasses.field(default_factory=dict)
    request_id: str = ""  # the request's (set by the scheduler)


class UpdateWeightsOutput(ControlOutput):
    pass


class GetWeightsOutput(ControlOutput):
    pass


class MemoryOccupationOutput(ControlOutput):
    pass


class PauseGenerationOutput(ControlOutput):
    pass


class ProfileOutput(ControlOutput):
    pass


# which answer each control request gets
CONTROL_REPLIES = {UpdateWeightsFromDiskReqInput: UpdateWeightsOutput, UpdateWeightsFromTensorReqInput:
                   UpdateWeightsOutput, GetWeightsByNameReqInput: GetWeightsOutput,
                   MemoryOccupationReqInput: MemoryOccupationOutput, PauseGenerationReqInput: PauseGenerationOutput,
                   ProfileReqInput: ProfileOutput}
# every answer the scheduler sends back to one TokenizerManager call, matched to it by request_id
# (TokenizerManager.control): the sessions', LoRA's, the cache flush's, the internal state's and CONTROL_REPLIES'
ANSWERS = (OpenSessionReqOutput, CloseSessionReqOutput, LoRAUpdateOutput, FlushCacheReqOutput,
           GetInternalStateReqOutput, ControlOutput)


@dataclasses.dataclass
class LogprobDelta:
    """New logprob entries of one request since the last message; each entry is (logprob, token_id).

    input_*: sent once, with the first output (positions from logprob_start_len; the very first prompt
    token has logprob None). output_*: one entry per new output token.
    """

    input_token_logprobs: Optional[list] = None
    input_top_logprobs: Optional[list] = None
    input_token_ids_logprobs: Optional[list] = None
    output_token_logprobs: list = dataclasses.field(default_factory=list)
    output_top_logprobs: list = dataclasses.field(default_factory=list)
    output_token_ids_logprobs: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class DecodeConfig:
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop: List[str] = dataclasses.field(default_factory=list)
    no_stop_trim: bool = False


@dataclasses.dataclass
class TokenOut:
    """Progress of one request in one scheduler step."""

    rid: str
    new_token_ids: List[int]
    finished_reason: Optional[dict]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    decode: DecodeConfig
    logprobs: Optional[LogprobDelta] = None
    routed_experts: Optional[str] = None  # on the final message of a return_routed_experts request (see Req)
    # speculative decoding's counts so far (scheduler/speculative/speculation.SpecCounts as a dict) when speculating
    spec: Optional[dict] = None


@dataclasses.dataclass
class BatchTokenIDOut:
    outs: List[TokenOut]


@dataclasses.dataclass
class StrOut:
    """Progress of one request as text: ``text`` is the new, final (never retracted) text.

    error: set (with no other content) when the detokenizer failed on this request: the request fails
    with HTTP 500 and is aborted; its later outputs are dropped, except the final one, which is passed on
    (as a message without text) so the TokenizerManager knows the scheduler is done with the rid.
    """

    rid: str
    text: str
    new_token_ids: List[int]
    finished_reason: Optional[dict]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: Optional[LogprobDelta] = None
    error: Optional[str] = None
    routed_experts: Optional[str] = None  # TokenOut's, passed on
    spec: Optional[dict] = None  # TokenOut's, passed on


@dataclasses.dataclass
class BatchStrOut:
    outs: List[StrOut]


# ---------------------------------------------------------------- scoring (/v1/score)
@dataclasses.dataclass
class ScoreSeq:
    """One sequence the scheduler computes for scoring.

    input_ids: its tokens (with a handle: only the tokens after the handle's query).
    score_positions: KV positions (in the whole sequence, handle query included) whose next-token
        distribution is scored.
    rope_positions / segment_starts: per position of a packed sequence, its rotary position and the KV
        position where its segment starts (None: an ordinary sequence).
    prefix_len: a packed sequence's shared prefix (query) length; 0 otherwise.
    pool_index: an embedding request's: per score position, the output its final hidden state is averaged into
        (outputs numbered from 0 in the sequence); None: the label log-probabilities are scored.
    token_types: an encoder model's segment (sentence A 0 / B 1) per position; None for other models.
    """

    input_ids: List[int]
    score_positions: List[int]
    rope_positions: Optional[List[int]] = None
    segment_starts: Optional[List[int]] = None
    prefix_len: int = 0
    pool_index: Optional[List[int]] = None
    token_types: Optional[List[int]] = None


@dataclasses.dataclass
class TokenizedScoreReqInput:
    """Sequences to score for one request; ``handle`` names the scoring-cache query they extend. ``classify``
    (embedding sequences, ScoreSeq.pool_index): each pooled output goes through the model's sequence-classification
    head (ScoreOut.embeddings are then its logits)."""

    rid: str
    seqs: List[ScoreSeq]
    label_token_ids: List[int]
    handle: Optional[str] = None
    classify: bool = False
    lora_path: Optional[str] = None  # the LoRA adapter's name (None: the base model)


@dataclasses.dataclass
class ScorePrefillReq:
    """Prefill a query into the scoring cache; the handle id is ``rid``."""

    rid: str
    input_ids: List[int]
    lora_path: Optional[str] = None  # the LoRA adapter's name (None: the base model)


@dataclasses.dataclass
class ScoreReleaseReq:
    handle: str


@dataclasses.dataclass
class ScoreOut:
    """Result of a TokenizedScoreReqInput or ScorePrefillReq.

    label_logprobs: per sequence, per score position, the log-probability (full-vocabulary softmax) of
    each label id; None for a prefill, an embedding request or an error. embeddings: an embedding request's, per
    sequence, per output (ScoreSeq.pool_index), the mean of its final hidden states (float32 [hidden]).
    error / status_code: set when the request failed.
    """

    rid: str
    label_logprobs: Optional[List[List[List[float]]]]
    prompt_tokens: int
    cached_tokens: int
    error: Optional[str] = None
    status_code: int = 400
    embeddings: Optional[list] = None


@dataclasses.dataclass
class ScoreReleaseOut:
    handle: str
    success: bool
    message: str = ""


@dataclasses.dataclass(frozen=True)
class SchedulerInfo:
    """What the scheduler reports once ready (sent over the start-up pipe; the TokenizerManager validates
    requests against it, /get_server_info shows it as ``scheduler_info``). Sizes are per DP rank.

    max_total_tokens: KV tokens of a rank's full pool; max_running_requests: requests (and request slots) per
    rank; max_prefill_tokens: the prefill token budget; max_req_input_len: the longest prompt; context_len: the
    model's context in tokens; page_size: tokens per KV page; kv_cache_dtype: the KV storage dtype's name;
    chunked_prefill_size: -1 when off; prefix_cache: the prefix cache kind (mem_cache/registry.py);
    vocab_size, architecture: the model's; model_role, is_encoder: its class's ``role`` ("causal", "embedding",
    "classifier") and ``is_encoder`` (models/llama.LlamaForCausalLM's hooks); token_paddings / bs_paddings: the compiled buckets; dp_size,
    tp_size: the mesh; load_balance_method; enable_mixed_chunk; max_prefill_step_ms: 0 when off;
    weight_bytes_per_device: the weights' bytes on one device as stored; quantization: --quantization;
    startup_phases: where start-up time went, {"scheduler": `StartupPhases.to_json`} from the scheduler process;
    the HTTP process adds "server" (its own) and "ready_s" in place (`entrypoints.launch.log_ready`).
    """

    max_total_tokens: int
    max_running_requests: int
    max_prefill_tokens: int
    max_req_input_len: int
    context_len: int
    page_size: int
    kv_cache_dtype: str
    chunked_prefill_size: int
    prefix_cache: str
    vocab_size: int
    architecture: str
    token_paddings: List[int]
    bs_paddings: List[int]
    dp_size: int
    tp_size: int
    load_balance_method: str
    enable_mixed_chunk: bool
    max_prefill_step_ms: float
    return_routed_experts: bool = False  # requests may ask for their routed experts (a MoE model, and the flag)
    weight_bytes_per_device: int = 0  # bytes of the model's weights on one device, as stored (quantized or not)
    quantization: Optional[str] = None  # --quantization: the linear layers' method, None: not quantized
    lora_adapters: Optional[Dict[str, str]] = None  # --enable-lora: the adapters loaded at start-up (name -> path)
    lora_slot_bytes: int = 0  # bytes of one LoRA adapter slot on one device
    startup_phases: Optional[dict] = None
    model_role: str = "causal"
    is_encoder: bool = False

    def to_json(self) -> dict:
        """The JSON object of /get_server_info's ``scheduler_info`` (``radix_cache``: whether prefixes are shared,
        SGLang's name)."""
        return {**dataclasses.asdict(self), "radix_cache": self.prefix_cache != "chunk"}


@dataclasses.dataclass(frozen=True)
class SchedulerStartupError:
    """What the scheduler sends over the start-up pipe instead of `SchedulerInfo` when it cannot start:
    `traceback` is the formatted exception; `reason` the one-line message of a configuration error (a ValueError),
    empty for anything else."""

    traceback: str
    reason: str = ""
