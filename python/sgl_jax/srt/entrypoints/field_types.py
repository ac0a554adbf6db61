"""Field types every request model is built from: the range of each value is the range of what it becomes.

Requests are validated once, at the edge, against the types their values take on device: token ids,
counts and top_k become int32, sampling floats become float32, seeds are 64-bit integers that are reduced
to the device's width by `sgl_jax.srt.sampling.sampling_params.reduce_seed`. What crosses the ZMQ line
after that is trusted. Every model is strict (no bool where an int is expected, no "3" for 3) and the JSON
body is parsed by orjson, which refuses NaN, Infinity and lone UTF-16 surrogates, so every string that
reaches the tokenizer is valid Unicode.

The constraints are pydantic ``Field`` metadata, so ``/openapi.json`` states each field's type and range.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import typing
from typing import Annotated, Any, Dict, List, Optional, Set, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from sgl_jax.srt.sampling.sampling_params import SamplingParams

INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max
SEED_MIN = -(2**63)  # int64 (OpenAI, vLLM) ...
SEED_MAX = 2**64 - 1  # ... and uint64 (SGLang) seeds are both accepted
MAX_N = 4096  # the most --max-n may allow (its default is OpenAI's limit, 128; the server checks its own)
RID_MAX_LEN = 256

Int32 = Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX)]
NonNegInt32 = Annotated[int, Field(ge=0, le=INT32_MAX)]
PosInt32 = Annotated[int, Field(ge=1, le=INT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX, description="a token id (checked against the vocabulary)")]
Float32 = Annotated[float, Field(ge=-FLOAT32_MAX, le=FLOAT32_MAX, allow_inf_nan=False)]
NonNegFloat32 = Annotated[float, Field(ge=0.0, le=FLOAT32_MAX, allow_inf_nan=False)]
Probability = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]  # OpenAI's frequency/presence range
PosFloat32 = Annotated[float, Field(gt=0.0, le=FLOAT32_MAX, allow_inf_nan=False)]
# SGLang's SamplingParams.verify: repetition_penalty in (0, 2] (1 = off)
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=2.0, allow_inf_nan=False, description="(0, 2]; 1: off")]
LogitBias = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]  # OpenAI's range


# logit_bias maps a token id (a JSON object key, hence a decimal string, as OpenAI and SGLang send it) to a
# bias; `logit_bias_ids` gives the engine's int keys (their range against the vocabulary is checked by
# SamplingParams.verify)
LogitBiasMap = Annotated[Dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")], LogitBias],
                         Field(description="token id (a decimal string) -> bias in [-100, 100]")]


def logit_bias_ids(bias: Optional[Dict[str, float]]) -> Optional[Dict[int, float]]:
    """A validated `LogitBiasMap` with int token ids as keys (None stays None)."""
    return None if bias is None else {int(k): v for k, v in bias.items()}
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX, description="64-bit seed (int64 or uint64)")]
NumChoices = Annotated[int, Field(ge=1, le=MAX_N)]
# A request id: printable, no '/' (the scheduler derives the ids of a request's parts as "<rid>/<part>").
Rid = Annotated[str, Field(min_length=1, max_length=RID_MAX_LEN, pattern=r"^[^/\x00-\x1f\x7f]+$")]
# SGLang's per-request-or-per-prompt optional fields (lora_path, bootstrap_host, ...)
StrOrList = Optional[Union[str, List[Optional[str]]]]
IntOrList = Optional[Union[int, List[Optional[int]]]]


# ---------------------------------------------------------------- fields of the upstream schemas
# SGLang's and OpenAI's request schemas have fields this server has no engine support for. Each is declared
# (so /openapi.json lists it and a client sending it at its default is served) with one of two markers:
#   default_only(...): accepted only at its default (null, the default value, or an empty list/object/string);
#                      any other value answers HTTP 400 naming the field, never silently ignored.
#   ignored(...):      accepted at any (well-typed) value and ignored: it does not change the output (telemetry,
#                      routing, scheduling or caching hints).


@dataclasses.dataclass(frozen=True)
class DefaultOnly:
    """Marker (in a field's ``Annotated`` metadata) of a field accepted only at one of `accepted`."""

    accepted: tuple


@dataclasses.dataclass(frozen=True)
class Ignored:
    """Marker of a field accepted at any value and ignored; `why` says why that is harmless."""

    why: str


def is_default(value: Any, accepted: tuple) -> bool:
    """Whether `value` means the field's default: null, one of `accepted`, an empty string / list / object (when
    null is accepted), or a list (one entry per prompt) whose every entry does."""
    if value is None or any(value is a or (type(value) is type(a) and value == a) for a in accepted):
        return True
    if None in accepted and isinstance(value, (str, list, dict)) and not value:
        return True
    return isinstance(value, list) and all(is_default(v, accepted) for v in value)


def _refuse_unless_default(value: Any, accepted: tuple) -> Any:
    if is_default(value, accepted):
        return value
    shown = [json.dumps(a) for a in accepted]
    shown = ", ".join(shown[:-1]) + " or " + shown[-1] if len(shown) > 1 else shown[0]
    raise PydanticCustomError("unsupported", "not supported by this server (only {shown} is accepted)",
                              {"shown": shown})


def default_only(tp, *accepted, description: str = "") -> Any:
    """`tp`, accepted only at one of `accepted` (default: null) -- a field of SGLang's or OpenAI's schema this
    server cannot honour. Any other value fails validation (HTTP 400 naming the field)."""
    accepted = accepted or (None,)
    note = "accepted only at its default; other values answer 400"
    return Annotated[tp, AfterValidator(functools.partial(_refuse_unless_default, accepted=accepted)),
                     DefaultOnly(accepted), Field(description=f"{description}; {note}" if description else note)]


def ignored(tp, why: str) -> Any:
    """`tp`, accepted at any value and ignored (`why`: why that does not change the output)."""
    return Annotated[tp, Ignored(why), Field(description=f"accepted and ignored: {why}")]


def marked_fields(model: type, marker: type) -> Set[str]:
    """Names of `model`'s fields carrying `marker` (`DefaultOnly` or `Ignored`) in their metadata."""
    return {name for name, f in model.model_fields.items() if any(isinstance(m, marker) for m in f.metadata)}


def _admits_null(annotation) -> bool:
    return annotation is Any or type(None) in typing.get_args(annotation)


class NullMeansDefault(BaseModel):
    """Mixin: ``null`` for a field whose type has no null means the field's default, as in SGLang (its
    SamplingParams maps None to the default; its OpenAI protocol declares sampling fields Optional) and in
    OpenAI's spec (most request fields are nullable). A field whose type admits null keeps it (its own
    meaning, e.g. ``max_new_tokens: null`` = up to the context); a required field stays required."""

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if not (v is None and k in fields and not fields[k].is_required()
                        and not _admits_null(fields[k].annotation))}


class SessionParamsRequest(BaseModel):
    """``session_params`` (SGLang's SessionParams): the session `id`, the turn it continues (`rid`), and how
    (see scheduler/sessions.py). Unknown keys: 400."""

    model_config = ConfigDict(strict=True, extra="forbid")

    id: Rid
    rid: Optional[Rid] = None
    offset: Optional[Annotated[int, Field(ge=-INT32_MAX, le=INT32_MAX)]] = None
    replace: Optional[bool] = None
    drop_previous_output: Optional[bool] = None


class SGLangSharedFields(BaseModel):
    """Fields SGLang's ``GenerateReqInput`` and its OpenAI requests both carry: ``session_params`` (sessions),
    and those this engine has no support for (accepted only at their defaults) or ignores: declared once,
    mixed into the native and OpenAI models."""

    session_params: Optional[SessionParamsRequest] = None
    lora_path: StrOrList = Field(None, description="the LoRA adapter to serve the request with (a loaded adapter's "
                                 "name; a list: one per prompt; null: the base model)")
    custom_logit_processor: default_only(StrOrList, description="custom logit processors") = None
    bootstrap_host: default_only(StrOrList, description="prefill-decode disaggregation") = None
    bootstrap_port: default_only(IntOrList, description="prefill-decode disaggregation") = None
    bootstrap_room: default_only(IntOrList, description="prefill-decode disaggregation") = None
    disagg_prefill_dp_rank: default_only(Optional[int], description="prefill-decode disaggregation") = None
    routed_dp_rank: default_only(Optional[int], None, 0, description="this server has one data-parallel rank") = None
    data_parallel_rank: default_only(Optional[int], None, 0,
                                     description="deprecated alias of routed_dp_rank; one rank") = None
    extra_key: default_only(StrOrList, description="prefix-cache isolation") = None
    cache_salt: default_only(StrOrList, description="prefix-cache isolation") = None
    return_routed_experts: default_only(bool, False, description="MoE routing (native /generate only)") = False
    routed_experts_start_len: default_only(int, 0, description="MoE routing") = 0
    session_id: ignored(Optional[str], "a session identity for routing and tracking; the prompt is unchanged") = None
    priority: ignored(Optional[int], "no priority scheduling (SGLang ignores it too without "
                                     "--enable-priority-scheduling)") = None
    custom_labels: ignored(Optional[Dict[str, str]], "metric labels") = None


class TruncationFields(BaseModel):
    """The sampling filters every served API names and bounds alike: ``min_p`` (SGLang's: keep tokens with at least
    min_p x the top probability) and ``typical_p`` (transformers' / TGI's locally typical mass). Declared once and
    mixed into the native, OpenAI and Ollama request models; a translation between APIs copies every field of this
    model (`truncation_values`). Their defaults are SamplingParams'."""

    min_p: Probability = Field(SamplingParams.min_p, description="keep tokens with at least min_p x the top "
                                                                 "probability; 0: off")
    typical_p: TopP = Field(SamplingParams.typical_p, description="locally typical sampling mass (transformers' / "
                                                                   "TGI's typical_p); 1: off")


def truncation_values(request: TruncationFields) -> Dict[str, float]:
    """{field: value} of `request`'s `TruncationFields`, to pass to another API's request model."""
    return {k: getattr(request, k) for k in TruncationFields.model_fields}


class StrictModel(BaseModel):
    """Base of the native request models: strict types, unknown fields refused (HTTP 400 naming them)."""

    model_config = ConfigDict(strict=True, extra="forbid")


class LenientModel(BaseModel):
    """Base of the OpenAI request models: strict types, unknown fields ignored (as OpenAI-compatible
    servers, SGLang's included, do)."""

    model_config = ConfigDict(strict=True, extra="ignore")
