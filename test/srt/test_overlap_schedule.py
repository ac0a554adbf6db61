"""The overlap scheduler (on by default) against --disable-overlap-schedule on real servers: the same outputs.

The suite's default server (overlap on) and one started with --disable-overlap-schedule, otherwise the same
configuration, run the same workload: a batch of 24 requests whose sampling parameters cover what a late
result can get wrong -- stops by EOS, stop token, stop string and length (1 to 6 tokens), min_new_tokens,
seeded temperature sampling with top-p / top-k, frequency / presence / repetition penalties with a logit bias --
every row with output logprobs (top-3 and two fixed ids), next to a JSON-schema request (its vocabulary mask needs
every earlier token) and a three-turn streaming session; then a 40-token seeded temperature request alone (every
decode step of it may be launched ahead), the JSON-schema request alone (on this CPU --grammar-overlap auto is off:
none of its steps is launched ahead, its grammar mask needs the token of the step before; test_hot_loop and
test_data_parallel run the split that launches them ahead, scheduler/overlap.py) and a stream aborted midway.
Output ids and finish reasons must be equal, logprobs within 1e-4 (cached tokens depend on which concurrent part
reaches the radix cache first; test_kv_cache_lifecycle compares them on a sequential workload); both servers end with
their KV pools at rest, no memory error and no compile after warm-up, and only the default one reports steps launched
ahead of the previous result.
"""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

from srt_helpers import check_clean, module_server, wait_pool_idle

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Write a haiku about the sea.", "def fibonacci(n):",
           "The best way to learn a language is", "Once upon a time", "Q: What is 7 times 8?\nA:",
           "List three colors:"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def sampling(i: int) -> dict:
    """Request i's sampling parameters (four kinds, see the module docstring)."""
    kind = i % 4
    if kind == 0:
        return {"max_new_tokens": 6 + i, "temperature": 0}  # EOS may stop it
    if kind == 1:
        return {"max_new_tokens": 20, "temperature": 0.8, "top_p": 0.9, "seed": i, "stop": ["."]}
    if kind == 2:
        return {"max_new_tokens": 16, "temperature": 0, "frequency_penalty": 0.5, "presence_penalty": 0.3,
                "repetition_penalty": 1.1, "logit_bias": {"11": 2.0}, "stop_token_ids": [30], "min_new_tokens": 3}
    return {"max_new_tokens": 1 + i // 4, "temperature": 1.0, "top_k": 20, "seed": i}  # length: 1..6 tokens


def run_batch(url: str) -> list:
    n = 24
    body = {"text": [PROMPTS[i % len(PROMPTS)] for i in range(n)], "sampling_params": [sampling(i) for i in range(n)],
            "return_logprob": True, "top_logprobs_num": 3, "token_ids_logprob": [11, 30]}
    r = httpx.post(url + "/generate", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def run_json(url: str) -> dict:
    body = {"text": "Give a person as JSON:", "sampling_params": {
        "max_new_tokens": 48, "temperature": 0.7, "seed": 5, "json_schema": json.dumps(SCHEMA)}}
    r = httpx.post(url + "/generate", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def run_session(url: str) -> list:
    r = httpx.post(url + "/open_session", json={"capacity_of_str_len": 1000, "streaming": True}, timeout=60)
    assert r.status_code == 200, r.text
    sid, outs, parent = r.json(), [], None
    for turn in ("Tell me a story.", " Go on.", " And then?"):
        params = {"id": sid, **({"rid": parent} if parent else {})}
        r = httpx.post(url + "/generate", timeout=600, json={
            "text": turn, "session_params": params,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        outs.append(r.json())
        parent = outs[-1]["meta_info"]["id"]
    assert httpx.post(url + "/close_session", json={"session_id": sid}, timeout=60).status_code == 200
    return outs


def run_alone(url: str) -> dict:
    body = {"text": "Once upon a time", "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 40, "temperature": 0.9, "seed": 3, "ignore_eos": True}}
    r = httpx.post(url + "/generate", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def run_workload(url: str) -> tuple:
    """(each part's outputs, (the steps launched ahead, the grammar steps split) while the JSON-schema request ran
    alone)."""
    assert httpx.post(url + "/flush_cache", json={}, timeout=30).status_code == 200
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        batch, js, session = pool.submit(run_batch, url), pool.submit(run_json, url), pool.submit(run_session, url)
        parts = {"batch": batch.result(), "json": [js.result()], "session": session.result()}
    parts["alone"] = [run_alone(url)]
    before = wait_pool_idle(url)
    parts["json_alone"] = [run_json(url)]
    after = wait_pool_idle(url)
    return parts, tuple(after[k] - before[k] for k in ("num_overlapped_steps", "num_grammar_split_steps"))


def aborted_stream(url: str) -> None:
    """A stream read for 3 tokens, then closed: the request is aborted and its KV released."""
    body = {"text": "Count to one hundred:", "stream": True,
            "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
    seen = 0
    with httpx.stream("POST", url + "/generate", json=body, timeout=600) as resp:
        lines = resp.iter_lines()
        for line in lines:
            seen += line.startswith("data: {")
            if seen == 3:
                break
    wait_pool_idle(url)


@pytest.fixture(scope="module")
def sync_server():
    yield from module_server(["--enable-streaming-session", "--disable-overlap-schedule"])


def numbers(x) -> list:
    """Every number of a nested logprob entry (None: 0), in order."""
    if isinstance(x, (list, tuple)):
        return [v for item in x for v in numbers(item)]
    return [0 if x is None else x]


def compare(a: dict, b: dict) -> None:
    assert a["output_ids"] == b["output_ids"]
    ma, mb = a["meta_info"], b["meta_info"]
    for key in ("finish_reason", "completion_tokens"):  # (cached_tokens: the three parts race for the radix cache)
        assert ma[key] == mb[key], key
    for key in ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"):
        assert numbers(ma.get(key)) == pytest.approx(numbers(mb.get(key)), abs=1e-4), key


def test_outputs_identical_with_and_without_overlap(default_server, sync_server):
    before = check_clean(default_server.url)["num_overlapped_steps"]
    overlapped, json_ahead = run_workload(default_server.url)
    aborted_stream(default_server.url)
    after = check_clean(default_server.url)
    assert after["overlap_schedule"] and after["num_overlapped_steps"] > before + 20
    reference, sync_ahead = run_workload(sync_server.url)
    aborted_stream(sync_server.url)
    state = check_clean(sync_server.url)
    assert not state["overlap_schedule"] and state["num_overlapped_steps"] == 0 and sync_ahead == (0, 0)
    finish = [o["meta_info"]["finish_reason"]["type"] for o in reference["batch"]]
    assert "stop" in finish and "length" in finish  # both kinds of finish are exercised
    json.loads(reference["json"][0]["text"])
    # alone, no decode step of the JSON request is launched before the one before it is applied (--grammar-overlap
    # auto is off on a CPU device)
    tokens = reference["json_alone"][0]["meta_info"]["completion_tokens"]
    assert tokens >= 10 and json_ahead == (0, 0), (tokens, json_ahead)
    for part in ("batch", "json", "session", "alone", "json_alone"):
        assert len(overlapped[part]) == len(reference[part])
        for a, b in zip(overlapped[part], reference[part]):
            compare(a, b)
