"""Speculative decoding (--speculative-algorithm NGRAM) on real servers against the suite's default server (no
speculation): the same outputs. Two speculating servers: page size 1 with the radix cache, and page size 16
without it, with a retract forced every few decode steps.

The speculating server runs test_overlap_schedule's workload -- a batch of 24 requests with every stop kind,
seeded temperature sampling with top-p / top-k, penalties with a logit bias, output logprobs (top-3 and two ids) on
every row, next to a JSON-schema request and a three-turn streaming session, then a seeded temperature request and
the JSON request alone -- and copy-heavy requests whose drafts are accepted: a passage to repeat, greedy, with
max_new_tokens and a stop string that land inside accepted runs, and with logprobs. Greedy rows draft and verify;
sampled, penalized and grammar rows decode without drafts. Output ids, finish reasons and completion tokens must
be equal and logprobs within 1e-4; drafts must have been accepted (meta_info's spec_* counts, the server's
totals), some along a tree branch whose K/V had to move; the KV pools end at rest with no compile after warm-up.
The page-16 server runs the 24-request batch and the copy-heavy requests, with retracts (drafted pages
released with the rest).
"""

from __future__ import annotations

import httpx
import pytest

from srt_helpers import check_clean, module_server, wait_pool_idle
from test_overlap_schedule import compare, run_batch, run_workload

PASSAGE = ("def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
           "    return 2 * (width + height)\n\n\ndef describe(width, height):\n"
           "    return f'{width} by {height}: area {area(width, height)}, perimeter {perimeter(width, height)}'\n")
COPY_PROMPT = f"Repeat this code exactly.\n\n{PASSAGE}\nThe same code:\n\ndef area(width, height):\n"
SPEC_ARGS = ["--enable-streaming-session", "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8"]


@pytest.fixture(scope="module")
def spec_server():
    yield from module_server(SPEC_ARGS)


def generate(url: str, **body) -> dict:
    r = httpx.post(url + "/generate", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def copy_requests(url: str, stop: str) -> list:
    """The copy-heavy requests: the passage repeated greedily (its draft tokens are accepted), cut by
    max_new_tokens 37, by a stop string, and with top-2 logprobs."""
    greedy = {"temperature": 0, "max_new_tokens": 90}
    return [generate(url, text=COPY_PROMPT, sampling_params=greedy),
            generate(url, text=COPY_PROMPT, sampling_params={**greedy, "max_new_tokens": 37}),
            generate(url, text=COPY_PROMPT, sampling_params={**greedy, "stop": [stop]}),
            generate(url, text=COPY_PROMPT, sampling_params=greedy, return_logprob=True, top_logprobs_num=2)]


@pytest.fixture(scope="module")
def spec_page16_server():
    yield from module_server(SPEC_ARGS + ["--disable-radix-cache"], env={"SGL_JAX_TEST_RETRACT": "1"},
                             engine_args={"page_size": 16, "precompile_token_paddings": [256]})


@pytest.fixture(scope="module")
def reference(default_server):
    """(test_overlap_schedule's workload, the copy-heavy requests, their stop string) on the default server."""
    parts, _ = run_workload(default_server.url)
    full = generate(default_server.url, text=COPY_PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 90})
    text = full["text"]
    assert len(text) > 150, text  # the model copies: drafts have something to match
    stop = text[len(text) // 2:len(text) // 2 + 7]  # lands inside an accepted run
    copies = copy_requests(default_server.url, stop)
    wait_pool_idle(default_server.url)
    return parts, copies, stop


def check_copies(copies: list, reference_copies: list, stop: str) -> None:
    for a, b in zip(copies, reference_copies):
        compare(a, b)
        assert a["text"] == b["text"]
    assert copies[1]["meta_info"]["finish_reason"]["type"] == "length"
    assert copies[2]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    meta = copies[0]["meta_info"]
    assert meta["spec_accept_token_num"] > 30 and meta["spec_accept_length"] > 2.0, meta
    assert meta["spec_verify_ct"] * meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"])
    assert meta["spec_accept_rate"] == pytest.approx(meta["spec_accept_token_num"] / meta["spec_draft_token_num"])


def test_outputs_identical_with_and_without_speculation(spec_server, reference):
    reference_parts, reference_copies, stop = reference
    before = check_clean(spec_server.url)
    speculated, _ = run_workload(spec_server.url)
    copies = copy_requests(spec_server.url, stop)
    state = check_clean(spec_server.url)
    assert not state["overlap_schedule"]  # (speculation turns it off)
    for part in ("batch", "json", "session", "alone", "json_alone"):
        assert len(speculated[part]) == len(reference_parts[part])
        for a, b in zip(speculated[part], reference_parts[part]):
            compare(a, b)
    check_copies(copies, reference_copies, stop)
    sampled = speculated["alone"][0]["meta_info"]  # temperature 0.9: decodes without drafts
    assert sampled["spec_draft_token_num"] == 0 and sampled["spec_verify_ct"] == sampled["completion_tokens"] - 1
    assert speculated["json_alone"][0]["meta_info"]["spec_draft_token_num"] == 0  # a grammar: no drafts
    assert state["spec_verify_steps"] > before["spec_verify_steps"]
    assert state["spec_accepted_tokens"] - before["spec_accepted_tokens"] > 100
    assert state["spec_kv_moves"] > before["spec_kv_moves"]  # a path off the first branch was accepted


def test_page16_without_radix_under_forced_retract(spec_page16_server, reference):
    reference_parts, reference_copies, stop = reference
    url = spec_page16_server.url
    batch = run_batch(url)
    copies = copy_requests(url, stop)
    state = check_clean(url)
    for a, b in zip(batch, reference_parts["batch"]):
        compare(a, b)
    check_copies(copies, reference_copies, stop)
    assert state["num_retracted_reqs"] > 0 and state["spec_accepted_tokens"] > 100
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in batch + copies)
