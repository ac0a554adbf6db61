"""Helpers shared by the OpenAI endpoints: request -> sampling params, errors, the SSE stream (the HTTP helpers
every API uses are in routes/common.py)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import AsyncIterator, Optional

from fastapi.responses import Response

from sgl_jax.srt.entrypoints.error_bodies import openai_error_body
from sgl_jax.srt.entrypoints.field_types import logit_bias_ids
from sgl_jax.srt.entrypoints.routes.common import SSE_DONE, json_response, sse
from sgl_jax.srt.errors import RequestError
from sgl_jax.srt.sampling.sampling_params import SamplingParams


def openai_error(message: str, status_code: int = 400, param: Optional[str] = None) -> Response:
    """An OpenAI error response (error_bodies.openai_error_body: OpenAI's nested error object with SGLang's
    top-level fields beside it)."""
    return json_response(openai_error_body(message, status_code, param), status_code)


def error_event(e: RequestError) -> bytes:
    """The SSE event of an error after an OpenAI stream started: OpenAI's error object (the official SDKs raise
    an APIError with its message when an event carries ``error``)."""
    return sse(openai_error_body(e.message, e.status_code, e.param))


async def sse_stream(chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """An OpenAI SSE stream of `chunks`: ``data: <chunk>`` events, an error event if the work fails after the
    stream started, then ``data: [DONE]``. Closing it closes `chunks` (which aborts their requests)."""
    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                yield sse(chunk)
        except RequestError as e:
            yield error_event(e)
    yield SSE_DONE


def finish_reason_str(fr: Optional[dict]) -> Optional[str]:
    """SGLang's finish_reason object -> OpenAI's string ("stop", "length", "abort")."""
    if fr is None:
        return None
    return fr.get("type")


def lora_of(tm, req) -> Optional[str]:
    """The LoRA adapter an OpenAI request asks for, as SGLang reads it: ``model: "<base>:<adapter>"`` (split at the
    first colon), ``model: "<adapter>"`` (a loaded adapter's name), else SGLang's ``lora_path`` field (a one-entry
    list counts as its entry); the adapter in ``model`` wins. None: the base model. Without --enable-lora the
    model name is not read (any name is served).

    Raises:
        RequestError: 400 naming the adapter when it is not loaded (or the server has no LoRA), or a lora_path list
            of more than one entry.
    """
    explicit = req.lora_path
    if isinstance(explicit, list):
        if len(explicit) > 1:
            raise RequestError(f"lora_path has {len(explicit)} entries; an OpenAI request takes one",
                               param="lora_path")
        explicit = explicit[0] if explicit else None
    adapter, model = None, getattr(req, "model", None)
    if model and tm.lora_adapters is not None and model != tm.served_model_name:
        if ":" in model:
            adapter = model.split(":", 1)[1].strip() or None
            if adapter is not None and adapter not in tm.lora_adapters:
                raise RequestError(f"The model '{model}' names LoRA adapter '{adapter}', which is not loaded; "
                                   f"loaded adapters: {sorted(tm.lora_adapters)}", param="model")
        elif model in tm.lora_adapters:
            adapter = model
    adapter = adapter or explicit
    tm.check_lora(adapter)
    return adapter


def session_params_of(req, num_sequences: int) -> Optional[dict]:
    """The request's ``session_params`` (SGLang's extension) as the TokenizerManager takes them, or None.

    Raises:
        RequestError: 400 -- session_params with more than one sequence (n, best_of or several prompts): a
            session's turn is one sequence.
    """
    if req.session_params is None:
        return None
    if num_sequences != 1:
        raise RequestError(f"session_params applies to one sequence; this request asks for {num_sequences}")
    return req.session_params.model_dump()


# SamplingParams fields an OpenAI request carries under the same name, copied as they are (a new sampling field
# declared in both places flows through); the others are converted by sampling_params_from: n (choices, not
# sampling), the grammars, logit_bias (keys to ids), max_new_tokens (max_tokens / max_completion_tokens),
# min_new_tokens (min_tokens) and sampling_seed (seed, offset per choice).
_SAME_NAME_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams)
                          if f.name not in ("n", "json_schema", "regex", "ebnf", "logit_bias", "max_new_tokens",
                                            "min_new_tokens", "sampling_seed"))


def sampling_params_from(req, max_tokens: Optional[int], seed_offset: int = 0) -> dict:
    """Native sampling params from a validated OpenAI request (completions or chat; field types and ranges
    are checked by its pydantic model), as SGLang's ``to_sampling_params``: ``response_format`` json_object /
    json_schema becomes the ``json_schema`` grammar, logit_bias keys become token ids, and the seed of choice k
    is ``seed + k`` (so the n choices differ).

    Raises:
        RequestError: more than one grammar (response_format, json_schema, regex, ebnf), naming them.
    """
    grammars = {k: getattr(req, k) for k in ("json_schema", "regex", "ebnf") if getattr(req, k) is not None}
    given = list(grammars)
    schema = req.response_format.to_json_schema() if req.response_format is not None else None
    if schema is not None:
        grammars["json_schema"] = schema
        given.append(f"response_format ({req.response_format.type})")
    if len(given) > 1:
        raise RequestError(f"Only one of response_format (json_object / json_schema), json_schema, regex and ebnf "
                           f"may be given, got {', '.join(given)}")
    same_name = {name: getattr(req, name) for name in _SAME_NAME_FIELDS if name in type(req).model_fields}
    return {
        **same_name,
        **grammars,
        "logit_bias": logit_bias_ids(req.logit_bias),
        "max_new_tokens": max_tokens,
        "min_new_tokens": req.min_tokens,
        "sampling_seed": None if req.seed is None else req.seed + seed_offset,
    }


def check_top_logprobs(name: str, value: Optional[int], cap: int) -> None:
    """Raises RequestError when `value` (OpenAI's logprobs / top_logprobs) exceeds --max-top-logprobs-num."""
    if value is not None and value > cap:
        raise RequestError(f"{name} ({value}) exceeds the limit of {cap} (--max-top-logprobs-num)")


def check_n(name: str, value: Optional[int], cap: int) -> None:
    """Raises RequestError (400) when `value` (OpenAI's n or best_of, /generate's sampling n: sequences per
    prompt) exceeds --max-n (default 128, OpenAI's limit)."""
    if value is not None and value > cap:
        raise RequestError(f"{name} ({value}) exceeds this server's limit of {cap} sequences per prompt (--max-n)")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
