"""A mixture-of-experts model served end to end: a tiny random Qwen2-MoE (shared expert, q/k/v biases; SmolLM2's
vocabulary and tokenizer) behind a real server with the grouped-matmul backend, through /generate (greedy
tokens equal to transformers'), chat and completions, structured output, /v1/score and a session; the
server's teardown checks that the KV pool is back to free + cached and that nothing compiled while serving."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, Qwen2MoeConfig, Qwen2MoeForCausalLM

from srt_helpers import SMALL_ENGINE_ARGS, hf_greedy, module_server, wait_pool_idle

ARGS = dict(SMALL_ENGINE_ARGS, precompile_token_paddings=[64], precompile_bs_paddings=[1, 4],
            max_running_requests=4, max_total_tokens=4096, chunked_prefill_size=64, moe_backend="tiled",
            enable_return_routed_experts=True, enable_metrics=True)
NEW = 12


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """(transformers model, model dir, tokenizer dir) of a tiny random Qwen2-MoE with SmolLM2's vocabulary."""
    from sgl_jax.srt.configs.model_config import resolve_model_path
    from srt_helpers import default_model_path

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False)
    model = Qwen2MoeForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny_qwen2_moe")
    model.save_pretrained(path, safe_serialization=True)
    return model, str(path), resolve_model_path(default_model_path()).hf_dir


@pytest.fixture(scope="module")
def server(tiny_moe):
    _, model_dir, tokenizer = tiny_moe
    yield from module_server(["--model-path", model_dir, "--tokenizer-path", tokenizer], engine_args=ARGS)


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_tokens_equal_transformers(server, tiny_moe):
    model, _, tokenizer_dir = tiny_moe
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = np.random.default_rng(0)
    prompts = [tok.encode("The capital of France is"), rng.integers(100, 49000, 90).tolist()]  # (2 prefill chunks)
    outs = post(server, "/generate", {"input_ids": prompts, "sampling_params": {
        "max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}})
    assert len(outs) == len(prompts)  # (zip alone would pass on an empty answer)
    for ids, out in zip(prompts, outs):
        assert out["output_ids"] == hf_greedy(model, ids, NEW)


def test_chat_completions_structured_output_score_and_session(server):
    check_every_endpoint(server.url)


def check_every_endpoint(url: str) -> None:
    """Chat, streamed completions, structured output (a JSON schema), /v1/score (equal to /generate's logprobs of
    the label tokens) and a session's two turns answer on the server at `url`; its pool is idle after."""

    def post_json(path: str, body: dict) -> dict:
        r = httpx.post(url + path, json=body, timeout=600)
        assert r.status_code == 200, r.text
        return r.json()

    chat = post_json("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                                              "temperature": 0})
    assert chat["usage"]["completion_tokens"] >= 1
    streamed = httpx.post(url + "/v1/completions", timeout=600, json={
        "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "stream": True})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    constrained = post_json("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "ok?"}], "max_tokens": 48, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}}})
    assert isinstance(json.loads(constrained["choices"][0]["message"]["content"])["ok"], bool)
    labels = [9453, 2152]
    scores = post_json("/v1/score", {"query": [5, 6, 7, 8], "items": [[9, 10], [11]],
                                     "label_token_ids": labels})["scores"]
    assert len(scores) == 2
    for item, got in zip([[9, 10], [11]], scores):
        ref = post_json("/generate", {"input_ids": [5, 6, 7, 8] + item, "return_logprob": True,
                                      "token_ids_logprob": labels, "sampling_params": {"max_new_tokens": 1}})
        want = [lp for lp, _, _ in ref["meta_info"]["output_token_ids_logprobs"][0]]
        assert np.allclose(np.exp(want), got, atol=1e-4), (got, want)
    sid = httpx.post(url + "/open_session", json={"capacity_of_str_len": 1000}, timeout=60).json()
    first = post_json("/generate", {"input_ids": [1, 2, 3, 4], "session_params": {"id": sid},
                                    "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    second = post_json("/generate", {"input_ids": [5, 6], "session_params": {"id": sid,
                                                                             "rid": first["meta_info"]["id"]},
                                     "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert second["meta_info"]["prompt_tokens"] == 4 + len(first["output_ids"]) + 2
    assert httpx.post(url + "/close_session", json={"session_id": sid}, timeout=60).status_code == 200
    wait_pool_idle(url)


def moe_state(server) -> dict:
    return httpx.get(server.url + "/get_server_info", timeout=60).json()["internal_states"][0]["moe"]


def test_return_routed_experts_equal_transformers_router_top_k(server, tiny_moe):
    """meta_info.routed_experts (SGLang's base64 int32 [output tokens, layers, top-k]) holds, for each output token,
    the experts every layer chose at the position that produced it: the top-k of transformers' router logits
    there (prompt and output run through transformers at once)."""
    model, _, _ = tiny_moe
    cfg = model.config
    prompt = np.random.default_rng(1).integers(100, 49000, 40).tolist()
    out = post(server, "/generate", {"input_ids": prompt, "return_routed_experts": True, "sampling_params": {
        "max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}})
    routed = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), np.int32)
    routed = routed.reshape(NEW, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    with torch.no_grad():
        ref = model(torch.tensor([prompt + out["output_ids"]]), output_router_logits=True).router_logits
    assert len(ref) == cfg.num_hidden_layers
    for i in range(NEW):
        for layer, logits in enumerate(ref):
            expected = torch.topk(logits.reshape(-1, cfg.num_experts)[len(prompt) - 1 + i],
                                  cfg.num_experts_per_tok).indices
            assert sorted(routed[i, layer].tolist()) == sorted(expected.tolist()), (i, layer)
    plain = post(server, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}})
    assert "routed_experts" not in plain["meta_info"]


def test_expert_token_counts_and_imbalance(server):
    """/get_server_info's moe entry counts every real token once per expert it went to in each sparse layer (k per
    token and layer; padding rows not counted), and /metrics renders the imbalance gauge and load histogram."""
    before = moe_state(server)
    prompt = np.random.default_rng(2).integers(100, 49000, 50).tolist()  # unseen: nothing cached
    out = post(server, "/generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}})
    assert out["meta_info"]["cached_tokens"] == 0
    after = moe_state(server)
    delta = np.asarray(after["expert_tokens"]) - np.asarray(before["expert_tokens"])
    k = 2
    assert delta.sum(axis=1).tolist() == [k * (len(prompt) + 5 - 1)] * 2  # the last token is never fed back
    assert (delta >= 0).all() and after["steps"] > before["steps"] and after["ep_size"] == 1
    assert after["ep_imbalance"] == 1.0 and after["expert_imbalance"] >= 1.0
    window = np.asarray(after["window_expert_tokens"])
    assert window.shape == (2, 8) and window.sum() > 0
    metrics = httpx.get(server.url + "/metrics", timeout=60).text
    assert "sglang:moe_ep_imbalance{" in metrics and 'sglang:moe_expert_load_ratio_bucket{le="+Inf"' in metrics
