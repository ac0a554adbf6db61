"""What every client of the HTTP API relies on, over real HTTP against real servers (issue #36): OpenAI's error
bodies (in the Python and the Node openai SDKs, and in a stream), OpenAI's roles, ``models.retrieve``, HEAD and
``GET /``, opt-in CORS, ``x-api-key``, and tools the model can see when its chat template does not render them.

The Node check runs the official ``openai`` npm package (test/node, installed by ``scripts/setup.sh test`` when
npm is present); it is skipped only where Node.js is not installed at all.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from typing import Optional

import httpx
import openai
import pytest
from fastapi import FastAPI

from sgl_jax.srt.entrypoints.http_server import add_cors
from sgl_jax.srt.entrypoints.openai.serving_tools import ToolPlan, with_tools_in_system_prompt
from sgl_jax.srt.entrypoints.parsers.tool_call_parser import Llama3Parser
from sgl_jax.srt.errors import RequestError
from sgl_jax.srt.server_args import ServerArgs
from srt_helpers import ALLOWED_ORIGIN, API_KEY, SERVED_MODEL_NAME, default_model_path, wait_pool_idle

NODE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "node")
AUTH = {"authorization": f"Bearer {API_KEY}"}
HI = [{"role": "user", "content": "hi"}]
WEATHER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def server(default_server):
    yield default_server
    wait_pool_idle(default_server.url)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def served_name() -> str:
    return os.path.basename(default_model_path())[:-len(".gguf")]


# ---------------------------------------------------------------- OpenAI's error body
def test_error_body_is_openais_with_sglangs_fields_beside_it(server, client):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": HI, "temperature": -1}, timeout=30)
    assert r.status_code == 400
    body = r.json()
    error = body["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "temperature" and error["code"] == 400
    assert "temperature" in error["message"]
    # SGLang's top-level fields, for SGLang's clients
    assert body["object"] == "error" and body["message"] == error["message"] and body["type"] == "BadRequestError"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=HI, temperature=-1)
    assert e.value.param == "temperature" and e.value.type == "invalid_request_error"
    assert "temperature" in e.value.message
    # a RequestError raised by the serving code names its field too
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": HI, "top_logprobs": 2}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text
    # the native API keeps its own shape
    r = httpx.post(server.url + "/generate", json={"text": "hi", "sampling_params": {"temperature": -1}}, timeout=30)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "code"}


def test_a_role_outside_openais_is_refused_naming_it(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages.0.role" and "'developer'" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "developer", "content": "Be brief."}, *HI], "max_tokens": 1})
    assert r.status_code == 200, r.text


def node_client(server, mode: str, body: Optional[dict] = None) -> dict:
    """Run test/node/openai_client.mjs (the official openai npm package) against `server`; its JSON report."""
    if shutil.which("node") is None:
        pytest.skip("Node.js is not installed on this machine (the one allowed skip)")
    assert os.path.isdir(os.path.join(NODE_DIR, "node_modules", "openai")), \
        "the openai npm package is missing: run scripts/setup.sh test (npm ci in test/node)"
    cmd = ["node", os.path.join(NODE_DIR, "openai_client.mjs"), server.url + "/v1", mode]
    out = subprocess.run(cmd + ([json.dumps(body)] if body is not None else []), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_node_openai_sdk_shows_the_reason_of_a_400(server):
    report = node_client(server, "error", {"model": "m", "messages": HI, "temperature": -1})
    assert report["ok"] is False and report["status"] == 400, report
    assert "temperature: Input should be greater than or equal to 0" in report["message"], report
    assert report["param"] == "temperature" and report["type"] == "invalid_request_error", report


def test_node_openai_sdk_chat_stream_and_tool_call(server):
    report = node_client(server, "calls")
    assert report["plain"] and report["streamed"] == report["plain"] and report["chunks"] >= 3, report
    assert report["finish"] == "tool_calls" and report["tool"][0]["function"]["name"] == "get_weather", report
    assert "city" in json.loads(report["tool"][0]["function"]["arguments"]), report


def test_an_error_inside_a_stream_is_an_openai_error_event(hardened_server):
    url = hardened_server.url + "/v1/chat/completions"
    body = {"messages": HI, "max_tokens": 8, "stream": True, "rid": "fault-forward-stream"}
    with httpx.stream("POST", url, json=body, headers=AUTH, timeout=120) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and error["code"] == 500, error
    assert "injected forward fault" in error["message"]
    c = openai.OpenAI(base_url=hardened_server.url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.APIError, match="injected forward fault"):
        for _ in c.chat.completions.create(model="m", messages=HI, max_tokens=8, stream=True,
                                           extra_body={"rid": "fault-forward-sdk"}):
            pass
    wait_pool_idle(hardened_server.url, AUTH)


# ---------------------------------------------------------------- models, HEAD, /
def test_models_retrieve_and_unknown_model_is_404(server, client):
    model = client.models.retrieve(served_name())
    assert model.id == served_name() and model.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.param == "model" and "no-such-model" in e.value.message


def test_head_wherever_get_is_served_and_root(server):
    for path in ("/health", "/v1/models", "/", "/get_model_info", f"/v1/models/{served_name()}"):
        get, head = httpx.get(server.url + path, timeout=30), httpx.head(server.url + path, timeout=30)
        assert head.status_code == get.status_code == 200, path
        assert head.content == b"" and head.headers.get("content-type") == get.headers.get("content-type"), path
    assert httpx.head(server.url + "/v1/chat/completions", timeout=30).status_code == 405  # POST only
    root = httpx.get(server.url + "/", timeout=30).json()
    assert root["name"] == "sgl-jax" and root["version"] and root["model"] == served_name()
    assert root["links"]["models"] == "/v1/models" and root["links"]["health"] == "/health"


# ---------------------------------------------------------------- CORS (opt-in) and keys
def test_cors_is_off_by_default(server):
    preflight = httpx.options(server.url + "/v1/chat/completions", timeout=30, headers={
        "origin": ALLOWED_ORIGIN, "access-control-request-method": "POST"})
    assert preflight.status_code == 405 and "access-control-allow-origin" not in preflight.headers
    r = httpx.get(server.url + "/v1/models", headers={"origin": ALLOWED_ORIGIN}, timeout=30)
    assert "access-control-allow-origin" not in r.headers


def test_cors_answers_only_the_allowed_origins(hardened_server):
    url = hardened_server.url
    ask = {"access-control-request-method": "POST", "access-control-request-headers": "authorization,content-type"}
    ok = httpx.options(url + "/v1/chat/completions", headers={"origin": ALLOWED_ORIGIN, **ask}, timeout=30)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ALLOWED_ORIGIN  # no key needed
    assert "POST" in ok.headers["access-control-allow-methods"]
    other = httpx.options(url + "/v1/chat/completions", headers={"origin": "http://evil.example", **ask}, timeout=30)
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    r = httpx.get(url + "/v1/models", headers={"origin": ALLOWED_ORIGIN, **AUTH}, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    r = httpx.get(url + "/v1/models", headers={"origin": "http://evil.example", **AUTH}, timeout=30)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_x_api_key_is_accepted_like_bearer(hardened_server):
    url = hardened_server.url
    assert httpx.get(url + "/v1/models", headers={"x-api-key": API_KEY}, timeout=30).status_code == 200
    assert httpx.get(url + "/v1/models", headers={"x-api-key": "wrong"}, timeout=30).status_code == 401
    assert httpx.get(url + f"/v1/models/{SERVED_MODEL_NAME}", headers=AUTH, timeout=30).json()["id"] == \
        SERVED_MODEL_NAME


def test_cors_star_without_a_key_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="sgl_jax.srt.entrypoints.http_server"):
        add_cors(FastAPI(), ServerArgs(allowed_origins=["*"]))
    assert any("--allowed-origins * without --api-key" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sgl_jax.srt.entrypoints.http_server"):
        add_cors(FastAPI(), ServerArgs(allowed_origins=["*"], api_key="k"))
    assert not caplog.records
    with pytest.raises(ValueError, match="--allowed-methods applies only with --allowed-origins"):
        ServerArgs(allowed_methods=["GET"])


# ---------------------------------------------------------------- tools the model can see
def test_tools_go_into_the_system_prompt_when_the_template_does_not_render_them(server, client):
    plain = client.chat.completions.create(model="m", messages=HI, max_tokens=1, temperature=0)
    with_tools = client.chat.completions.create(model="m", messages=HI, max_tokens=1, temperature=0,
                                                tools=WEATHER_TOOLS, tool_choice="auto")
    # the tool's name, description and schema plus the llama3 parser's call format
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 40
    none = client.chat.completions.create(model="m", messages=HI, max_tokens=1, temperature=0,
                                          tools=WEATHER_TOOLS, tool_choice="none")
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # "none": tools are not shown
    # a system message keeps its text, the tools block follows it
    system = [{"role": "system", "content": "You are terse."}, *HI]
    both = client.chat.completions.create(model="m", messages=system, max_tokens=1, temperature=0,
                                          tools=WEATHER_TOOLS)
    alone = client.chat.completions.create(model="m", messages=system, max_tokens=1, temperature=0)
    assert both.usage.prompt_tokens > alone.usage.prompt_tokens + 40
    log = server.log_text()
    assert "The chat template does not render tools" in log
    assert "rendered into the system prompt (the chat template does not render tools; the llama3 parser" in log
    # earlier calls are written into their assistant turns (SmolLM2's template renders no tool_calls)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turns = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": None,
                                                                 "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    seen = client.chat.completions.create(model="m", messages=turns, max_tokens=1, temperature=0, tools=WEATHER_TOOLS)
    turns[1] = {"role": "assistant", "content": ""}
    unseen = client.chat.completions.create(model="m", messages=turns, max_tokens=1, temperature=0, tools=WEATHER_TOOLS)
    assert seen.usage.prompt_tokens > unseen.usage.prompt_tokens + 8


def test_a_parser_without_a_prompt_format_refuses_tools_it_cannot_show():
    """The fallback asks for calls in the parser's format; a parser with none answers 400 naming ``tools``
    instead of dropping them."""

    class NoFormat(Llama3Parser):
        fallback_format = None

    plan = ToolPlan(NoFormat(), ["get_weather"], WEATHER_TOOLS)
    with pytest.raises(RequestError) as e:
        with_tools_in_system_prompt([{"role": "user", "content": "hi"}], plan)
    assert e.value.status_code == 400 and e.value.param == "tools" and "does not render tools" in e.value.message
    shown = with_tools_in_system_prompt([{"role": "user", "content": "hi"}], ToolPlan(Llama3Parser(), ["get_weather"],
                                                                                        WEATHER_TOOLS))
    assert shown[0]["role"] == "system" and '"name": "get_weather"' in shown[0]["content"]
    assert Llama3Parser.fallback_format in shown[0]["content"] and shown[1] == {"role": "user", "content": "hi"}
