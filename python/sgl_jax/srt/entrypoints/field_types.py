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

from typing import Annotated, Dict

from pydantic import BaseModel, ConfigDict, Field

INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max
SEED_MIN = -(2**63)  # int64 (OpenAI, vLLM) ...
SEED_MAX = 2**64 - 1  # ... and uint64 (SGLang) seeds are both accepted
MAX_N = 128  # OpenAI's limit on `n`
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
LogitBias = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]  # OpenAI's range
# logit_bias maps a token id (a JSON object key, hence a string) to a bias
LogitBiasMap = Dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")], LogitBias]
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX, description="64-bit seed (int64 or uint64)")]
NumChoices = Annotated[int, Field(ge=1, le=MAX_N)]
# A request id: printable, no '/' (the scheduler derives the ids of a request's parts as "<rid>/<part>").
Rid = Annotated[str, Field(min_length=1, max_length=RID_MAX_LEN, pattern=r"^[^/\x00-\x1f\x7f]+$")]


class StrictModel(BaseModel):
    """Base of the native request models: strict types, unknown fields refused (HTTP 400 naming them)."""

    model_config = ConfigDict(strict=True, extra="forbid")


class LenientModel(BaseModel):
    """Base of the OpenAI request models: strict types, unknown fields ignored (as OpenAI-compatible
    servers, SGLang's included, do)."""

    model_config = ConfigDict(strict=True, extra="ignore")
