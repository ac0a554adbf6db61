"""Mixture-of-experts models through real servers on 8 virtual CPU devices at the issue's four mesh shapes: one
device (tp1); expert parallelism over the tensor axis (ep2: --tp-size 2 --ep-size 2; ep4: --tp-size 4 --ep-size 4,
2 experts and one of the 2 KV heads, replicated twice, per device); and data-parallel attention with the experts
over every device (dp2ep2: --dp-size 2 --ep-size 2, DP attention + EP, the usual large-MoE deployment: each rank
attends to its own requests, the MoE layers gather both ranks' tokens); and experts over a dp x tp mesh
(dp2tp2ep4: --dp-size 2 --tp-size 2 --ep-size 4). Tiny random Qwen3-MoE (with a dense layer), Qwen2-MoE (shared
expert) and Mixtral, each with SmolLM2's vocabulary and tokenizer, are served at two shapes each, every shape
served at least once and dp2ep2 by two architectures (one server per pair, ids like ``qwen3_moe-ep2``): six servers,
where every architecture at every shape took thirteen (~280 s of the suite). The layer itself is checked at more
shapes in test_moe_layer.py, and Qwen3-MoE at ep 2 and 4 against ep 1 in-process in test_moe_models.py.

For each: chat, streamed completions, structured output, /v1/score and a session answer; 16 prompts x 32
greedy tokens sent at once (so every DP rank batches) equal transformers' float32 greedy tokens, the output logprobs
are within 1e-3 of transformers', every expert of every sparse layer is routed to, the server reports the mesh's DP
ranks and --ep-size, the routed experts of one request equal the top-k of transformers' router logits, nothing
compiles after warm-up and every rank's KV pool is idle afterwards (the module server's teardown).
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
ARGS = ["--moe-backend", "tiled", "--context-length", "512", "--max-total-tokens", "4096",
        "--max-running-requests", "16", "--precompile-token-paddings", "256", "--precompile-bs-paddings", "16",
        "--chunked-prefill-size", "256", "--enable-return-routed-experts"]
NUM_PROMPTS, NEW, LOGPROB_TOL = 16, 32, 1e-3
MESHES = {"tp1": dict(dp=1, tp=1, ep=1), "ep2": dict(dp=1, tp=2, ep=2), "ep4": dict(dp=1, tp=4, ep=4),
          "dp2ep2": dict(dp=2, tp=1, ep=2), "dp2tp2ep4": dict(dp=2, tp=2, ep=4)}
# each architecture at two shapes, each shape at least once, the usual large-MoE deployment (dp2ep2) twice
SERVED = [("qwen3_moe", "ep2"), ("qwen3_moe", "dp2ep2"), ("qwen2_moe", "ep4"), ("qwen2_moe", "dp2tp2ep4"),
          ("mixtral", "tp1"), ("mixtral", "dp2ep2")]


def mesh_flags(mesh: dict) -> list:
    """The server's parallel flags for `mesh` (only those above 1: tp1 passes none)."""
    return [f for axis, n in mesh.items() if n > 1 for f in (f"--{axis}-size", str(n))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> (transformers model, model dir): each tiny random model saved once, for all its meshes."""
    from transformers import AutoModelForCausalLM

    saved = {}

    def get(arch: str):
        if arch not in saved:
            cfg = tiny_config(arch)
            cfg.vocab_size = 49152  # SmolLM2's tokenizer's ids
            path = save_tiny(tmp_path_factory.mktemp(f"tiny_{arch}"), cfg, seed=3)
            saved[arch] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), path
        return saved[arch]

    return get


@pytest.fixture(scope="module", params=SERVED, ids=lambda p: "-".join(p))
def served(request, checkpoints):
    """(transformers model, server, mesh) of one architecture at one mesh shape."""
    from sgl_jax.srt.configs.model_config import resolve_model_path
    from srt_helpers import default_model_path

    arch, mesh = request.param
    model, path = checkpoints(arch)
    tokenizer = resolve_model_path(default_model_path()).hf_dir
    args = ["--model-path", path, "--tokenizer-path", tokenizer, *mesh_flags(MESHES[mesh]), *ARGS]
    for server in module_server(args, env=XLA_ENV):
        yield model, server, MESHES[mesh]


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


def test_matches_transformers_and_routes_every_expert(served):
    model, server, mesh = served
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
    assert [r["dp_rank"] for r in ranks] == list(range(mesh["dp"])), ranks
    assert all(r["num_assigned_reqs"] > 0 for r in ranks), ranks
    assert all(r["num_compiles_after_warmup"] == 0 for r in ranks), ranks
    moe = ranks[0]["moe"]
    assert moe["ep_size"] == mesh["ep"]
    for layer in moe["sparse_layers"]:
        assert min(moe["expert_tokens"][layer]) > 0, (layer, moe["expert_tokens"][layer])
    wait_pool_idle(server.url)


def test_routed_experts_equal_transformers_router_top_k(served):
    model, server, _ = served
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


def test_every_endpoint(served):
    """Chat, streamed completions, structured output, /v1/score and a session's two turns."""
    check_every_endpoint(served[1].url)
