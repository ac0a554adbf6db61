"""Real client libraries against one launched server (the default SmolLM2 model):

- SGLang's frontend language (PyPI ``sglang``, installed with --no-deps) through its ``RuntimeEndpoint``
  backend: ``gen`` with ``stop`` and ``regex``, ``select``, ``fork``, ``run_batch``, streaming;
- LangChain's ``ChatOpenAI`` (``langchain-openai``): invoke, stream, ``with_structured_output`` (json_schema);
- lm-eval's ``local-completions`` model (PyPI ``lm-eval``, installed with --no-deps): loglikelihood through
  /v1/completions (echo + logprobs), checked against transformers' reference, and generate_until;
- sglang-router (PyPI ``sglang-router``) in front of the server: native /generate (plain and streaming), the
  OpenAI endpoints through the openai client, /flush_cache.

The OpenAI client itself is exercised in test_http_server.py. Every client library is a test dependency
(pyproject.toml's ``test`` extra; sglang and lm-eval through the --no-deps installs of scripts/setup.sh test),
imported at the top of this file: a missing one is an error, never a skip.
"""

from __future__ import annotations

import json
import os
import re

import httpx
import jsonschema
import langchain_openai
import lm_eval.models.openai_completions as lm_eval_api
import openai
import pytest
import sglang as sgl
import sglang_router  # noqa: F401  (RouterProcess runs `python -m sglang_router.launch_router`)
from langchain_core.messages import HumanMessage, SystemMessage
from lm_eval.api.instance import Instance

from srt_helpers import RouterProcess, default_model_path

PROMPT_FRANCE = "Q: What is the capital of France?\nA: The capital of France is"


@pytest.fixture(scope="module")
def server(default_server):
    return default_server  # conftest.py: the suite's shared server (SMALL_ENGINE_ARGS)


def served_name() -> str:
    """The default served model name: the GGUF file's name without .gguf."""
    return os.path.basename(default_model_path())[:-len(".gguf")]


def server_log_tail(server, n: int = 3000) -> str:
    return "\n--- server log tail ---\n" + server.log_text()[-n:]


def native_generate(server, text: str, **sampling_params) -> str:
    r = httpx.post(server.url + "/generate", timeout=120,
                   json={"text": text, "sampling_params": {"temperature": 0, **sampling_params}})
    assert r.status_code == 200, r.text
    return r.json()["text"]


# ---------------------------------------------------------------- SGLang frontend language
# What RuntimeEndpoint (sglang 0.5.10.post1; the same code up to 0.5.20 at least) sends:
#   GET  /get_model_info                      (at construction; needs "model_path")
#   POST /generate {"text", "sampling_params": {"skip_special_tokens", "spaces_between_special_tokens",
#        "max_new_tokens", "min_new_tokens", "n", "stop", "stop_token_ids": [], "stop_regex": [],
#        "temperature", "top_p", "top_k": -1, "min_p", "frequency_penalty", "presence_penalty", "ignore_eos",
#        "regex": null|str, "json_schema": null|str}}                                (gen; "stream": true too)
#   POST /generate {"text", "sampling_params": {"max_new_tokens": 0}}               (fork, select: the prefix)
#   POST /generate {"text": [prefix + choice, ...], "sampling_params": {"max_new_tokens": 0, "temperature": 0},
#        "return_logprob": true, "return_text_in_logprobs": true, "logprob_start_len": n}      (select)


@pytest.fixture(scope="module")
def backend(server):
    be = sgl.RuntimeEndpoint(server.url)
    assert be.get_model_name() == served_name()
    return be


def run_ok(server, program, **kwargs):
    """program.run(**kwargs), asserting the program ran without error (the frontend turns a failed HTTP call
    into state.error(): the server's error body)."""
    state = program.run(**kwargs)
    assert state.error() is None, f"{state.error()}{server_log_tail(server)}"
    return state


def capital_program():
    @sgl.function
    def capital(s, country):
        s += f"Q: What is the capital of {country}?\nA: The capital of {country} is"
        s += sgl.gen("answer", max_tokens=16, temperature=0, stop=[".", "\n"])

    return capital


def test_sglang_gen_stop(backend, server):
    state = run_ok(server, capital_program(), country="France", backend=backend)
    answer = state["answer"]
    assert "Paris" in answer and "." not in answer and "\n" not in answer, answer
    assert state.text() == PROMPT_FRANCE + answer
    # the frontend's full sampling_params (top_k -1, min_p 0, stop_regex [], regex null, ...) mean the defaults
    assert answer == native_generate(server, PROMPT_FRANCE, max_new_tokens=16, stop=[".", "\n"])
    meta = state.get_meta_info("answer")
    assert meta["finish_reason"]["type"] == "stop" and meta["finish_reason"]["matched"] == "."


def test_sglang_gen_regex(backend, server):
    pattern = r"1[0-9]{3}"

    @sgl.function
    def year(s):
        s += "Q: In which year was the Eiffel Tower completed?\nA: It was completed in "
        s += sgl.gen("year", max_tokens=8, temperature=0, regex=pattern)

    state = run_ok(server, year, backend=backend)
    assert re.fullmatch(pattern, state["year"]), state["year"]


def test_sglang_gen_dtype_int(backend, server):
    """gen(dtype=int): the frontend sends its integer regex plus stop=[" ", "\\n"]."""
    @sgl.function
    def count(s):
        s += "Q: How many legs does a spider have?\nA: A spider has "
        s += sgl.gen("n", max_tokens=6, temperature=0, dtype=int)

    state = run_ok(server, count, backend=backend)
    assert re.fullmatch(r"[-+]?[0-9]+", state["n"]), state["n"]


def test_sglang_select(backend, server):
    choices = [" Paris", " London", " Berlin"]

    @sgl.function
    def choose(s):
        s += "Q: What is the capital of France?\nA:"
        s += sgl.select("answer", choices=choices)

    state = run_ok(server, choose, backend=backend)
    assert state["answer"] in choices
    assert state["answer"] == " Paris"  # the model knows this one; a wrong pick means the logprobs are off
    meta = state.get_meta_info("answer")
    assert len(meta["normalized_prompt_logprobs"]) == len(choices)
    assert max(meta["normalized_prompt_logprobs"]) == meta["normalized_prompt_logprobs"][0]


def test_sglang_fork(backend, server):
    fork_states = []

    @sgl.function
    def two_facts(s):
        s += "Here are two facts about Paris.\n"
        forks = s.fork(2)
        fork_states.extend(forks)
        for i, f in enumerate(forks):
            f += f"Fact {i + 1}:"
            f += sgl.gen("fact", max_tokens=12, temperature=0, stop="\n")
        s += "Fact 1:" + forks[0]["fact"] + "\nFact 2:" + forks[1]["fact"] + "\n"

    try:
        state = run_ok(server, two_facts, backend=backend)
    except KeyError:  # a fork's gen failed: its variable is missing; its error says why
        pytest.fail(f"fork errors: {[f.error() for f in fork_states]}{server_log_tail(server)}")
    text = state.text()
    facts = re.fullmatch(r"Here are two facts about Paris\.\nFact 1:(.*)\nFact 2:(.*)\n", text, re.S)
    assert facts, text
    for i, fact in enumerate(facts.groups()):
        assert fact.strip() and "\n" not in fact, text
        assert fact == native_generate(server, f"Here are two facts about Paris.\nFact {i + 1}:",
                                       max_new_tokens=12, stop="\n")


def test_sglang_run_batch(backend, server):
    capital = capital_program()
    countries = ["France", "Germany", "Italy", "Japan", "Spain"]
    states = capital.run_batch([{"country": c} for c in countries], backend=backend, num_threads=len(countries))
    assert len(states) == len(countries)
    for state in states:
        assert state.error() is None, f"{state.error()}{server_log_tail(server)}"
        assert state["answer"].strip() and "." not in state["answer"]
    assert "Paris" in states[0]["answer"]
    single = run_ok(server, capital, country="France", backend=backend)
    assert states[0]["answer"] == single["answer"]


def test_sglang_stream(backend, server):
    capital = capital_program()
    full = run_ok(server, capital, country="France", backend=backend)["answer"]
    state = capital.run(country="France", backend=backend, stream=True)
    pieces = list(state.text_iter("answer"))
    assert state.error() is None, f"{state.error()}{server_log_tail(server)}"
    assert "".join(pieces) == full, pieces


# ---------------------------------------------------------------- LangChain (langchain-openai)


@pytest.fixture(scope="module")
def chat(server):
    return langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="none", model=served_name(), temperature=0,
                         max_tokens=32, max_retries=0, timeout=120, stream_usage=True)


def test_langchain_invoke(chat):
    r = chat.invoke("What is the capital of France?")
    assert "Paris" in r.content
    assert r.response_metadata["finish_reason"] == "stop"
    assert r.response_metadata["model_name"] == served_name()
    usage = r.usage_metadata
    assert usage["input_tokens"] > 10 and usage["output_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_langchain_stream(chat):
    messages = [SystemMessage("You are a concise assistant."), HumanMessage("What is the capital of France?")]
    full = chat.invoke(messages)
    chunks = list(chat.stream(messages))
    assert len(chunks) > 2
    assert "".join(c.content for c in chunks) == full.content
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    assert merged.content == full.content
    assert merged.response_metadata.get("finish_reason") == "stop"
    assert merged.usage_metadata["output_tokens"] == full.usage_metadata["output_tokens"]


def test_langchain_structured_output_pydantic(chat):
    from pydantic import BaseModel, Field

    class Capital(BaseModel):
        country: str = Field(max_length=24)
        capital: str = Field(max_length=24)

    structured = chat.bind(max_tokens=64).with_structured_output(Capital, method="json_schema", include_raw=True)
    out = structured.invoke("What is the capital of France? Answer in JSON with the country and its capital.")
    assert out["parsing_error"] is None, (out["parsing_error"], out["raw"])
    assert isinstance(out["parsed"], Capital), out
    assert out["parsed"].capital == "Paris", out["parsed"]
    raw = json.loads(out["raw"].content)
    assert raw == out["parsed"].model_dump()


def test_langchain_structured_output_json_schema(chat):
    schema = {
        "title": "city",
        "description": "A city and the country it is in.",
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24},
                       "country": {"type": "string", "maxLength": 24},
                       "is_capital": {"type": "boolean"}},
        "required": ["name", "country", "is_capital"],
        "additionalProperties": False,
    }
    structured = chat.bind(max_tokens=64).with_structured_output(schema, method="json_schema")
    out = structured.invoke("Describe Paris as JSON.")
    assert isinstance(out, dict), out
    jsonschema.validate(out, schema)
    assert out["name"] == "Paris" and out["is_capital"] is True, out


# ---------------------------------------------------------------- lm-eval local-completions
# lm-eval 0.4.13's LocalCompletionsAPI sends, for loglikelihood, one POST /v1/completions per batch:
#   {"model", "prompt": [[token ids of context + continuation], ...], "temperature": 0, "max_tokens": 1,
#    "logprobs": 1, "seed": 1234, "echo": true}
# and sums choices[i].logprobs.token_logprobs[ctxlen:-1] (the last entry is the generated token).
LL_PAIRS = [("The capital of France is", " Paris"),
            ("Q: What is 2 + 2?\nA:", " 4"),
            ("The quick brown fox jumps over the", " lazy dog"),
            ("Water boils at a temperature of", " one hundred degrees Celsius at sea level.")]


def hf_dir() -> str:
    from sgl_jax.srt.configs.model_config import resolve_model_path

    return resolve_model_path(None).hf_dir


@pytest.fixture(scope="module")
def lm(server):
    # batch_size 2: prompts of different lengths in one request, as lm-eval does with --batch_size
    return lm_eval_api.LocalCompletionsAPI(model=served_name(), base_url=server.url + "/v1/completions",
                                           tokenizer_backend="huggingface", tokenizer=hf_dir(), max_length=2048,
                                           batch_size=2, max_retries=1, timeout=120)


def hf_continuation_logprob(model, context: list, continuation: list):
    """(sum of the continuation's token logprobs, whether every continuation token is the argmax) from HF."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([context + continuation])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    rows = logp[len(context) - 1:len(context) + len(continuation) - 1]
    total = float(sum(rows[i, t] for i, t in enumerate(continuation)))
    greedy = all(int(rows[i].argmax()) == t for i, t in enumerate(continuation))
    return total, greedy


def loglikelihood_instances(pairs):
    return [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)]


def test_lm_eval_loglikelihood_matches_hf(lm, hf_smollm2):
    results = lm.loglikelihood(loglikelihood_instances(LL_PAIRS), disable_tqdm=True)
    assert len(results) == len(LL_PAIRS)
    for (context, continuation), (ll, is_greedy) in zip(LL_PAIRS, results):
        ctx, cont = lm._encode_pair(context, continuation)
        ref, ref_greedy = hf_continuation_logprob(hf_smollm2, ctx, cont)
        assert abs(ll - ref) < 1e-3, (context, continuation, ll, ref)
        assert is_greedy == ref_greedy, (context, continuation)
    assert results[0][1] is True  # " Paris" is the greedy continuation


def test_lm_eval_loglikelihood_payload(lm, server, hf_smollm2):
    """lm-eval's exact request (its own _create_payload), the response checked field by field and parsed by
    LocalCompletionsAPI.parse_logprobs."""
    ctx, cont = lm._encode_pair(*LL_PAIRS[3])
    tokens = ctx + cont
    payload = lm._create_payload(lm.create_message([tokens]), generate=False, seed=lm._seed)
    assert payload["prompt"] == [tokens] and payload["echo"] is True and payload["logprobs"] == 1
    assert payload["max_tokens"] == 1 and payload["temperature"] == 0
    r = httpx.post(server.url + "/v1/completions", json=payload, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(tokens) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # no logprob for the first token
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    assert all(isinstance(t, dict) and len(t) >= 1 for t in lp["top_logprobs"][1:])
    assert body["usage"]["prompt_tokens"] == len(tokens) and body["usage"]["completion_tokens"] == 1
    ((ll, _),) = lm_eval_api.LocalCompletionsAPI.parse_logprobs(outputs=body, tokens=[tokens], ctxlens=[len(ctx)])
    ref, _ = hf_continuation_logprob(hf_smollm2, ctx, cont)
    assert abs(ll - ref) < 1e-3, (ll, ref)

    # echo + max_tokens 0 (the legacy OpenAI / vLLM scoring shape): the prompt's logprobs only, the same values
    r0 = httpx.post(server.url + "/v1/completions", json={**payload, "max_tokens": 0}, timeout=120)
    assert r0.status_code == 200, r0.text
    lp0 = r0.json()["choices"][0]["logprobs"]
    assert len(lp0["token_logprobs"]) == len(tokens) and r0.json()["usage"]["completion_tokens"] == 0
    assert lp0["token_logprobs"] == pytest.approx(lp["token_logprobs"][:-1], abs=1e-4)
    assert abs(sum(lp0["token_logprobs"][len(ctx):]) - ref) < 1e-3

    # tokenized_requests=False: the prompt as text; the same tokens, so the same logprobs
    rs = httpx.post(server.url + "/v1/completions", json={**payload, "prompt": [LL_PAIRS[3][0] + LL_PAIRS[3][1]]},
                    timeout=120)
    assert rs.status_code == 200, rs.text
    lps = rs.json()["choices"][0]["logprobs"]
    assert lps["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-4)


def test_lm_eval_generate_until(lm):
    reqs = [Instance(request_type="generate_until", doc={}, idx=0,
                     arguments=(PROMPT_FRANCE, {"until": ["."], "max_gen_toks": 16}))]
    (out,) = lm.generate_until(reqs, disable_tqdm=True)
    assert "Paris" in out and "." not in out, out


# ---------------------------------------------------------------- sglang-router
# sglang-router (PyPI, a Rust binary) in front of the server: it re-sends /generate bodies with "model": null
# added (accepted and ignored) and posts /flush_cache with no body and no content type (allowed there only).


@pytest.fixture(scope="module")
def router(server):
    r = RouterProcess([server.url])
    try:
        yield r.url
    finally:
        r.stop()


def test_router_generate(router, server):
    body = {"text": PROMPT_FRANCE, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
    direct = httpx.post(server.url + "/generate", json=body, timeout=120)
    routed = httpx.post(router + "/generate", json=body, timeout=120)
    assert routed.status_code == 200, routed.text
    assert routed.json()["text"] == direct.json()["text"] and "Paris" in routed.json()["text"]
    with httpx.stream("POST", router + "/generate", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["text"] == direct.json()["text"]


def test_router_openai_chat_and_completions(router):
    client = openai.OpenAI(base_url=router + "/v1", api_key="none", max_retries=0, timeout=120)
    chat = client.chat.completions.create(model=served_name(), temperature=0, max_tokens=8,
                                          messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in chat.choices[0].message.content
    schema = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"],
              "additionalProperties": False}
    structured = client.chat.completions.create(
        model=served_name(), temperature=0, max_tokens=32,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert set(json.loads(structured.choices[0].message.content)) == {"capital"}
    completion = client.completions.create(model=served_name(), prompt=PROMPT_FRANCE, temperature=0, max_tokens=4)
    assert "Paris" in completion.choices[0].text


def test_router_flush_cache(router, server):
    r = httpx.post(router + "/flush_cache", timeout=60)
    assert r.status_code == 200, r.text
    # the worker itself: a body-less POST passes, a non-JSON body to it or to another endpoint does not
    assert httpx.post(server.url + "/flush_cache", timeout=60).status_code == 200
    assert httpx.post(server.url + "/flush_cache", content=b"x", headers={"content-type": "text/plain"},
                      timeout=60).status_code == 415
    assert httpx.post(server.url + "/abort_request", timeout=60).status_code == 415
