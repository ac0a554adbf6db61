"""Request bodies of SGLang's native API (/generate, /v1/score, /abort_request) as pydantic models.

Field names and meanings follow SGLang's ``GenerateReqInput``, ``SamplingParams`` and ``ScoringRequest``;
each field's type carries its range (see `field_types`), so a value out of range answers HTTP 400 naming
the field, and ``/openapi.json`` documents it. The HTTP server and the offline `Engine` validate through
these same models, then hand the managers plain dataclasses (`GenerateReqInput`, `ScoreReqInput`).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import Discriminator, Field, Tag

from sgl_jax.srt.entrypoints.field_types import (
    INT32_MAX,
    DefaultOnly,
    Ignored,
    IntOrList,
    LogitBiasMap,
    NonNegFloat32,
    NonNegInt32,
    NullMeansDefault,
    SGLangSharedFields,
    NumChoices,
    Penalty,
    PosInt32,
    RepetitionPenalty,
    Rid,
    Seed,
    StrictModel,
    StrOrList,
    TokenId,
    TopP,
    TruncationFields,
    default_only,
    ignored,
    logit_bias_ids,
    marked_fields,
)
from sgl_jax.srt.errors import RequestError
from sgl_jax.srt.io_struct import LoadLoRAAdapterReqInput, OpenSessionReqInput, UnloadLoRAAdapterReqInput
from sgl_jax.srt.tokenizer.score_request import ALGORITHMS, ScoreReqInput
from sgl_jax.srt.tokenizer.tokenizer_manager import GenerateReqInput
from sgl_jax.srt.sampling.sampling_params import SamplingParams

_SP = SamplingParams()  # defaults come from the one dataclass
_ENGINE_KEYS = {f.name for f in dataclasses.fields(SamplingParams)} | {"seed"}  # what SamplingParams.from_dict takes


class SamplingParamsRequest(NullMeansDefault, TruncationFields, StrictModel):
    """``sampling_params`` of /generate: every key of SGLang's ``SamplingParams``
    (python/sglang/srt/sampling/sampling_params.py), plus ``seed`` (an alias of ``sampling_seed``).

    As upstream, ``null`` for any key means its default (``max_new_tokens: null``: up to the context). The keys
    this engine has no support for (stop_regex, structural_tag, custom_params) are accepted only at their
    defaults (400 naming the key otherwise); stream_interval is accepted and ignored. Unknown keys: 400.
    """

    max_new_tokens: Optional[NonNegInt32] = Field(_SP.max_new_tokens, description="null: up to the context length")
    min_new_tokens: NonNegInt32 = _SP.min_new_tokens
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[TokenId]] = None
    temperature: NonNegFloat32 = _SP.temperature
    top_p: TopP = _SP.top_p
    top_k: int = Field(_SP.top_k, ge=-1, le=INT32_MAX, description="-1 or 0: disabled")
    frequency_penalty: Penalty = _SP.frequency_penalty
    presence_penalty: Penalty = _SP.presence_penalty
    repetition_penalty: RepetitionPenalty = _SP.repetition_penalty
    ignore_eos: bool = _SP.ignore_eos
    skip_special_tokens: bool = _SP.skip_special_tokens
    spaces_between_special_tokens: bool = _SP.spaces_between_special_tokens
    no_stop_trim: bool = _SP.no_stop_trim
    n: NumChoices = Field(_SP.n, description="samples per prompt (the response is a list of them, prompt-major)")
    sampling_seed: Optional[Seed] = None
    seed: Optional[Seed] = Field(None, description="alias of sampling_seed")
    logit_bias: Optional[LogitBiasMap] = None
    json_schema: Optional[str] = Field(None, description="a JSON schema the output must satisfy")
    regex: Optional[str] = Field(None, description="a regular expression the whole output must match")
    ebnf: Optional[str] = Field(None, description="a GBNF / Lark grammar the output must match")
    # SGLang keys this engine has no support for
    stop_regex: default_only(Optional[Union[str, List[str]]], description="stop regular expressions") = None
    structural_tag: default_only(Optional[str], description="structural-tag constrained decoding") = None
    custom_params: default_only(Optional[Dict[str, Any]], description="custom logit processor parameters") = None
    stream_interval: ignored(Optional[PosInt32], "a stream carries each token as it is detokenized") = None

    def to_engine_dict(self, drop_n: bool = False) -> dict:
        """The keys the client set, as `SamplingParams.from_dict` takes them: nulls (other than max_new_tokens)
        and the keys accepted at their defaults only or ignored left out; ``n`` left out with `drop_n` (a
        request expanded into its n samples)."""
        skip = marked_fields(type(self), DefaultOnly) | marked_fields(type(self), Ignored) | ({"n"} if drop_n else set())
        d = self.model_dump(exclude_unset=True, exclude=skip)
        assert set(d) <= _ENGINE_KEYS, set(d) - _ENGINE_KEYS  # every other key is marked (test_request_validation)
        if "logit_bias" in d:
            d["logit_bias"] = logit_bias_ids(d["logit_bias"])
        return {k: v for k, v in d.items() if v is not None or k == "max_new_tokens"}


IdsOrBatch = Union[List[TokenId], List[List[TokenId]]]
_ONE, _PER_PROMPT = "one", "per_prompt"  # union tags; left out of error locations (validation_message)


def _one_or_list(value: Any) -> str:
    return _PER_PROMPT if isinstance(value, list) else _ONE


def OneOrList(tp):
    """A per-prompt field: one value for every prompt, or a list with one per prompt."""
    return Annotated[Union[Annotated[tp, Tag(_ONE)], Annotated[List[tp], Tag(_PER_PROMPT)]],
                     Discriminator(_one_or_list)]


class GenerateRequest(NullMeansDefault, SGLangSharedFields, StrictModel):
    """The /generate body: one prompt, or a batch when ``text`` (or ``input_ids``) is a list of prompts.

    Every field of SGLang's ``GenerateReqInput`` (python/sglang/srt/managers/io_struct.py) is declared, and
    ``null`` means a field's default, as upstream. Per-prompt fields (sampling_params, return_logprob,
    logprob_start_len, top_logprobs_num, token_ids_logprob, rid, return_routed_experts) take one value for the
    whole batch or a list with one entry per prompt. ``sampling_params.n`` > 1 expands each prompt into n
    samples, as upstream: the response is then a list (prompt-major: the n samples of the first prompt, then
    the second's, ...). Fields this engine has no support for (multimodal input, LoRA, disaggregation, hidden
    states, ...) are accepted only at their defaults (400 naming the field otherwise); telemetry and routing
    hints are accepted and ignored. Unknown fields: 400 (stricter than upstream, which drops them).
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
    return_routed_experts: OneOrList(bool) = Field(
        False, description="the expert ids of every mixture-of-experts layer for each output token, in "
                           "meta_info.routed_experts (base64 int32 [tokens, layers, top-k]); needs "
                           "--enable-return-routed-experts")

    # ---- accepted and ignored: they do not change what is generated or returned
    model: ignored(Optional[str], "the server serves one model (sglang-router adds it)") = None
    log_metrics: ignored(bool, "metrics count every request") = True
    conversation_id: ignored(Optional[str], "a tracking id") = None
    routing_key: ignored(Optional[str], "one server: nothing to route") = None
    external_trace_header: ignored(Optional[Dict[str, Any]], "no request tracing") = None
    received_time: ignored(Optional[float], "the server times requests itself") = None
    kv_router_hint: ignored(Optional[Dict[str, Any]], "a KV-placement hint for a disaggregated cache") = None

    # ---- accepted only at their defaults: no engine support
    input_embeds: default_only(Optional[List[Any]], description="prompt embeddings") = None
    image_data: default_only(Optional[Any], description="multimodal input") = None
    video_data: default_only(Optional[Any], description="multimodal input") = None
    audio_data: default_only(Optional[Any], description="multimodal input") = None
    mm_hashes: default_only(Optional[List[Any]], description="multimodal input") = None
    mm_content_hashes: default_only(Optional[List[Any]], description="multimodal input") = None
    use_audio_in_video: default_only(bool, False, description="multimodal input") = False
    video_config: default_only(Optional[Dict[str, Any]], description="multimodal input") = None
    modalities: default_only(Optional[List[Optional[str]]], description="multimodal input") = None
    max_dynamic_patch: default_only(Optional[int], description="multimodal input") = None
    min_dynamic_patch: default_only(Optional[int], description="multimodal input") = None
    image_max_dynamic_patch: default_only(Optional[int], description="multimodal input") = None
    video_max_dynamic_patch: default_only(Optional[int], description="multimodal input") = None
    images_config: default_only(Optional[Dict[str, Any]], description="multimodal input") = None
    need_wait_for_mm_inputs: default_only(Optional[bool], None, False, description="multimodal input") = None
    num_items_assigned: default_only(Optional[Dict[str, Any]], description="multimodal input") = None
    encoder_urls: default_only(Optional[List[str]], description="multimodal input") = None
    positional_embed_overrides: default_only(Optional[Any], description="embedding overrides") = None
    lora_id: default_only(StrOrList, description="LoRA adapters") = None
    bootstrap_pair_key: default_only(StrOrList, description="prefill-decode disaggregation") = None
    decode_tp_size: default_only(IntOrList, description="prefill-decode disaggregation") = None
    http_worker_ipc: default_only(Optional[str], description="internal to SGLang's multi-tokenizer mode") = None
    background: default_only(bool, False, description="background responses") = False
    require_reasoning: default_only(bool, False, description="hybrid reasoning models") = False
    max_thinking_tokens: default_only(Optional[int], description="thinking budgets") = None
    no_logs: default_only(bool, False, description="per-request logging control (--log-requests logs every "
                                                   "request's sampling parameters)") = False
    return_hidden_states: default_only(Any, False, description="hidden states") = False
    return_indexer_topk: default_only(bool, False, description="sparse-attention indexer output") = False
    return_bytes: default_only(bool, False, description="image generation") = False
    return_entropy: default_only(bool, False, description="output entropy") = False
    return_prompt_token_ids: default_only(bool, False, description="prompt token ids in meta_info") = False
    return_sampling_mask: default_only(Optional[Union[bool, List[bool]]], None, False,
                                       description="sampling support masks") = None
    return_flat_raw_top_logprobs: default_only(bool, False, description="flat prompt top-logprob arrays") = False
    return_flat_raw_top_logprobs_b64: default_only(bool, False, description="flat prompt top-logprob arrays") = False
    multi_item_delimiter_indices: default_only(Optional[List[Any]], description="use /v1/score for multi-item "
                                                                              "scoring") = None

    def to_inputs(self) -> Union[GenerateReqInput, List[GenerateReqInput]]:
        """One GenerateReqInput, or a list: one per prompt of a batch and per sample (``sampling_params.n``).

        Raises:
            RequestError: neither or both of text / input_ids, an empty batch, a per-prompt list whose length
                differs from the number of prompts, or prompts of one batch with different n (SGLang's rule)
                (400). Derived rids ("<rid>-<k>") stay distinct: each is a distinct rid plus one number.
        """
        if (self.text is None) == (self.input_ids is None):
            raise RequestError("Exactly one of 'text' and 'input_ids' must be given")
        batch = isinstance(self.text, list) or (bool(self.input_ids) and isinstance(self.input_ids[0], list))
        if not batch:
            for name in ("sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "rid",
                         "return_routed_experts"):
                if isinstance(getattr(self, name), list):
                    raise RequestError(f"'{name}' is a list but the request has a single prompt")
            if self.token_ids_logprob and isinstance(self.token_ids_logprob[0], list):
                raise RequestError("'token_ids_logprob' is a list of lists but the request has a single prompt")
            prompts = [self.text if self.text is not None else self.input_ids]
        else:
            prompts = self.text if self.text is not None else self.input_ids
            if not prompts:
                raise RequestError("Empty batch")
            if isinstance(self.rid, list) and len(set(self.rid)) != len(self.rid):
                raise RequestError("'rid' has duplicate entries: every prompt of a batch needs its own rid")
        n = self._samples_per_prompt()
        if self.session_params is not None and (batch or n != 1):
            raise RequestError("session_params applies to a single prompt and sample (a session's turn is one "
                               "sequence)")
        if not batch and n == 1:
            return self._one(self.text, self.input_ids, 0, 1, 0, 1)
        return [self._one(p if self.text is not None else None, p if self.input_ids is not None else None, i,
                          len(prompts), j, n) for i, p in enumerate(prompts) for j in range(n)]

    def samples_per_prompt(self) -> int:
        """Sequences per prompt (sampling_params.n; every prompt of a batch must ask for the same n).

        Raises:
            RequestError: prompts of a batch ask for different n.
        """
        return self._samples_per_prompt()

    def _samples_per_prompt(self) -> int:
        sp = self.sampling_params
        ns = {s.n for s in sp} if isinstance(sp, list) else {1 if sp is None else sp.n}
        if len(ns) > 1:
            raise RequestError("'sampling_params': every prompt of a batch must have the same n")
        return ns.pop() if ns else 1

    def _pick(self, name: str, i: int, n: int):
        v = getattr(self, name)
        per_prompt = isinstance(v, list) and (name != "token_ids_logprob" or (v and isinstance(v[0], list)))
        if not per_prompt:
            return v
        if len(v) != n:
            raise RequestError(f"'{name}' has {len(v)} entries for {n} prompts")
        return v[i]

    def _one(self, text, input_ids, i: int, n: int, j: int, samples: int) -> GenerateReqInput:
        """Prompt i of n, sample j of `samples`. A batch's rid string becomes "<rid>-<k>" (k: the item's place
        in the response); a per-prompt rid with several samples "<rid>-<j>"."""
        sp = self._pick("sampling_params", i, n)
        rid = self._pick("rid", i, n)
        if isinstance(self.rid, str) and n * samples > 1:
            rid = f"{self.rid}-{i * samples + j}"
        elif isinstance(self.rid, list) and samples > 1:
            rid = f"{rid}-{j}"
        return GenerateReqInput(
            text=text, input_ids=input_ids,
            sampling_params=None if sp is None else sp.to_engine_dict(drop_n=samples > 1),
            return_logprob=self._pick("return_logprob", i, n),
            logprob_start_len=self._pick("logprob_start_len", i, n),
            top_logprobs_num=self._pick("top_logprobs_num", i, n),
            token_ids_logprob=self._pick("token_ids_logprob", i, n),
            return_text_in_logprobs=self.return_text_in_logprobs, stream=self.stream, rid=rid,
            session_params=None if self.session_params is None else self.session_params.model_dump(),
            return_routed_experts=self._pick("return_routed_experts", i, n),
            lora_path=self._lora_path(i, n),
        )

    def _lora_path(self, i: int, n: int) -> Optional[str]:
        """Prompt i's adapter: a per-prompt list's entry (a single prompt takes a one-entry list, as SGLang does)."""
        if isinstance(self.lora_path, list) and n == 1 and len(self.lora_path) == 1:
            return self.lora_path[0]
        if isinstance(self.lora_path, list) and n == 1:
            raise RequestError(f"'lora_path' has {len(self.lora_path)} entries for a single prompt",
                               param="lora_path")
        return self._pick("lora_path", i, n)


class ScoreRequest(StrictModel):
    """The /v1/score body (SGLang's): ``query`` and ``items`` both text or both token ids."""

    query: Optional[Union[str, List[TokenId]]] = None
    items: Optional[Union[str, List[str], List[List[TokenId]]]] = None
    label_token_ids: Optional[List[TokenId]] = None
    apply_softmax: bool = False
    item_first: bool = False
    model: Optional[str] = None
    lora_path: Optional[str] = Field(None, description="a loaded LoRA adapter's name (null: the base model)")
    algorithm: Optional[Literal[ALGORITHMS]] = Field(
        None, description="prefill_extend only on a server started with --enable-scoring-cache")
    rid: Optional[Rid] = None

    def to_input(self) -> ScoreReqInput:
        return ScoreReqInput(**self.model_dump())


class OpenSessionRequest(NullMeansDefault, StrictModel):
    """The /open_session body (SGLang's OpenSessionReqInput). ``capacity_of_str_len`` is accepted and, as
    upstream, not enforced; ``timeout``: seconds without a new turn after which the session is closed."""

    capacity_of_str_len: NonNegInt32 = 0
    session_id: Optional[Rid] = None
    streaming: Optional[bool] = False
    timeout: Optional[Annotated[float, Field(gt=0)]] = None

    def to_input(self) -> OpenSessionReqInput:
        return OpenSessionReqInput(self.capacity_of_str_len, self.session_id, bool(self.streaming), self.timeout)


class LoadLoRAAdapterRequest(StrictModel):
    """The /load_lora_adapter body (SGLang's LoadLoRAAdapterReqInput): a PEFT adapter directory or hub id
    (``lora_path``) registered as ``lora_name``; ``pinned``: never evicted to make room (--max-loaded-loras)."""

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]
    pinned: bool = False

    def to_input(self) -> LoadLoRAAdapterReqInput:
        return LoadLoRAAdapterReqInput(self.lora_name, self.lora_path, self.pinned)


class UnloadLoRAAdapterRequest(StrictModel):
    """The /unload_lora_adapter body (SGLang's UnloadLoRAAdapterReqInput)."""

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]

    def to_input(self) -> UnloadLoRAAdapterReqInput:
        return UnloadLoRAAdapterReqInput(self.lora_name)


class CloseSessionRequest(StrictModel):
    """The /close_session body."""

    session_id: Rid


class AbortRequest(StrictModel):
    """The /abort_request body: one request by ``rid``, or every request with ``abort_all``."""

    rid: Optional[str] = None
    abort_all: bool = False


def validation_param(errors) -> Optional[str]:
    """The field of pydantic's first error, dotted (``messages.0.role``), for OpenAI's error ``param``; None for
    a body that is not valid JSON."""
    for err in errors:
        if err.get("type") == "json_invalid":
            return None
        loc = ".".join(str(x) for x in err.get("loc", ()) if x not in ("body", _ONE, _PER_PROMPT))
        return loc or None
    return None


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

