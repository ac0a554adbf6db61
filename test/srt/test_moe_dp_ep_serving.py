"""Data-parallel attention with expert parallelism (DP attention + EP, the usual large-MoE deployment) through real
servers on 8 virtual CPU devices: tiny random Qwen3-MoE (with a dense layer), Qwen2-MoE (shared expert) and
Mixtral, each served at --dp-size 2 --tp-size 2 --ep-size 2 with SmolLM2's vocabulary and tokenizer.

For each: chat, streamed completions, structured output, /v1/score and a session answer; 16 prompts x 32
greedy tokens sent at once (so both ranks batch) equal transformers' float32 greedy tokens, the output logprobs
are within 1e-3 of transformers', every expert of every sparse layer is routed to, the routed experts of one
request equal the top-k of transformers' router logits, nothing compiles after warm-up and every rank's KV pool
is idle afterwards (the module server's teardown).
"""

from __future__ import annotations

import base64
import concurrent.futures as cf

import httpx
import numpy as np
import pytest
import torch

from srt_helpers import hf_greedy, module_server, wait_pool_idle
from test_moe_models import tiny_config
from test_moe_serving import check_every_endpoint
from test_tensor_parallel import save_tiny

XLA_ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
ARGS = ["--dp-size", "2", "--tp-size", "2", "--ep-size", "2", "--moe-backend", "tiled",
        "--context-length", "512", "--max-total-tokens", "4096", "--max-running-requests", "16",
        "--precompile-token-paddings", "256", "--precompile-bs-paddings", "16", "--chunked-prefill-size", "256",
        "--enable-return-routed-experts"]
NUM_PROMPTS, NEW, LOGPROB_TOL = 16, 32, 1e-3


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "mixtral"])
def served(request, tmp_path_factory):
    """(transformers model, server) of one architecture at dp 2 x ep 2."""
    from transformers import AutoModelForCausalLM

    from sgl_jax.srt.configs.model_config import resolve_model_path
    from srt_helpers import default_model_path

    cfg = tiny_config(request.param)
    cfg.vocab_size = 49152  # SmolLM2's tokenizer's ids
    path = save_tiny(tmp_path_factory.mktemp(f"tiny_{request.param}_dp_ep"), cfg, seed=3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = resolve_model_path(default_model_path()).hf_dir
    for server in module_server(["--model-path", path, "--tokenizer-path", tokenizer, *ARGS], env=XLA_ENV):
        yield model, server


def generate(url: str, ids, **extra) -> dict:
    r = httpx.post(url + "/generate", timeout=600, json={
        "input_ids": ids, "return_logprob": True, **extra,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


def hf_logprobs(model, prompt, output) -> np.ndarray:
    """transformers' log-probabilities of `output`'s tokens after `prompt` (one forward over both)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0].numpy()


def test_dp2_ep2_matches_transformers_and_routes_every_expert(served):
    model, server = served
    torch.set_num_threads(1)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(100, 49000, int(n)).tolist() for n in rng.integers(4, 60, NUM_PROMPTS)]
    with cf.ThreadPoolExecutor(NUM_PROMPTS) as pool:
        outs = list(pool.map(lambda p: generate(server.url, p), prompts))
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out["output_ids"] == hf_greedy(model, prompt, NEW), f"prompt {i}"
        lps = np.asarray([e[0] for e in out["meta_info"]["output_token_logprobs"]])
        assert np.abs(lps - hf_logprobs(model, prompt, out["output_ids"])).max() <= LOGPROB_TOL, f"prompt {i}"
    ranks = httpx.get(server.url + "/get_server_info", timeout=60).json()["internal_states"]
    assert [r["dp_rank"] for r in ranks] == [0, 1] and all(r["num_assigned_reqs"] > 0 for r in ranks)
    assert all(r["num_compiles_after_warmup"] == 0 for r in ranks), ranks
    moe = ranks[0]["moe"]
    assert moe["ep_size"] == 2
    for layer in moe["sparse_layers"]:
        assert min(moe["expert_tokens"][layer]) > 0, (layer, moe["expert_tokens"][layer])
    wait_pool_idle(server.url)


def test_dp2_ep2_routed_experts_equal_transformers_router_top_k(served):
    model, server = served
    cfg = model.config
    num_experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    prompt = np.random.default_rng(8).integers(100, 49000, 30).tolist()
    out = generate(server.url, prompt, return_routed_experts=True)
    routed = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), np.int32)
    routed = routed.reshape(NEW, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    with torch.no_grad():
        ref = model(torch.tensor([prompt + out["output_ids"]]), output_router_logits=True).router_logits
    sparse = [i for i in range(cfg.num_hidden_layers) if routed[0, i, 0] >= 0]
    assert len(ref) == len(sparse) and (routed[:, [i for i in range(cfg.num_hidden_layers) if i not in sparse]]
                                        == -1).all()
    for layer, logits in zip(sparse, ref):
        top = torch.topk(logits.reshape(-1, num_experts)[len(prompt) - 1:len(prompt) - 1 + NEW],
                         cfg.num_experts_per_tok).indices.sort(-1).values.numpy()
        assert (np.sort(routed[:, layer], -1) == top).all(), layer
    wait_pool_idle(server.url)


def test_dp2_ep2_every_endpoint(served):
    """Chat, streamed completions, structured output, /v1/score and a session's two turns at dp 2 x ep 2."""
    check_every_endpoint(served[1].url)
