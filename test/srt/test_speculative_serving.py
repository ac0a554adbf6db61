"""Speculative decoding (--speculative-algorithm NGRAM) on real servers against the suite's default server (no
speculation): the same outputs. Two speculating servers: page size 1 with the radix cache, and page size 16
without it, with a retract forced every few decode steps.

The speculating server runs test_overlap_schedule's workload -- a batch of 24 requests with every stop kind,
seeded temperature sampling with top-p / top-k, penalties with a logit bias, output logprobs (top-3 and two ids) on
every row, next to a JSON-schema request and a three-turn streaming session, then a seeded temperature request and
the JSON request alone -- and copy-heavy requests whose drafts are accepted: a passage to repeat, greedy, with
max_new_tokens and a stop string that land inside accepted runs, with logprobs, and 16 seeded samples of it.
Greedy and sampled rows draft and verify; penalized and grammar rows decode without drafts. Output ids, finish
reasons and completion tokens must be equal (so the samples' distribution is the reference's) and logprobs within
1e-4; drafts must have been accepted (meta_info's spec_* counts, the server's
totals, /metrics' sglang:spec_accept_length and spec_accept_rate), some along a tree branch whose K/V had to
move; the KV pools end at rest with no compile after warm-up.
The page-16 server runs the copy-heavy requests, with retracts (drafted pages released with the rest).
"""

from __future__ import annotations

import httpx
import pytest

from srt_helpers import check_clean, module_server, wait_pool_idle
from test_overlap_schedule import compare, run_workload

PASSAGE = ("def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
           "    return 2 * (width + height)\n\n\ndef describe(width, height):\n"
           "    return f'{width} by {height}: area {area(width, height)}, perimeter {perimeter(width, height)}'\n")
COPY_PROMPT = f"Repeat this code exactly.\n\n{PASSAGE}\nThe same code:\n\ndef area(width, height):\n"
# a prompt of ~600 tokens: prefilled in 256-token chunks (SMALL_ENGINE_ARGS) while other requests verify
LONG_PROMPT = "".join(f"Step {i}: add {i} to the total, then write the total down.\n" for i in range(40)) + COPY_PROMPT
SPEC_ARGS = ["--enable-streaming-session", "--enable-metrics", "--speculative-algorithm", "NGRAM",
             "--speculative-num-draft-tokens", "8"]


@pytest.fixture(scope="module")
def spec_server():
    yield from module_server(SPEC_ARGS)


def generate(url: str, **body) -> dict:
    r = httpx.post(url + "/generate", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


SEEDS = 16


def copy_requests(url: str, stop: str) -> list:
    """The copy-heavy requests: the passage repeated greedily (its draft tokens are accepted), cut by
    max_new_tokens 37, by a stop string, and with top-2 logprobs; then in one batch a ~600-token prompt (chunked
    prefill beside verify steps) and SEEDS seeded samples of the passage (temperature 0.8, top-p 0.95)."""
    greedy = {"temperature": 0, "max_new_tokens": 90}
    sampled = [{"temperature": 0.8, "top_p": 0.95, "seed": seed, "max_new_tokens": 24} for seed in range(SEEDS)]
    return [generate(url, text=COPY_PROMPT, sampling_params=greedy),
            generate(url, text=COPY_PROMPT, sampling_params={**greedy, "max_new_tokens": 37}),
            generate(url, text=COPY_PROMPT, sampling_params={**greedy, "stop": [stop]}),
            generate(url, text=COPY_PROMPT, sampling_params=greedy, return_logprob=True, top_logprobs_num=2),
            *generate(url, text=[LONG_PROMPT] + [COPY_PROMPT] * SEEDS,
                      sampling_params=[{**greedy, "max_new_tokens": 40}] + sampled)]


@pytest.fixture(scope="module")
def spec_page16_server():
    yield from module_server(SPEC_ARGS + ["--disable-radix-cache"], env={"SGL_JAX_TEST_RETRACT": "1"},
                             engine_args={"page_size": 16, "precompile_token_paddings": [256],
                                          "precompile_bs_paddings": [1, 32]})  # (its steps: 1 or 17 requests)


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
    """The copy-heavy requests against the reference: the same tokens and text (the seeded samples too: under
    sampling each draft slot's token is drawn from the request's own stream at its output index, so the emitted
    tokens are those sampling one at a time draws -- the empirical distribution of the SEEDS samples is the
    reference's exactly, total variation 0 -- while drafts are accepted)."""
    assert len(copies) == len(reference_copies) == 5 + SEEDS
    for a, b in zip(copies, reference_copies):
        compare(a, b)
        assert a["text"] == b["text"]
    assert copies[4]["meta_info"]["prompt_tokens"] > 512  # (three chunks)
    samples = copies[5:]
    assert len({tuple(o["output_ids"]) for o in samples}) > SEEDS // 2  # they differ: sampled, not greedy
    assert sum(o["meta_info"]["spec_accept_token_num"] for o in samples) > SEEDS
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
    assert speculated["json_alone"][0]["meta_info"]["spec_draft_token_num"] == 0  # a grammar: no drafts
    penalized = [o["meta_info"] for i, o in enumerate(speculated["batch"]) if i % 4 == 2]  # (sampling(i))
    assert all(m["spec_draft_token_num"] == 0 and m["spec_verify_ct"] == m["completion_tokens"] - 1
               for m in penalized if m["finish_reason"]["type"] == "length")
    assert state["spec_verify_steps"] > before["spec_verify_steps"]
    assert state["spec_accepted_tokens"] - before["spec_accepted_tokens"] > 100
    assert state["spec_kv_moves"] > before["spec_kv_moves"]  # a path off the first branch was accepted
    metrics = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in
               httpx.get(spec_server.url + "/metrics", timeout=30).text.splitlines() if line.startswith("sglang:spec")}
    rows, accepted = state["spec_drafted_rows"], state["spec_accepted_tokens"]
    assert metrics["sglang:spec_accept_length"] == pytest.approx((accepted + rows) / rows)
    assert metrics["sglang:spec_accept_rate"] == pytest.approx(accepted / state["spec_draft_tokens"])


def test_page16_without_radix_under_forced_retract(spec_page16_server, reference):
    _, reference_copies, stop = reference
    url = spec_page16_server.url
    copies = copy_requests(url, stop)
    state = check_clean(url)
    check_copies(copies, reference_copies, stop)
    assert state["num_retracted_reqs"] > 0 and state["spec_accepted_tokens"] > 100
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in copies)
