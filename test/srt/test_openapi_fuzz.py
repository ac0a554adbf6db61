"""Property: every operation of the server's own OpenAPI document (/openapi.json, fetched from the running
server), fed schemathesis-generated requests -- valid ones and ones that break the schema (wrong types, out of
range, missing or unknown fields) -- answers without a 5xx; afterwards the server is alive and its KV pool is
idle-exact. Runs against conftest.hardened_server (API key + admin key, fault-injection hook on).

Only `not_a_server_error` is checked, not conformance to the documented responses: the server answers 400 for
an invalid request (never FastAPI's 422, which the document lists) and may answer 401/404/413/415/503.

Each operation gets cases of three kinds: valid per the document; valid per the document without the fields
the server accepts only at their default (field_types.default_only: upstream fields it cannot honour) and with
the constraints it checks beyond the document, so that they mostly pass validation and run through the engine
(`served_fields_only`); and schema-violating ones (schemathesis' negative mode).

Every request is kept cheap before it is sent (`bounded`): integer generation lengths, counts and top-logprob
numbers in the int32 range are clamped to small values (a missing or null generation length is set to a small
one, since null means "up to the context"), and the lists of prompts / items / messages are cut short. Values
of the wrong type (and ints beyond int32, which validation refuses) are left alone, so invalid inputs are
still sent. Two things that would disturb the other modules sharing
the server are never sent: ``abort_all: true`` (made false) and a rid starting with ``fault-`` (the
fault-injection hook's prefix; prefixed with ``x``). Sessions the fuzzer opened are closed at the end.

SGL_JAX_OPENAPI_FUZZ_EXAMPLES sets the number of generated examples per operation (default 25, a third of
that for the operator endpoints undone after each case; operations without a body or parameters have fewer
distinct cases). SGL_JAX_OPENAPI_FUZZ_LOG=FILE appends one JSON line
per request sent (method, path, body, status).

Any request shape found to give a 5xx goes at the end of this file as a plain httpx regression test.
"""

from __future__ import annotations

import copy
import json
import os
import re
from typing import Any, List

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import schemathesis  # (a test extra: a missing one must fail, not skip)
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode

from srt_helpers import ADMIN_API_KEY, API_KEY, wait_pool_idle

AUTH = {"authorization": f"Bearer {API_KEY}"}
ADMIN_AUTH = {"authorization": f"Bearer {ADMIN_API_KEY}"}
# the routes marked admin_endpoint (entrypoints/http_guards.py): they take the admin key only
ADMIN_PATHS = {"/flush_cache", "/abort_request", "/load_lora_adapter", "/unload_lora_adapter",
               "/update_weights_from_disk", "/get_weights_by_name", "/release_memory_occupation",
               "/resume_memory_occupation", "/pause_generation", "/continue_generation", "/start_profile",
               "/stop_profile"}
# operator endpoints whose success changes the server for what follows: undone after each case
RESTORE = {"/pause_generation": "/continue_generation", "/release_memory_occupation": "/resume_memory_occupation",
           "/start_profile": "/stop_profile"}

EXAMPLES = int(os.environ.get("SGL_JAX_OPENAPI_FUZZ_EXAMPLES", "25"))
# a case that succeeds there costs a second or more (a KV pool freed and allocated again, a profiler started and
# stopped), so these run a third as many
RESTORE_EXAMPLES = max(1, EXAMPLES // 3)

# the most each generation knob may ask for (ints up to INT32_MAX only; bools, floats, strings, ... and larger
# ints, refused by validation, are left as they are)
INT_CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "max_new_tokens": 4, "max_output_tokens": 4,
            "num_predict": 4, "min_tokens": 2, "min_new_tokens": 2,
            "n": 2, "best_of": 2, "top_logprobs": 2, "logprobs": 2, "top_logprobs_num": 2}
LIST_FIELDS = {"prompt", "text", "input_ids", "items", "messages", "tokens", "label_token_ids", "input"}
MAX_LIST = 8
INT32_MAX = 2**31 - 1
SMALL_LEN = 4  # a missing / null generation length becomes this

# what the fuzzer did, for the report at the end
SERVER_ERRORS: List[dict] = []
OPENED_SESSIONS: List[str] = []


def _clamp(node: Any) -> Any:
    """Clamp INT_CAPS ints and LIST_FIELDS lists in every dict of `node`, recursively (in place)."""
    if isinstance(node, dict):
        for key, value in list(node.items()):
            if key in INT_CAPS and type(value) is int and INT_CAPS[key] < value <= INT32_MAX:
                node[key] = INT_CAPS[key]
            elif key in LIST_FIELDS and isinstance(value, list) and len(value) > MAX_LIST:
                node[key] = value[:MAX_LIST]
            elif key == "rid" and isinstance(value, str) and value.startswith("fault-"):
                node[key] = "x" + value
            elif key == "rid" and isinstance(value, list):
                node[key] = ["x" + r if isinstance(r, str) and r.startswith("fault-") else r for r in value]
            _clamp(node[key])
    elif isinstance(node, list):
        for item in node:
            _clamp(item)
    return node


def _set_length(d: dict, *keys: str) -> None:
    """A missing or null generation length (null means "up to the context") becomes SMALL_LEN."""
    if all(d.get(k) is None for k in keys):
        d[keys[0]] = SMALL_LEN


def bounded(path: str, body: Any) -> Any:
    """`body` (a generated request body, any JSON value) made cheap and harmless to the shared server."""
    if not isinstance(body, dict):
        return body
    body = _clamp(body)
    if path == "/abort_request" and body.get("abort_all") is True:
        body["abort_all"] = False  # other modules' requests run on this server
    if path == "/v1/completions":
        _set_length(body, "max_tokens")
    elif path == "/v1/chat/completions":
        _set_length(body, "max_completion_tokens", "max_tokens")
    elif path == "/v1/responses":
        _set_length(body, "max_output_tokens")
    elif path in ("/api/chat", "/api/generate"):  # Ollama: options.num_predict (default: up to the context)
        options = body.get("options")
        if options is None:
            body["options"] = options = {}
        # a number outside [0, SMALL_LEN] (Ollama's -1: no limit) is clamped; any other type is left for the
        # server's 4xx (a list here once crashed this helper: `0 <= []`)
        num = options.get("num_predict") if isinstance(options, dict) else 0
        if num is None or (isinstance(num, (int, float)) and not isinstance(num, bool)
                           and not 0 <= num <= SMALL_LEN):
            options["num_predict"] = SMALL_LEN
    elif path == "/generate":
        sp = body.get("sampling_params")
        if sp is None:
            body["sampling_params"] = {"max_new_tokens": SMALL_LEN}
        for p in sp if isinstance(sp, list) else [sp]:
            if isinstance(p, dict):
                _set_length(p, "max_new_tokens")
    return body


# in-band error types that mean the server failed (OpenAI's and Anthropic's)
SERVER_ERROR_TYPES = {"server_error", "api_error", "overloaded_error"}


def stream_errors(response) -> List[dict]:
    """The in-band error objects of a streamed response (a 200 whose stream failed): SSE ``data:`` events
    (OpenAI, native, Anthropic) and NDJSON lines (Ollama, whose error is a string)."""
    out = []
    ndjson = any(v.startswith("application/x-ndjson") for v in response.headers.get("content-type", []))
    for line in re.split(r"\r\n|\r|\n", response.text):
        if ndjson or (line.startswith("data: ") and line != "data: [DONE]"):
            try:
                event = json.loads(line if ndjson else line[6:])
            except ValueError:
                continue
            if isinstance(event, dict) and isinstance(event.get("error"), dict):
                out.append(event["error"])
            elif ndjson and isinstance(event, dict) and isinstance(event.get("error"), str):
                out.append({"message": event["error"]})
    return out


def is_server_error(error: dict) -> bool:
    """Whether an in-band error object reports a failure of the server (5xx), not of the request."""
    if isinstance(error.get("code"), int):
        return error["code"] >= 500
    return error.get("type") is None or error.get("type") in SERVER_ERROR_TYPES  # (Ollama's: no type, no code)


# Every operation of /openapi.json (test_document_lists_every_operation keeps this list equal to the document's,
# so a new route must be added here -- and is then fuzzed)
OPERATIONS = [
    ("GET", "/health"), ("GET", "/health_generate"), ("GET", "/metrics"), ("GET", "/get_model_info"),
    ("GET", "/get_server_info"), ("GET", "/get_load"), ("POST", "/flush_cache"), ("POST", "/abort_request"),
    ("GET", "/open_session"), ("POST", "/open_session"), ("GET", "/close_session"), ("POST", "/close_session"),
    ("POST", "/tokenize"), ("POST", "/v1/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/detokenize"),
    ("POST", "/generate"), ("PUT", "/generate"), ("GET", "/v1/models"), ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"), ("POST", "/v1/score"), ("GET", "/"), ("GET", "/v1/models/{model_id}"),
    # OpenAI's Responses API, Anthropic's Messages API, Ollama's API (issue #36)
    ("POST", "/v1/responses"), ("GET", "/v1/responses/{response_id}"), ("DELETE", "/v1/responses/{response_id}"),
    ("POST", "/v1/responses/{response_id}/cancel"), ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"),
    ("POST", "/api/chat"), ("POST", "/api/generate"), ("GET", "/api/tags"), ("GET", "/api/ps"), ("POST", "/api/show"),
    ("GET", "/api/version"),
    # Cohere's and Jina's rerank API (issue #41)
    ("POST", "/v1/rerank"), ("POST", "/v2/rerank"), ("POST", "/rerank"), ("POST", "/v1/embeddings"),
    # SGLang's LoRA adapter endpoints (issue #42; a server without --enable-lora answers 400)
    ("POST", "/load_lora_adapter"), ("POST", "/unload_lora_adapter"),
    # SGLang's RL and operator endpoints (issue #43)
    ("POST", "/update_weights_from_disk"), ("GET", "/get_weights_by_name"), ("POST", "/get_weights_by_name"),
    ("GET", "/get_weight_version"), ("GET", "/weight_version"), ("GET", "/model_info"),
    ("POST", "/release_memory_occupation"), ("POST", "/resume_memory_occupation"),
    ("POST", "/pause_generation"), ("POST", "/continue_generation"), ("POST", "/start_profile"),
    ("POST", "/stop_profile"),
]


# field_types.default_only's note in a field's description: the field is accepted only at its default
DEFAULT_ONLY_NOTE = "accepted only at its default"


# what the server requires beyond the document (checked by validators and routes, not expressible in the
# pydantic models' JSON schema): /generate takes exactly one of text / input_ids, /v1/score all three inputs
EXTRA_CONSTRAINTS = {
    "GenerateRequest": {"oneOf": [{"required": ["text"], "not": {"required": ["input_ids"]}},
                                  {"required": ["input_ids"], "not": {"required": ["text"]}}]},
    "ScoreRequest": {"required": ["query", "items", "label_token_ids"]},
}


def served_fields_only(document: dict) -> dict:
    """A copy of an OpenAPI document without the request fields the server accepts only at their default
    (upstream fields it has no engine support for) and with EXTRA_CONSTRAINTS: valid data generated from it
    mostly passes validation, so it reaches the engine."""
    document = copy.deepcopy(document)
    schemas = document.get("components", {}).get("schemas", {})
    for schema in schemas.values():
        props = schema.get("properties", {})
        for name in [k for k, v in props.items() if DEFAULT_ONLY_NOTE in v.get("description", "")]:
            del props[name]
            if name in schema.get("required", []):
                schema["required"].remove(name)
    for name, extra in EXTRA_CONSTRAINTS.items():
        if name in schemas:
            schemas[name].update(extra)
    return document


@pytest.fixture(scope="module")
def openapi_schemas(hardened_server):
    """The running server's /openapi.json, loaded by schemathesis: as served, and `served_fields_only`."""
    r = httpx.get(hardened_server.url + "/openapi.json", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    document = r.json()
    return (schemathesis.openapi.from_dict(copy.deepcopy(document)),
            schemathesis.openapi.from_dict(served_fields_only(document)))


def test_document_lists_every_operation(openapi_schemas):
    ops = set()
    for result in openapi_schemas[0].get_all_operations():
        op = result.ok()  # raises on an operation schemathesis cannot read
        ops.add((op.method.upper(), op.path))
    assert ops == set(OPERATIONS)


def _ints(node: Any) -> Any:
    if isinstance(node, float) and node.is_integer() and abs(node) < 2**63:
        return int(node)
    if isinstance(node, dict):
        return {k: _ints(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_ints(v) for v in node]
    return node


def integral_floats_as_ints(case):
    """JSON Schema's "integer" includes 3.0, which the server's strict models refuse (400): in the cases meant to
    reach the engine, send such values as JSON integers."""
    if isinstance(case.body, (dict, list)):
        case.body = _ints(case.body)
    return case


def case_strategy(schemas, method: str, path: str):
    """Cases of one operation: valid per the document (as served, and without its default-only fields), and
    schema-violating (negative) ones where there is something to violate (a body or parameters)."""
    full, served = (s[path][method] for s in schemas)
    strategies = [served.as_strategy(GenerationMode.POSITIVE).map(integral_floats_as_ints),
                  full.as_strategy(GenerationMode.POSITIVE)]
    if full.body or full.query or full.path_parameters or full.headers:
        strategies.append(full.as_strategy(GenerationMode.NEGATIVE))
    return st.one_of(strategies)


def send_case(url: str, case) -> None:
    """Send `case` (made `bounded`) and check the answer: no 5xx status, no 5xx error inside a stream, the server
    still healthy. Records what the fuzzer saw (SERVER_ERRORS, OPENED_SESSIONS)."""
    path = case.operation.path
    if case.body is not None and not isinstance(case.body, (bytes, str)):
        case.body = bounded(path, case.body)
    headers = ADMIN_AUTH if path in ADMIN_PATHS else AUTH
    response = case.call(base_url=url, headers=headers, timeout=120)
    if path in RESTORE:  # (paused, released or profiling: undone, so the next cases see a serving server)
        httpx.post(url + RESTORE[path], json={}, headers=ADMIN_AUTH, timeout=120)
        st = httpx.get(url + "/get_server_info", headers=AUTH, timeout=30).json()["internal_states"][0]
        # (a server left paused, released or profiling would stall every later case of every module sharing it)
        assert (not st["generation_paused"] and not any(st["memory_released"].values())
                and not st["profiling"]), (path, case.body, {k: st[k] for k in ("generation_paused",
                                                                                 "memory_released", "profiling")})
    if os.environ.get("SGL_JAX_OPENAPI_FUZZ_LOG"):  # a file: one line per request, for a look at what was sent
        with open(os.environ["SGL_JAX_OPENAPI_FUZZ_LOG"], "a") as f:
            f.write(json.dumps({"method": case.method, "path": path, "query": case.query, "body": case.body,
                                "status": response.status_code, "response": response.text[:160]},
                               default=repr) + "\n")
    errors = []
    if any(v.startswith(("text/event-stream", "application/x-ndjson"))
           for v in response.headers.get("content-type", [])):
        errors = [e for e in stream_errors(response) if is_server_error(e)]
    if response.status_code >= 500 or errors:
        SERVER_ERRORS.append({"method": case.method, "path": path, "query": case.query, "body": case.body,
                              "status": response.status_code, "response": response.text[:500]})
    if path == "/open_session" and response.status_code == 200:
        sid = response.json()
        if isinstance(sid, str):
            OPENED_SESSIONS.append(sid)
    case.validate_response(response, checks=[not_a_server_error], headers=headers)
    assert not errors, (case.method, path, case.body, errors)
    assert httpx.get(url + "/health", timeout=10).status_code == 200, "the server went down"


@pytest.mark.parametrize("method,path", OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_operation(openapi_schemas, hardened_server, method, path):
    """SGL_JAX_OPENAPI_FUZZ_EXAMPLES generated requests of one operation: no 5xx."""

    # (no shrinking: a failing case is reported as found, so a failure costs one case, not a search that resends
    # slow requests until the test's timeout)
    @settings(max_examples=RESTORE_EXAMPLES if path in RESTORE else EXAMPLES, deadline=None,
              suppress_health_check=list(HealthCheck), print_blob=True,
              phases=(Phase.explicit, Phase.generate))
    @given(case=case_strategy(openapi_schemas, method, path))
    def run(case):
        send_case(hardened_server.url, case)

    run()


def test_alive_and_idle_after_fuzzing(hardened_server):
    """After the fuzzing: no 5xx was seen, the server answers /health and /health_generate, every session the
    fuzzer opened closes, and the KV pool is idle-exact."""
    url = hardened_server.url
    for sid in OPENED_SESSIONS:
        r = httpx.post(url + "/close_session", json={"session_id": sid}, headers=AUTH, timeout=30)
        assert r.status_code in (200, 404), (sid, r.status_code, r.text)  # 404: it timed out already
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert httpx.get(url + "/health_generate", timeout=60).status_code == 200
    state = wait_pool_idle(url, AUTH)
    still_open = {s["session_id"] for rank in state["dp_ranks"] for s in rank.get("sessions", [])}
    assert not still_open & set(OPENED_SESSIONS), still_open & set(OPENED_SESSIONS)
    assert not SERVER_ERRORS, json.dumps(SERVER_ERRORS, indent=1, default=str)


# ---------------------------------------------------------------- regressions: shapes the fuzzer found
# (each request shape that got a 5xx goes here as a plain httpx test asserting status < 500)


def test_json_format_with_a_vanishing_repeat_penalty_and_a_huge_temperature(hardened_server):
    """Found 2026-11-27: format json, repeat_penalty 1e-308 (logits / ~0 = +inf), temperature 1.8e38 with top_k,
    top_p, min_p and typical_p: the draw's masses became NaN and it drew a token the grammar forbids (500)."""
    body = {"model": "x", "prompt": "Hi", "raw": True, "stream": False, "format": "json",
            "options": {"presence_penalty": -1.18, "typical_p": 0.077, "repeat_penalty": 1.1125369292536007e-308,
                        "min_p": 0.81, "frequency_penalty": -1.9, "top_k": 152, "top_p": 0.3, "seed": 83953531798447440,
                        "num_predict": 4, "temperature": 1.8417541683865563e+38}}
    r = httpx.post(hardened_server.url + "/api/generate", json=body, headers=AUTH, timeout=120)
    assert r.status_code < 500, r.text
