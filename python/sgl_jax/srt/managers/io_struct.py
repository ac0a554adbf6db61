"""Messages exchanged over ZMQ between TokenizerManager, Scheduler and DetokenizerManager (pickled).

TokenizerManager -> Scheduler: TokenizedGenerateReqInput, AbortReq, FlushCacheReq, GetInternalStateReq.
Scheduler -> DetokenizerManager: BatchTokenIDOut (new token ids per request).
DetokenizerManager -> TokenizerManager: BatchStrOut (new text per request).
Scheduler -> TokenizerManager: FlushCacheReqOutput, GetInternalStateReqOutput.
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


@dataclasses.dataclass
class AbortReq:
    rid: str
    message: str = "Aborted by the client"


@dataclasses.dataclass
class FlushCacheReq:
    pass


@dataclasses.dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""


@dataclasses.dataclass
class GetInternalStateReq:
    pass


@dataclasses.dataclass
class GetInternalStateReqOutput:
    internal_state: Dict[str, object]


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


@dataclasses.dataclass
class BatchTokenIDOut:
    outs: List[TokenOut]


@dataclasses.dataclass
class StrOut:
    """Progress of one request as text: ``text`` is the new, final (never retracted) text."""

    rid: str
    text: str
    new_token_ids: List[int]
    finished_reason: Optional[dict]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: Optional[LogprobDelta] = None


@dataclasses.dataclass
class BatchStrOut:
    outs: List[StrOut]
