"""The mixture-of-experts layer (layers/moe.py) against transformers' sparse MoE blocks (float32) and its
backends against each other, on routings where some experts get no token and one gets almost all."""

from __future__ import annotations

import jax
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


@pytest.mark.parametrize("backend", ["tiled", "ragged_dot", "gmm"])
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
        for backend in ("tiled", "ragged_dot"):
            out = moe_experts(backend, x[:n], w_gate, w_up, w_down, weights, ids)
            np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)


@pytest.mark.parametrize("rows,groups", [(8, 128), (64, 8), (300, 7), (5, 1)])
def test_tiled_grouped_matmul_equals_ragged_dot(rows, groups):
    """Every tile size `tile_rows` picks (1 row for decode-like shapes up to the cap), groups of any size
    including empty ones, and rows past the groups (0)."""
    from sgl_jax.srt.layers.moe import tiled_grouped_matmul

    rng = np.random.default_rng(rows)
    sizes = np.bincount(rng.integers(0, groups, rows - 2), minlength=groups)  # 2 rows past the groups
    lhs = jnp.asarray(rng.standard_normal((rows, 24)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((groups, 24, 40)), jnp.float32)
    got = np.asarray(tiled_grouped_matmul(lhs, rhs, jnp.asarray(sizes, jnp.int32)))
    ref = np.asarray(jax.lax.ragged_dot(lhs[:rows - 2], rhs, jnp.asarray(sizes, jnp.int32)))
    np.testing.assert_allclose(got[:rows - 2], ref, atol=1e-4, rtol=1e-5)
    assert not got[rows - 2:].any()


def _stacked_from_fused(gate_up: torch.Tensor, down: torch.Tensor):
    """transformers' fused expert weights (gate_up_proj [E, 2I, D], down_proj [E, D, I]) as ours
    ([E, D, I] x2, [E, I, D])."""
    g, u = gate_up.detach().numpy()[:, :I, :], gate_up.detach().numpy()[:, I:, :]
    return (jnp.asarray(g.transpose(0, 2, 1)), jnp.asarray(u.transpose(0, 2, 1)),
            jnp.asarray(down.detach().numpy().transpose(0, 2, 1)))


@pytest.mark.parametrize("arch,renormalize", [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)])
@pytest.mark.parametrize("backend", ["dense", "tiled", "ragged_dot"])
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
    assert resolve_moe_backend("auto", "cpu") == "tiled" and resolve_moe_backend("auto", "gpu") == "ragged_dot"
    assert all(resolve_moe_backend(b, "cpu") == b for b in MOE_BACKENDS if b != "auto")
    with pytest.raises(ValueError, match="--moe-backend"):
        resolve_moe_backend("megablocks", "cpu")
    with pytest.raises(ValueError):
        moe_experts("auto", *skewed_case()[:4], *route(skewed_case()[4], K, True))


def test_expert_token_counts_skip_padding_and_dense_layers():
    """Each real token adds 1 to each of its k experts in each sparse layer; padding rows and dense layers (-1)
    add nothing (a count over every row would fail the first assert)."""
    from sgl_jax.srt.layers.moe import expert_token_counts

    routed = jnp.asarray([[[0, 1], [1, 2], [3, 3]], [[-1, -1]] * 3], jnp.int32)  # [L=2, T=3, k=2]
    counts = np.asarray(expert_token_counts(routed, jnp.asarray([True, True, False]), 4))
    assert counts.tolist() == [[1, 2, 1, 0], [0, 0, 0, 0]]


def test_moe_stats_window_imbalance_and_histogram():
    """Totals since start, the window's counts, max/mean tokens per expert-parallel device and per expert, and the
    load-ratio histogram observed once per window (ratios per sparse layer's expert)."""
    from sgl_jax.srt.model_executor.moe_stats import LOAD_RATIO_BUCKETS, MoeStats

    stats = MoeStats(num_layers=2, num_experts=4, sparse_layers=[1], ep_size=2, window_steps=2)
    stats.add_step(np.asarray([[0, 0, 0, 0], [3, 1, 0, 0]]))
    assert stats.state()["load_ratio_histogram"]["count"] == 0  # the window is not complete yet
    stats.add_step(np.asarray([[0, 0, 0, 0], [1, 1, 2, 0]]))
    st = stats.state()
    assert st["expert_tokens"] == [[0, 0, 0, 0], [4, 2, 2, 0]] and st["window_steps"] == 2
    assert st["ep_imbalance"] == pytest.approx(6 / 4)  # devices hold experts {0, 1} (6 tokens) and {2, 3} (2)
    assert st["expert_imbalance"] == pytest.approx(4 / 2)
    hist = st["load_ratio_histogram"]  # ratios 2, 1, 1, 0 of the layer's mean 2
    assert hist["count"] == 4 and hist["sum"] == pytest.approx(4.0)
    assert [hist["counts"][LOAD_RATIO_BUCKETS.index(b)] for b in (0.0, 1.0, 2.0)] == [1, 2, 1]
    stats.add_step(np.zeros((2, 4)))
    stats.add_step(np.zeros((2, 4)))
    assert stats.state()["ep_imbalance"] is None  # no token in the window


_EP_WORKER = r"""
import os, sys, json
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
sys.path.insert(0, sys.argv[1])
from test_moe_layer import skewed_case, K
from sgl_jax.srt.distributed.mesh import create_mesh
from sgl_jax.srt.distributed.sharding import expert_axes, param_spec
from sgl_jax.srt.layers.moe import experts_expert_parallel, grouped_matmul, moe_experts, route
errors = {}
for backend in ("tiled", "ragged_dot", "gmm"):
    for dp, tp, ep in ((1, 2, 2), (1, 4, 4), (2, 1, 2), (2, 2, 2), (2, 2, 4), (4, 2, 8)):
        mesh = create_mesh(tp, dp)
        x, w_gate, w_up, w_down, logits = skewed_case(2)
        weights, ids = route(logits, K, renormalize=True)
        ref = moe_experts("dense", x, w_gate, w_up, w_down, weights, ids)
        axes = expert_axes(ep, tp, dp)
        rows = NamedSharding(mesh, P("data", None))
        w = [jax.device_put(a, NamedSharding(mesh, param_spec("mlp.experts.w", axes))) for a in (w_gate, w_up, w_down)]
        assert w[0].addressable_shards[0].data.shape[0] == w_gate.shape[0] // ep
        f = jax.jit(lambda x, wg, wu, wd, weights, ids: experts_expert_parallel(
            x, wg, wu, wd, weights, ids, jax.nn.silu, grouped_matmul(backend, True), mesh, axes=axes,
            zero_group=backend == "gmm"))
        out = f(*(jax.device_put(a, rows) for a in (x,)), *w, jax.device_put(weights, rows), jax.device_put(ids, rows))
        errors[f"{backend} dp{dp} tp{tp} ep{ep}"] = float(np.abs(np.asarray(out) - np.asarray(ref)).max())
print(json.dumps(errors))
"""


def test_expert_parallel_equals_dense_at_every_mesh_shape():
    """`experts_expert_parallel` at ep over the tensor axis (tp 2 and 4, dp 2 x tp 2) and over every device (DP
    attention + EP: dp 2 x tp 1, dp 2 x tp 2 at ep 4, dp 4 x tp 2 at ep 8), with tiled, ragged_dot and gmm
    (interpreted), equals the single-device dense reference within 1e-5 on the skewed routing (one expert gets
    every token, two get none): a subprocess with 8 virtual CPU devices, each holding E / ep experts."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", _EP_WORKER, here], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    errors = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(errors) == 18 and max(errors.values()) <= 1e-5, errors
