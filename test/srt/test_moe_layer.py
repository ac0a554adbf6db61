"""The mixture-of-experts layer (layers/moe.py) against transformers' sparse MoE blocks (float32) and its
backends against each other, on routings where some experts get no token and one gets almost all."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral import modeling_mixtral
from transformers.models.qwen3_moe import modeling_qwen3_moe

from sgl_jax.srt.layers.moe import moe_experts, route
from sgl_jax.srt.server_args import MOE_BACKENDS, resolve_moe_backend

T, D, I, E, K = 24, 32, 16, 8, 2


def skewed_case(seed: int = 0):
    """x [T, D], stacked expert weights and router logits where expert 3 gets nearly every token and experts
    5 and 6 none."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    w_gate, w_up = (jnp.asarray(rng.standard_normal((E, D, I)) * 0.1, jnp.float32) for _ in range(2))
    w_down = jnp.asarray(rng.standard_normal((E, I, D)) * 0.1, jnp.float32)
    logits = jnp.asarray(rng.standard_normal((T, E)), jnp.float32)
    logits = logits.at[:, 3].add(5.0).at[:, 5].add(-50.0).at[:, 6].add(-50.0)
    return x, w_gate, w_up, w_down, logits


@pytest.mark.parametrize("backend", ["ragged_dot", "gmm"])
def test_grouped_backends_equal_dense_on_skewed_routing(backend):
    x, w_gate, w_up, w_down, logits = skewed_case()
    weights, ids = route(logits, K, renormalize=True)
    counts = np.bincount(np.asarray(ids).ravel(), minlength=E)
    assert counts[5] == counts[6] == 0 and counts[3] == T  # empty experts and one that gets every token
    ref = moe_experts("dense", x, w_gate, w_up, w_down, weights, ids)
    out = moe_experts(backend, x, w_gate, w_up, w_down, weights, ids, interpret=True)  # gmm: Pallas interpreter
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)


def test_every_token_in_one_expert_and_one_token():
    """Extremes of the grouping: all pairs in one group, and a single token."""
    x, w_gate, w_up, w_down, logits = skewed_case(1)
    logits = logits.at[:, 0].add(100.0)
    for n in (T, 1):
        weights, ids = route(logits[:n], 1, renormalize=False)
        assert set(np.asarray(ids).ravel()) == {0}
        ref = moe_experts("dense", x[:n], w_gate, w_up, w_down, weights, ids)
        out = moe_experts("ragged_dot", x[:n], w_gate, w_up, w_down, weights, ids)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)


def _stacked_from_fused(gate_up: torch.Tensor, down: torch.Tensor):
    """transformers' fused expert weights (gate_up_proj [E, 2I, D], down_proj [E, D, I]) as ours
    ([E, D, I] x2, [E, I, D])."""
    g, u = gate_up.detach().numpy()[:, :I, :], gate_up.detach().numpy()[:, I:, :]
    return (jnp.asarray(g.transpose(0, 2, 1)), jnp.asarray(u.transpose(0, 2, 1)),
            jnp.asarray(down.detach().numpy().transpose(0, 2, 1)))


@pytest.mark.parametrize("arch,renormalize", [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)])
@pytest.mark.parametrize("backend", ["dense", "ragged_dot"])
def test_matches_transformers_sparse_moe_block(arch, renormalize, backend):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if arch == "qwen3_moe":
        cfg = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                             norm_topk_prob=renormalize)
        block = modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(cfg)
    else:
        cfg = MixtralConfig(hidden_size=D, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)
        block = modeling_mixtral.MixtralSparseMoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(T, D)
    with torch.no_grad():
        ref = block(x[None])
    ref = (ref[0] if isinstance(ref, tuple) else ref)[0].numpy()
    w_gate, w_up, w_down = _stacked_from_fused(block.experts.gate_up_proj, block.experts.down_proj)
    xj = jnp.asarray(x.numpy())
    weights, ids = route(xj @ jnp.asarray(block.gate.weight.detach().numpy()).T, K, renormalize)
    out = moe_experts(backend, xj, w_gate, w_up, w_down, weights, ids)
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=1e-5)


def test_backend_names():
    assert resolve_moe_backend("auto", "tpu") == "gmm"
    assert resolve_moe_backend("auto", "cpu") == resolve_moe_backend("auto", "gpu") == "ragged_dot"
    assert all(resolve_moe_backend(b, "cpu") == b for b in MOE_BACKENDS if b != "auto")
    with pytest.raises(ValueError, match="--moe-backend"):
        resolve_moe_backend("megablocks", "cpu")
    with pytest.raises(ValueError):
        moe_experts("auto", *skewed_case()[:4], *route(skewed_case()[4], K, True))
