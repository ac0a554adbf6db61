"""Sessions end to end (SGLang's /open_session, /close_session, ``session_params``) on real servers.

Configurations: SmolLM2 at page 1 (the shared default_server); a tiny random Llama (2 layers, weights at 0.2,
SmolLM2's tokenizer: these tests compare the engine with itself, and SmolLM2 here took ~2.5 minutes of the suite)
at page 4 (chunked prefill 64, forced retract, the exact page-ownership check after every step:
SGL_JAX_CHECK_KV_INVARIANTS); a tiny random Gemma 3 (sliding
window W = 16 on 2 of 3 layers, hybrid SWA memory with a small SWA pool, radix cache on) at page 4 with chunks
of W/2 (a later turn's prefill is chunked: its KV stays the session's between chunks while SWA release runs)
and at page 16 with chunks of 2W (a page as long as the window). The session KV arithmetic itself (trim,
lend, hand-back, SWA keep) is checked at pages 1, 4 and 16, full and SWA pools, in
test/mem_cache/test_session_kv.py. On each:

- a streaming session's turn n generates exactly the greedy tokens of a stateless /generate of the
  concatenated ids, reuses the whole history (``cached_tokens`` = the previous turn's prompt + completion
  tokens but its last sampled token, whose KV is computed with the new tokens), and keeps
  ``cache_protected_len`` page-aligned (odd turn lengths);
- abort recovery: a turn aborted mid-decode leaves the session as the previous turn left it (on the SWA model
  after decoding past several windows), an aborted turn 1 leaves it empty;
- closing releases everything: the pools are back to free + cached, every request slot free.

The page-4 tiny Llama server adds the classic sessions (rid, replace, drop_previous_output, offset, errors), the
refusals that leave a streaming session intact, timeout reaping, and the stress run: 8 streaming sessions x
6 turns and plain requests at once, chunked prefill 64, forced retract, checked every step; after close +
flush every pool is back to free.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from srt_helpers import SMALL_ENGINE_ARGS, module_server, save_tiny_gemma3, save_tiny_llama, wait_pool_idle

W = 16  # the tiny Gemma 3's sliding window
NEW = 8  # new tokens per turn
TURN_LENGTHS = [13, 7, 29, 5]  # odd, so that histories end mid-page at pages 4 and 16
CHECK_ENV = {"SGL_JAX_CHECK_KV_INVARIANTS": "1"}
RUNNING_TURN = 400  # new tokens of the turn that runs while a second one is refused (~1 s on the tiny model)


# ---------------------------------------------------------------- servers
@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    return save_tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3_sessions"), window=W)


def _tiny_llama_p4(model):
    model_dir, tokenizer = model
    return module_server(["--model-path", model_dir, "--tokenizer-path", tokenizer, "--enable-streaming-session",
                          "--page-size", "4"], env={**CHECK_ENV, "SGL_JAX_TEST_RETRACT": "1"},
                         engine_args={**SMALL_ENGINE_ARGS, "chunked_prefill_size": 64, "precompile_token_paddings": [64],
                                      "precompile_bs_paddings": [1, 8, 16], "max_running_requests": 16})


def _swa(model, page_size, chunk):
    model_dir, tokenizer = model
    return module_server(["--model-path", model_dir, "--tokenizer-path", tokenizer, "--enable-streaming-session",
                          "--page-size", str(page_size), "--chunked-prefill-size", str(chunk),
                          "--swa-full-tokens-ratio", "0.0625", "--max-total-tokens", "4096"], env=CHECK_ENV)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """(model dir, tokenizer dir): SmolLM2's vocabulary and context (2,048 tokens: SMALL_ENGINE_ARGS')."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_sessions"), init_std=0.2, max_positions=2048)


@pytest.fixture(scope="module")
def p4_server(tiny_llama):
    yield from _tiny_llama_p4(tiny_llama)


# name -> (page size, the SWA server's prefill chunk). Page 1 on SmolLM2, 4 on the tiny Llama, 4 and 16 on the SWA
# model: every turn length here ends mid-page at 4 and 16; chunks of W/2 at page 4 are the only ones that split a
# later turn (up to 30 tokens) into chunks, while 2W at page 16 prefills such a turn at once
SERVERS = {"smollm2-page1": (1, None), "llama-page4": (4, None), "swa-page4": (4, W // 2),
           "swa-page16": (16, 2 * W)}


@pytest.fixture(scope="module", params=list(SERVERS))
def server(request, tiny_gemma3):
    name = request.param
    page_size, chunk = SERVERS[name]
    if name == "smollm2-page1":
        yield request.getfixturevalue("default_server"), page_size, False
        return
    if name == "llama-page4":
        yield request.getfixturevalue("p4_server"), page_size, False
        return
    gen = _swa(tiny_gemma3, page_size, chunk)
    s = next(gen)
    try:
        yield s, page_size, True
    finally:
        next(gen, None)


# ---------------------------------------------------------------- helpers
def _ids(n, seed):
    return np.random.default_rng(seed).integers(100, 49000, n).tolist()


def generate(url, ids, max_new=NEW, session=None, rid=None, parent=None, **params):
    """/generate of `ids` (greedy); with `session`: session_params {id, rid: parent, **params}."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    if session is not None:
        body["session_params"] = {"id": session, **params}
        if parent is not None:
            body["session_params"]["rid"] = parent
    if rid is not None:
        body["rid"] = rid
    return httpx.post(url + "/generate", json=body, timeout=600)


def ok(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def open_session(url, **kw) -> str:
    r = httpx.post(url + "/open_session", json={"capacity_of_str_len": 1000, **kw}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def close_session(url, sid):
    assert httpx.post(url + "/close_session", json={"session_id": sid}, timeout=60).status_code == 200


def state(url) -> dict:
    return httpx.get(url + "/get_server_info", timeout=60).json()["internal_states"][0]


def session_entry(url, sid) -> dict:
    return next(s for s in state(url)["sessions"] if s["session_id"] == sid)


def flush(url):
    r = httpx.post(url + "/flush_cache", timeout=60)
    assert r.status_code == 200, r.text


def stream_then_abort(url, ids, session, rid, after_tokens, max_new=400):
    """Run a streaming turn and abort it once `after_tokens` tokens arrived; returns its last meta_info."""
    body = {"input_ids": ids, "rid": rid, "stream": True, "session_params": {"id": session},
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    last, aborted = None, False
    with httpx.stream("POST", url + "/generate", json=body, timeout=600) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            last = json.loads(line[6:])
            if not aborted and len(last["output_ids"]) >= after_tokens:
                assert httpx.post(url + "/abort_request", json={"rid": rid}, timeout=10).status_code == 200
                aborted = True
    assert last["meta_info"]["finish_reason"]["type"] == "abort", last["meta_info"]
    assert last["meta_info"]["completion_tokens"] < max_new
    return last["meta_info"]


def run_turns(url, sid, lengths, seed, page_size, history=None):
    """Streaming turns with new ids of `lengths`; each equals the stateless /generate of history + new ids and
    reuses the whole history but its last token. Returns the history."""
    history = list(history or [])
    for i, n in enumerate(lengths):
        new = _ids(n, seed + i)
        turn = ok(generate(url, new, session=sid))
        meta = turn["meta_info"]
        assert meta["prompt_tokens"] == len(history) + n
        assert meta["cached_tokens"] == max(len(history) - 1, 0), (i, meta)
        entry = session_entry(url, sid)
        assert entry["cache_protected_len"] % page_size == 0, entry
        assert entry["kv_committed_len"] == len(history) + n + NEW - 1, entry
        stateless = ok(generate(url, history + new))
        assert turn["output_ids"] == stateless["output_ids"], i
        history += new + turn["output_ids"]
    return history


# ---------------------------------------------------------------- every configuration
def test_streaming_session_turns_equal_stateless_generate(server):
    s, page_size, _ = server
    flush(s.url)
    # turn 1 shares a page-unaligned prefix with a cached request, so its protected prefix is the aligned part
    system = _ids(37, 99)
    ok(generate(s.url, system + _ids(5, 98)))
    sid = open_session(s.url, streaming=True)
    new1 = system + _ids(TURN_LENGTHS[0], 0)
    t1 = ok(generate(s.url, new1, session=sid))
    assert t1["meta_info"]["cached_tokens"] == (37 // page_size) * page_size or server[2]  # (SWA: may be less)
    entry = session_entry(s.url, sid)
    assert entry["cache_protected_len"] % page_size == 0 and entry["holds_kv"]
    held = state(s.url)
    assert held["kv_tokens_session_held"] == -(-entry["kv_allocated_len"] // page_size) * page_size \
        - entry["cache_protected_len"]
    assert held["req_slots_session_held"] == 1 and held["memory_errors"] == 0
    history = new1 + t1["output_ids"]
    run_turns(s.url, sid, TURN_LENGTHS[1:], 1, page_size, history)
    close_session(s.url, sid)
    st = wait_pool_idle(s.url)
    assert st["kv_tokens_session_held"] == 0 and st["num_sessions"] == 0


def test_abort_recovery(server):
    """Abort turn 2 mid-decode (past several windows on the SWA model): turn 3 sees turn 1's context only.
    Abort a session's turn 1: the next turn starts empty."""
    s, page_size, swa = server
    sid = open_session(s.url, streaming=True)
    history = run_turns(s.url, sid, [21], 10, page_size)
    before = session_entry(s.url, sid)
    stream_then_abort(s.url, _ids(11, 11), sid, f"abort-{sid}-2", after_tokens=3 * W + 5 if swa else 4)
    after = session_entry(s.url, sid)
    assert {k: after[k] for k in ("kv_committed_len", "cache_protected_len", "last_turn_rid")} == \
        {k: before[k] for k in ("kv_committed_len", "cache_protected_len", "last_turn_rid")}
    run_turns(s.url, sid, [9, 6], 12, page_size, history)
    close_session(s.url, sid)

    sid = open_session(s.url, streaming=True)
    stream_then_abort(s.url, _ids(15, 13), sid, f"abort-{sid}-1", after_tokens=2)
    assert not session_entry(s.url, sid)["holds_kv"]
    new = _ids(10, 14)
    turn = ok(generate(s.url, new, session=sid))
    assert turn["meta_info"]["prompt_tokens"] == len(new)
    assert turn["output_ids"] == ok(generate(s.url, new))["output_ids"]
    close_session(s.url, sid)
    st = wait_pool_idle(s.url)
    assert st["kv_tokens_session_held"] == 0 and st["memory_errors"] == 0


# ---------------------------------------------------------------- page 4 (chunk 64, forced retract, checked)
def test_streaming_refusals_leave_the_session_intact(p4_server):
    u = p4_server.url
    sid = open_session(u, streaming=True)
    first = httpx.post(u + "/generate", timeout=60, json={  # turn 1 reuses nothing: input logprobs are fine
        "input_ids": _ids(13, 20), "return_logprob": True, "logprob_start_len": 0, "session_params": {"id": sid},
        "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}})
    assert len(ok(first)["meta_info"]["input_token_logprobs"]) == 13
    history = _ids(13, 20) + first.json()["output_ids"]
    before = session_entry(u, sid)
    for params, message in (({"offset": 3}, "offset"), ({"replace": True}, "replace"),
                            ({"drop_previous_output": True}, "drop_previous_output"),
                            ({"parent": "not-the-last-turn"}, "rid")):
        r = generate(u, _ids(5, 21), session=sid, **params)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    too_long = generate(u, _ids(2040, 22), session=sid)  # fits alone, not after the history
    assert too_long.status_code == 400, too_long.text
    lp = httpx.post(u + "/generate", timeout=60, json={"input_ids": _ids(5, 23), "return_logprob": True,
                                                       "logprob_start_len": 0, "session_params": {"id": sid}})
    assert lp.status_code == 400 and "logprob_start_len" in lp.json()["error"]["message"]
    # a second turn while one runs is refused; the running one is not disturbed
    body = {"input_ids": _ids(6, 24), "session_params": {"id": sid},  # (long enough to be seen running)
            "sampling_params": {"max_new_tokens": RUNNING_TURN, "temperature": 0, "ignore_eos": True}}
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(httpx.post, u + "/generate", json=body, timeout=600)
        deadline = time.time() + 60
        while not session_entry(u, sid)["turn_running"] and time.time() < deadline:
            time.sleep(0.05)
        r = generate(u, _ids(5, 25), session=sid)
        assert r.status_code == 400 and "already has a turn running" in r.text
        first = running.result()
    assert first.status_code == 200
    assert session_entry(u, sid)["kv_committed_len"] == before["kv_committed_len"] + 1 + 6 + RUNNING_TURN - 1
    history += body["input_ids"] + first.json()["output_ids"]
    history = run_turns(u, sid, [7], 26, 4, history)
    # input logprobs of a turn's new tokens (from the history's length on) equal the stateless request's
    history = run_turns(u, sid, [3], 28, 4, history)
    new = _ids(9, 29)
    lp_body = {"return_logprob": True, "logprob_start_len": len(history),
               "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}
    turn = ok(httpx.post(u + "/generate", timeout=60, json={**lp_body, "input_ids": new,
                                                            "session_params": {"id": sid}}))
    stateless = ok(httpx.post(u + "/generate", timeout=60, json={**lp_body, "input_ids": history + new}))
    got = [e[0] for e in turn["meta_info"]["input_token_logprobs"]]
    want = [e[0] for e in stateless["meta_info"]["input_token_logprobs"]]
    assert len(got) == len(want) == len(new)
    np.testing.assert_allclose(got, want, atol=2e-3)
    assert httpx.post(u + "/open_session", json={"capacity_of_str_len": 1, "session_id": sid}).status_code == 400
    r = httpx.post(u + "/flush_cache", timeout=60)
    assert r.status_code == 400 and "sessions hold KV" in r.text
    close_session(u, sid)
    r = httpx.post(u + "/close_session", json={"session_id": sid}, timeout=60)
    assert r.status_code == 404
    assert generate(u, _ids(5, 27), session=sid).status_code == 400
    wait_pool_idle(u)


def test_classic_session(p4_server):
    u = p4_server.url
    flush(u)
    sid = open_session(u)
    a_ids = _ids(23, 30)
    a = ok(generate(u, a_ids, session=sid, rid=f"{sid}-a"))
    b_new = _ids(9, 31)
    b = ok(generate(u, b_new, session=sid, rid=f"{sid}-b", parent=f"{sid}-a"))
    a_hist = a_ids + a["output_ids"]
    assert b["output_ids"] == ok(generate(u, a_hist + b_new))["output_ids"]
    assert b["meta_info"]["cached_tokens"] == (len(a_hist) - 1) // 4 * 4  # the radix cache's reuse
    # drop_previous_output: the parent's prompt only; offset: cut the parent's tokens
    c = ok(generate(u, b_new, session=sid, rid=f"{sid}-c", parent=f"{sid}-a", drop_previous_output=True))
    assert c["output_ids"] == ok(generate(u, a_ids + b_new))["output_ids"]
    d = ok(generate(u, b_new, session=sid, rid=f"{sid}-d", parent=f"{sid}-a", offset=-3))
    assert d["output_ids"] == ok(generate(u, a_hist[:-3] + b_new))["output_ids"]
    # unknown rid: 400; replace drops a's other branches, so b is gone afterwards
    r = generate(u, b_new, session=sid, parent="no-such-turn")
    assert r.status_code == 400 and "no turn with rid" in r.text
    e = ok(generate(u, b_new, session=sid, rid=f"{sid}-e", parent=f"{sid}-a", replace=True))
    assert e["output_ids"] == b["output_ids"]
    assert generate(u, b_new, session=sid, parent=f"{sid}-b").status_code == 400
    # appending to a turn that has not finished: 400; with replace it is aborted
    body = {"input_ids": _ids(5, 32), "rid": f"{sid}-long", "session_params": {"id": sid, "rid": f"{sid}-e"},
            "sampling_params": {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}}
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(httpx.post, u + "/generate", json=body, timeout=600)
        deadline = time.time() + 60
        while state(u)["num_running_reqs"] == 0 and time.time() < deadline:
            time.sleep(0.05)
        r = generate(u, _ids(4, 33), session=sid, parent=f"{sid}-long")
        assert r.status_code == 400 and "has not finished" in r.text
        ok(generate(u, _ids(4, 33), session=sid, parent=f"{sid}-e", replace=True))
        long = running.result()
    assert long.json()["meta_info"]["finish_reason"]["type"] == "abort"
    close_session(u, sid)
    wait_pool_idle(u)


def test_timeout_reaps_an_idle_session(p4_server):
    u = p4_server.url
    sid = open_session(u, streaming=True, timeout=2.0)
    run_turns(u, sid, [19], 40, 4)
    assert state(u)["kv_tokens_session_held"] > 0
    deadline = time.time() + 30
    while state(u)["num_sessions"] and time.time() < deadline:
        time.sleep(0.5)
    st = state(u)
    assert st["num_sessions"] == 0 and st["kv_tokens_session_held"] == 0 and st["req_slots_session_held"] == 0
    assert generate(u, _ids(5, 41), session=sid).status_code == 400
    wait_pool_idle(u)


def test_stress_sessions_and_plain_requests(p4_server):
    """8 streaming sessions x 6 turns and plain requests at once; chunked prefill 64 (turn 1 prompts of 150+
    tokens), forced retract, the exact page-ownership check after every step; after close + flush every pool is
    free and no request slot is held."""
    u = p4_server.url
    flush(u)
    system = _ids(45, 50)  # a shared, page-unaligned system prompt: turn 1s lock the radix cache's copy
    sids = [open_session(u, streaming=True) for _ in range(8)]
    finals, errors = {}, []
    stop = threading.Event()

    def conversation(k):
        try:
            history = []
            for t in range(6):
                new = (system + _ids(110 + k, 60 + k)) if t == 0 else _ids(3 + 2 * k + t, 100 * k + t)
                turn = ok(generate(u, new, max_new=6 + k, session=sids[k]))
                assert turn["meta_info"]["cached_tokens"] >= max(len(history) - 1, 0)
                history += new + turn["output_ids"]
            finals[k] = (history, turn["output_ids"], len(new) + 6 + k)
        except BaseException as exc:  # noqa: BLE001 -- reported below
            errors.append((k, exc))

    def plain(j):
        while not stop.is_set() and j < 40:
            ok(generate(u, _ids(20 + 7 * (j % 5), 500 + j), max_new=5))
            j += 4

    with ThreadPoolExecutor(12) as pool:
        plains = [pool.submit(plain, j) for j in range(4)]
        convs = [pool.submit(conversation, k) for k in range(8)]
        for f in convs:
            f.result(timeout=1500)
        stop.set()
        for f in plains:
            f.result(timeout=600)
    assert not errors, errors
    st = state(u)
    assert st["memory_errors"] == 0 and st["num_retracted_reqs"] > 0
    assert st["req_slots_session_held"] == 8
    for entry in st["sessions"]:
        assert entry["cache_protected_len"] % 4 == 0 and entry["holds_kv"], entry
    for k in range(8):  # each session's last turn equals the stateless request of its whole history
        history, out, tail = finals[k]
        assert out == ok(generate(u, history[:len(history) - len(out)], max_new=len(out)))["output_ids"], k
    for sid in sids:
        close_session(u, sid)
    flush(u)
    st = wait_pool_idle(u)
    assert st["kv_tokens_free"] == st["kv_tokens_total"] and st["req_slots_free"] == st["max_running_requests"]
    assert st["kv_tokens_session_held"] == 0 and st["memory_errors"] == 0


# ---------------------------------------------------------------- API edges
def test_streaming_needs_the_flag_and_engine_sessions(hardened_server, shared_engine):
    from srt_helpers import API_KEY

    from sgl_jax.srt.errors import RequestError

    h = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(hardened_server.url + "/open_session", json={"capacity_of_str_len": 10, "streaming": True},
                   headers=h, timeout=60)
    assert r.status_code == 400 and "--enable-streaming-session" in r.json()["error"]["message"]
    for path, body, field in (
            ("/generate", {"text": "a", "session_params": {"id": 5}}, "session_params.id"),
            ("/generate", {"text": "a", "session_params": {"id": "s", "offset": "3"}}, "session_params.offset"),
            ("/generate", {"text": "a", "session_params": {"id": "s", "offset": 2**31}}, "session_params.offset"),
            ("/generate", {"text": "a", "session_params": {"id": "s", "other": 1}}, "session_params.other"),
            ("/generate", {"text": "a", "session_params": {"rid": "r"}}, "session_params.id"),
            ("/open_session", {"capacity_of_str_len": -1}, "capacity_of_str_len"),
            ("/open_session", {"capacity_of_str_len": 1, "timeout": 0}, "timeout"),
            ("/open_session", {"capacity_of_str_len": 1, "session_id": "a/b"}, "session_id"),
            ("/close_session", {}, "session_id")):
        r = httpx.post(hardened_server.url + path, json=body, headers=h, timeout=60)
        assert r.status_code == 400 and field in r.json()["error"]["message"], (path, body, r.text)
    with pytest.raises(RequestError, match="enable-streaming-session"):
        shared_engine.open_session(100, streaming=True)
    sid = shared_engine.open_session(100, session_id="engine-session")
    assert sid == "engine-session"
    with pytest.raises(RequestError, match="already open"):
        shared_engine.open_session(100, session_id=sid)
    greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    first = shared_engine.generate(input_ids=_ids(12, 70), sampling_params=greedy, rid="engine-turn-1",
                                   session_params={"id": sid})
    second = shared_engine.generate(input_ids=_ids(7, 71), sampling_params=greedy,
                                    session_params={"id": sid, "rid": "engine-turn-1"})
    reference = shared_engine.generate(input_ids=_ids(12, 70) + first["output_ids"] + _ids(7, 71),
                                       sampling_params=greedy)
    assert second["output_ids"] == reference["output_ids"]
    shared_engine.close_session(sid)
    with pytest.raises(RequestError):
        shared_engine.close_session(sid)


def test_openai_chat_with_session_params(default_server):
    from openai import OpenAI

    client = OpenAI(base_url=default_server.url + "/v1", api_key="none")
    sid = open_session(default_server.url)
    msgs = [{"role": "user", "content": "Name a color."}]
    out = client.chat.completions.create(model="m", messages=msgs, max_tokens=5, temperature=0,
                                         extra_body={"session_params": {"id": sid}})
    plain = client.chat.completions.create(model="m", messages=msgs, max_tokens=5, temperature=0)
    assert out.choices[0].message.content == plain.choices[0].message.content
    r = httpx.post(default_server.url + "/v1/chat/completions", timeout=60, json={
        "model": "m", "messages": msgs, "max_tokens": 2, "n": 2, "session_params": {"id": sid}})
    assert r.status_code == 400 and "one sequence" in r.text
    close_session(default_server.url, sid)


def test_session_metrics(default_server):
    """SGLang's streaming-session gauges on /metrics follow the internal state."""
    u = default_server.url
    sid = open_session(u, streaming=True)
    run_turns(u, sid, [17], 80, 1)
    held = state(u)["kv_tokens_session_held"]
    assert held == 17 + NEW - 1
    text = httpx.get(u + "/metrics", timeout=60).text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("sglang:") and "session" in line}
    assert values == {"sglang:num_streaming_sessions": 1.0, "sglang:streaming_session_held_tokens": float(held)}
    close_session(u, sid)
    wait_pool_idle(u)
