"""Per-request sampling parameters (SGLang's `SamplingParams` names and defaults)."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Dict, List, Optional, Union

import numpy as np

TOP_LOGPROBS_MAX = 20  # default of --max-top-logprobs-num (OpenAI's limit on top_logprobs)
LOGIT_BIAS_MAX = 100.0  # OpenAI: logit_bias values in [-100, 100]
DEVICE_SEED_LIMIT = 2**31  # device seeds are int32 in [0, 2**31)


@dataclasses.dataclass(frozen=True)
class DeviceRow:
    """How a `SamplingParams` field reaches the sampler: one entry per batch row of a ``dtype`` array in
    ``SamplingBatch.params[name]`` (sampling/sampling_batch.py); rows that pad the batch to its bucket hold
    ``pad`` (a value that changes nothing: greedy, no filter, no penalty)."""

    dtype: Any
    pad: Any


def device_row(default, dtype, pad=None):
    """A `SamplingParams` field whose value the sampler reads on device, per row (see `DeviceRow`); `pad`
    defaults to the field's own default. Declaring a field this way is all batch building and warm-up need:
    the arrays, their padding and the pytree follow from it."""
    return dataclasses.field(default=default, metadata={"device_row": DeviceRow(np.dtype(dtype),
                                                                                default if pad is None else pad)})


def device_rows() -> Dict[str, DeviceRow]:
    """The `SamplingParams` fields the sampler reads on device, by name, with their dtype and padding value."""
    return {f.name: f.metadata["device_row"] for f in dataclasses.fields(SamplingParams) if "device_row" in f.metadata}


def reduce_seed(seed: int) -> int:
    """A request seed (any integer; the edge accepts int64 and uint64) -> the device's int32 seed.

    Seeds in [0, 2**31) are used as they are, so small seeds keep their streams. Any other value is
    hashed: the BLAKE2b-64 digest of its 16-byte little-endian two's-complement form (after reduction
    modulo 2**128), taken modulo 2**31. Deterministic across processes and machines, and never an
    overflow: 2**31, 2**63 and -1 each get their own valid seed.
    """
    if 0 <= seed < DEVICE_SEED_LIMIT:
        return seed
    raw = (seed % 2**128).to_bytes(16, "little")
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") % DEVICE_SEED_LIMIT


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request and when to stop.

    max_new_tokens: tokens to generate at most (None: up to the context length).
    min_new_tokens: EOS is masked and stop conditions are ignored until this many tokens exist.
    stop: stop strings (the output is cut before the first match unless no_stop_trim).
    stop_token_ids: extra token ids that end generation.
    temperature: 0 for greedy. top_p in (0, 1]. top_k: -1 (or 0) disables. min_p in [0, 1]. typical_p in (0, 1]:
    locally typical sampling (Meister et al. 2022; transformers' / TGI's ``typical_p``), 1 = off.
    frequency_penalty / presence_penalty: subtracted from a token's logit per occurrence in the output / once
    if it occurs in the output (OpenAI, SGLang; in [-2, 2]). repetition_penalty: logits of tokens in the
    prompt or output are divided by it when positive, multiplied when negative (CTRL, Keskar et al. 2019;
    1 = off). logit_bias: token id -> value added to its logit (OpenAI, in [-100, 100]).
    json_schema / regex / ebnf: the output must match this grammar (at most one; see constrained/).
    ignore_eos: keep generating past EOS. sampling_seed: per-request seed (also accepted as ``seed``),
    reduced to the device's width by `reduce_seed` in `normalize`.

    The fields declared with `device_row` (temperature, top_p, top_k, min_p, typical_p and the penalties) reach the sampler
    as per-row arrays of the same name (`sampling_batch.SamplingBatch.params`): adding such a field takes the
    protocols, this dataclass and layers/sampler.py, nothing else.

    Types and single-field ranges are checked at the edge (``entrypoints/native_protocol.py`` and the
    OpenAI protocol); `verify` checks what needs the model (vocabulary) or several fields at once.
    """

    max_new_tokens: Optional[int] = 128
    min_new_tokens: int = 0
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    temperature: float = device_row(1.0, np.float32, pad=0.0)  # padding rows are greedy
    top_p: float = device_row(1.0, np.float32)
    top_k: int = device_row(-1, np.int32)
    min_p: float = device_row(0.0, np.float32)
    typical_p: float = device_row(1.0, np.float32)
    frequency_penalty: float = device_row(0.0, np.float32)
    presence_penalty: float = device_row(0.0, np.float32)
    repetition_penalty: float = device_row(1.0, np.float32)
    logit_bias: Optional[Dict[int, float]] = None
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: Optional[int] = None

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "SamplingParams":
        """Build from a validated request's ``sampling_params`` (``seed`` is an alias of ``sampling_seed``).

        Raises:
            ValueError: unknown keys (reported as HTTP 400).
        """
        d = {k: v for k, v in (d or {}).items() if v is not None or k in ("max_new_tokens",)}
        if "seed" in d:
            seed = d.pop("seed")
            d.setdefault("sampling_seed", seed)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"Unknown sampling parameters: {unknown}")
        return cls(**d)

    def verify(self, vocab_size: int) -> None:
        """Check what the edge cannot: cross-field rules and the vocabulary. Raises ValueError naming the
        parameter."""
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) must not exceed max_new_tokens "
                             f"({self.max_new_tokens})")
        for t, bias in (self.logit_bias or {}).items():
            if not 0 <= int(t) < vocab_size:
                raise ValueError(f"logit_bias key {t} is outside the vocabulary [0, {vocab_size})")
            if not -LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX:
                raise ValueError(f"logit_bias value {bias} for token {t} is outside [-100, 100]")
        from sgl_jax.srt.constrained.grammar_backend import grammar_spec, validate_grammar

        spec = grammar_spec(self)
        if spec is not None:
            validate_grammar(*spec)
        for t in self.stop_token_ids or []:
            if not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids entry {t} is outside the vocabulary [0, {vocab_size})")

    def normalize(self, vocab_size: Optional[int] = None) -> None:
        """Canonical forms: stop as a list, top_k 0 (or >= the vocabulary) -> -1, greedy when temperature
        is ~0, the seed reduced to the device's int32 (`reduce_seed`)."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0 or (vocab_size is not None and self.top_k >= vocab_size):
            self.top_k = -1
        if self.temperature < 1e-6:
            self.temperature = 0.0
        if self.sampling_seed is not None:
            self.sampling_seed = reduce_seed(self.sampling_seed)
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items() if float(v) != 0.0} or None

    def filters(self) -> bool:
        """Whether the request samples from a filtered distribution (`sampling_filters` of its fields): its decode
        steps need the sampler's filtering branch (forward_batch.DecodeRows.filtering)."""
        return sampling_filters(self.temperature, self.top_p, self.top_k, self.min_p, self.typical_p)

    def uses_penalties(self) -> bool:
        """Whether sampling needs the request's token history or bias (the penalty state on device)."""
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias))


def sampling_filters(temperature, top_p, top_k, min_p, typical_p):
    """Whether rows sample with top-k, top-p, min-p or typical-p filtering: not greedy (temperature > 0 and top_k
    not 1) and some filter on (top_p < 1, top_k > 1, min_p > 0, typical_p < 1). Elementwise: numbers give a bool,
    numpy arrays a bool array. The host's side of layers/sampler.sample's ``filters``, never narrower: a top_k at or
    above the vocabulary (which `SamplingParams.normalize` makes -1) and parameters that round to "off" in float32
    count as filtering here."""
    return (temperature > 0) & (top_k != 1) & ((top_p < 1) | (top_k > 1) | (min_p > 0) | (typical_p < 1))


class ContextLengthExceeded(ValueError):
    """An explicit max_new_tokens that does not fit the context with its input (`clip_max_new_tokens`)."""


def clip_max_new_tokens(num_input: int, max_new_tokens: Optional[int], limit: int, truncate: bool,
                        input_desc: str = "from the input") -> Optional[int]:
    """SGLang's rule for max_new_tokens against the context: an explicit limit (not None) with
    `num_input` + it > `limit` tokens is refused, or with `truncate` (--allow-auto-truncate; the scheduler's own
    KV room) clipped to `limit` - `num_input`; any other value, None included (up to the context), is returned as
    it is. `input_desc` says where the input tokens come from in the error.

    Raises:
        ContextLengthExceeded: the explicit limit does not fit and `truncate` is False; its message names both
            counts and the limit (the text of upstream's 400).
    """
    if max_new_tokens is None or num_input + max_new_tokens <= limit:
        return max_new_tokens
    if truncate:
        return limit - num_input
    raise ContextLengthExceeded(
        f"Requested token count exceeds the model's maximum context length of {limit} tokens. You requested a "
        f"total of {num_input + max_new_tokens} tokens: {num_input} tokens {input_desc} and {max_new_tokens} "
        "tokens for the completion (max_new_tokens / max_tokens). Reduce either, or omit the limit to generate up "
        "to the context length.")
