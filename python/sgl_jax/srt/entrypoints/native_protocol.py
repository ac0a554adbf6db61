"""Request bodies of SGLang's native API (/generate, /v1/score, /abort_request) as pydantic models.

Field names and meanings follow SGLang's ``GenerateReqInput``, ``SamplingParams`` and ``ScoringRequest``;
each field's type carries its range (see `field_types`), so a value out of range answers HTTP 400 naming
the field, and ``/openapi.json`` documents it. The HTTP server and the offline `Engine` validate through
these same models, then hand the managers plain dataclasses (`GenerateReqInput`, `ScoreReqInput`).
"""

from __future__ import annotations

from typing import Annotated, Any, List, Literal, Optional, Union

from pydantic import Discriminator, Field, Tag, field_validator

from sgl_jax.srt.entrypoints.field_types import (
    INT32_MAX,
    LogitBiasMap,
    NonNegFloat32,
    NonNegInt32,
    NumChoices,
    Penalty,
    PosFloat32,
    Probability,
    Rid,
    Seed,
    StrictModel,
    TokenId,
    TopP,
)
from sgl_jax.srt.managers.errors import RequestError
from sgl_jax.srt.managers.scoring import ALGORITHMS, ScoreReqInput
from sgl_jax.srt.managers.tokenizer_manager import GenerateReqInput
from sgl_jax.srt.sampling.sampling_params import SamplingParams

_SP = SamplingParams()  # defaults come from the one dataclass


def not_supported_unless_default(value, name: str):
    """A field of SGLang's schema that sgl-jax accepts only at its default (None, False, empty).

    Raises:
        ValueError: a non-default value (HTTP 400 naming the field).
    """
    if value:
        raise ValueError(f"{name} is not supported by this server (only null or its default)")
    return value


def default_only(*fields: str):
    """A pydantic validator refusing non-default values of `fields` (see `not_supported_unless_default`)."""
    return field_validator(*fields)(classmethod(lambda cls, v, info: not_supported_unless_default(v, info.field_name)))


class SamplingParamsRequest(StrictModel):
    """``sampling_params`` of /generate (SGLang's SamplingParams keys)."""

    max_new_tokens: Optional[NonNegInt32] = Field(_SP.max_new_tokens, description="null: up to the context length")
    min_new_tokens: NonNegInt32 = _SP.min_new_tokens
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[TokenId]] = None
    temperature: NonNegFloat32 = _SP.temperature
    top_p: TopP = _SP.top_p
    top_k: int = Field(_SP.top_k, ge=-1, le=INT32_MAX, description="-1 or 0: disabled")
    min_p: Probability = _SP.min_p
    frequency_penalty: Penalty = _SP.frequency_penalty
    presence_penalty: Penalty = _SP.presence_penalty
    repetition_penalty: PosFloat32 = _SP.repetition_penalty
    ignore_eos: bool = _SP.ignore_eos
    skip_special_tokens: bool = _SP.skip_special_tokens
    spaces_between_special_tokens: bool = _SP.spaces_between_special_tokens
    no_stop_trim: bool = _SP.no_stop_trim
    n: NumChoices = _SP.n
    sampling_seed: Optional[Seed] = None
    seed: Optional[Seed] = Field(None, description="alias of sampling_seed")
    logit_bias: Optional[LogitBiasMap] = Field(None, description="token id -> bias in [-100, 100]")
    json_schema: Optional[str] = Field(None, description="a JSON schema the output must satisfy")
    regex: Optional[str] = Field(None, description="a regular expression the whole output must match")
    ebnf: Optional[str] = Field(None, description="a GBNF / Lark grammar the output must match")
    # SGLang keys accepted at their defaults only (null / empty)
    structural_tag: Optional[str] = None
    stop_regex: Optional[Union[str, List[str]]] = None
    custom_params: Optional[dict] = None

    _default_only = default_only("structural_tag", "stop_regex", "custom_params")


_DEFAULT_ONLY_KEYS = {"structural_tag", "stop_regex", "custom_params"}
IdsOrBatch = Union[List[TokenId], List[List[TokenId]]]
_ONE, _PER_PROMPT = "one", "per_prompt"  # union tags; left out of error locations (validation_message)


def _one_or_list(value: Any) -> str:
    return _PER_PROMPT if isinstance(value, list) else _ONE


def OneOrList(tp):
    """A per-prompt field: one value for every prompt, or a list with one per prompt."""
    return Annotated[Union[Annotated[tp, Tag(_ONE)], Annotated[List[tp], Tag(_PER_PROMPT)]],
                     Discriminator(_one_or_list)]


class GenerateRequest(StrictModel):
    """The /generate body: one prompt, or a batch when ``text`` (or ``input_ids``) is a list of prompts.

    Per-prompt fields (sampling_params, return_logprob, logprob_start_len, top_logprobs_num,
    token_ids_logprob, rid) take one value for the whole batch or a list with one entry per prompt.
    """

    text: Optional[Union[str, List[str]]] = None
    input_ids: Optional[IdsOrBatch] = None
    sampling_params: Optional[OneOrList(SamplingParamsRequest)] = None
    return_logprob: OneOrList(bool) = False
    logprob_start_len: OneOrList(Annotated[int, Field(ge=-1, le=INT32_MAX)]) = Field(
        -1, description="-1: no input logprobs")
    top_logprobs_num: OneOrList(NonNegInt32) = Field(0, description="at most --max-top-logprobs-num (default 20)")
    token_ids_logprob: Optional[IdsOrBatch] = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: Optional[OneOrList(Rid)] = None
    log_metrics: bool = True  # accepted, no effect
    # SGLang GenerateReqInput fields accepted at their defaults only (null / false / empty)
    input_embeds: Optional[Any] = None
    image_data: Optional[Any] = None
    video_data: Optional[Any] = None
    audio_data: Optional[Any] = None
    modalities: Optional[Any] = None
    return_hidden_states: Any = False
    session_params: Optional[Any] = None
    lora_path: Optional[Any] = None
    lora_id: Optional[Any] = None
    custom_logit_processor: Optional[Any] = None
    bootstrap_host: Optional[Any] = None
    bootstrap_port: Optional[Any] = None
    bootstrap_room: Optional[Any] = None
    bootstrap_pair_key: Optional[Any] = None
    data_parallel_rank: Optional[Any] = None
    background: bool = False
    conversation_id: Optional[Any] = None
    priority: Optional[Any] = None
    extra_key: Optional[Any] = None
    no_logs: bool = False
    custom_labels: Optional[Any] = None
    return_bytes: bool = False
    return_entropy: bool = False

    _default_only = default_only("input_embeds", "image_data", "video_data", "audio_data", "modalities",
                                 "return_hidden_states", "session_params", "lora_path", "lora_id",
                                 "custom_logit_processor", "bootstrap_host", "bootstrap_port", "bootstrap_room",
                                 "bootstrap_pair_key", "background", "conversation_id", "priority", "extra_key",
                                 "custom_labels", "return_bytes", "return_entropy")

    @field_validator("data_parallel_rank")
    @classmethod
    def _single_rank(cls, v):
        if v not in (None, 0):
            raise ValueError("data_parallel_rank must be null or 0 (this server has one data-parallel rank)")
        return v

    def to_inputs(self) -> Union[GenerateReqInput, List[GenerateReqInput]]:
        """One GenerateReqInput, or one per prompt of a batch.

        Raises:
            RequestError: neither or both of text / input_ids, an empty batch, or a per-prompt list whose
                length differs from the number of prompts (400).
        """
        if (self.text is None) == (self.input_ids is None):
            raise RequestError("Exactly one of 'text' and 'input_ids' must be given")
        batch = isinstance(self.text, list) or (bool(self.input_ids) and isinstance(self.input_ids[0], list))
        if not batch:
            for name in ("sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "rid"):
                if isinstance(getattr(self, name), list):
                    raise RequestError(f"'{name}' is a list but the request has a single prompt")
            if self.token_ids_logprob and isinstance(self.token_ids_logprob[0], list):
                raise RequestError("'token_ids_logprob' is a list of lists but the request has a single prompt")
            return self._one(self.text, self.input_ids, 0, 1)
        prompts = self.text if self.text is not None else self.input_ids
        if not prompts:
            raise RequestError("Empty batch")
        if isinstance(self.rid, list) and len(set(self.rid)) != len(self.rid):
            raise RequestError("'rid' has duplicate entries: every prompt of a batch needs its own rid")
        return [self._one(p if self.text is not None else None, p if self.input_ids is not None else None, i,
                          len(prompts)) for i, p in enumerate(prompts)]

    def _pick(self, name: str, i: int, n: int):
        v = getattr(self, name)
        per_prompt = isinstance(v, list) and (name != "token_ids_logprob" or (v and isinstance(v[0], list)))
        if not per_prompt:
            return v
        if len(v) != n:
            raise RequestError(f"'{name}' has {len(v)} entries for {n} prompts")
        return v[i]

    def _one(self, text, input_ids, i: int, n: int) -> GenerateReqInput:
        sp = self._pick("sampling_params", i, n)
        rid = self._pick("rid", i, n)
        if isinstance(self.rid, str) and n > 1:
            rid = f"{self.rid}-{i}"
        return GenerateReqInput(
            text=text, input_ids=input_ids,
            sampling_params=None if sp is None else sp.model_dump(exclude_unset=True, exclude=_DEFAULT_ONLY_KEYS),
            return_logprob=self._pick("return_logprob", i, n),
            logprob_start_len=self._pick("logprob_start_len", i, n),
            top_logprobs_num=self._pick("top_logprobs_num", i, n),
            token_ids_logprob=self._pick("token_ids_logprob", i, n),
            return_text_in_logprobs=self.return_text_in_logprobs, stream=self.stream, rid=rid,
        )


class ScoreRequest(StrictModel):
    """The /v1/score body (SGLang's): ``query`` and ``items`` both text or both token ids."""

    query: Optional[Union[str, List[TokenId]]] = None
    items: Optional[Union[str, List[str], List[List[TokenId]]]] = None
    label_token_ids: Optional[List[TokenId]] = None
    apply_softmax: bool = False
    item_first: bool = False
    model: Optional[str] = None
    algorithm: Optional[Literal[ALGORITHMS]] = Field(
        None, description="prefill_extend only on a server started with --enable-scoring-cache")
    rid: Optional[Rid] = None

    def to_input(self) -> ScoreReqInput:
        return ScoreReqInput(**self.model_dump())


class AbortRequest(StrictModel):
    """The /abort_request body: one request by ``rid``, or every request with ``abort_all``."""

    rid: Optional[str] = None
    abort_all: bool = False


def validation_message(errors) -> str:
    """pydantic's error list -> one line naming each bad field: ``"field.sub: message; ..."``."""
    parts = []
    for err in errors:
        if err.get("type") == "json_invalid":  # FastAPI's report of a body orjson refused
            pos = [x for x in err.get("loc", ()) if isinstance(x, int)]
            where = f" (at character {pos[0]})" if pos else ""
            return f"Request body is not valid JSON: {err.get('ctx', {}).get('error', 'decode error')}{where}"
        loc = ".".join(str(x) for x in err.get("loc", ()) if x not in ("body", _ONE, _PER_PROMPT))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "Invalid request: " + "; ".join(parts)

