"""Mixture-of-experts feed-forward: top-k routing and the experts' gated MLPs, dropless.

Routing follows transformers' Qwen2-MoE / Qwen3-MoE / Mixtral blocks: router logits [T, E] -> softmax in
float32 -> the top-k experts per token -> (optionally) their weights renormalised to sum to 1 (Mixtral and
``norm_topk_prob`` models; Mixtral's "top-k of the logits, then softmax" is the same thing). No capacity
factor: every token reaches all of its k experts whatever the imbalance (dropless, as Megablocks, Gale et al.
2022).

The experts compute ``down(act(gate(x)) * up(x))`` with their weights stacked: ``w_gate`` and ``w_up``
[E, hidden, intermediate], ``w_down`` [E, intermediate, hidden] (input dimension first: the layout grouped
matmuls take). Backends (`--moe-backend`):

- ``dense``: every expert on every token, then the top-k combined (the reference; E/k times the FLOPs).
- ``tiled``: the same grouping, each expert's rows cut into tiles of a few rows and every tile multiplied by its
  expert's weights in a loop that runs only the tiles that hold rows (`tiled_grouped_matmul`; Megablox's tiling
  without its kernel). Each used expert's weights are read about once a step, so decode reads what the active
  parameters need. CPU's default: XLA's CPU ``ragged_dot`` costs as much as ``dense``.
- ``ragged_dot``: the T*k (token, expert) pairs sorted by expert and multiplied group by group with
  ``jax.lax.ragged_dot`` (XLA's grouped matmul; GPU).
- ``gmm``: the same grouping through JAX's Pallas Megablox grouped matmul
  (``jax.experimental.pallas.ops.tpu.megablox.gmm``; TPU, or its interpreter elsewhere: slow, for checks).
- ``auto``: gmm on TPU, tiled on CPU, ragged_dot on GPU.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from flax import nnx

from sgl_jax.srt.distributed.sharding import expert_axes
from sgl_jax.srt.layers.linear import Linear, initial_weight
from sgl_jax.srt.quantization.methods import as_scheme, get_method


def route(router_logits: jax.Array, top_k: int, renormalize: bool) -> Tuple[jax.Array, jax.Array]:
    """Top-k routing.

    Args:
        router_logits: [T, E], any float dtype (softmax runs in float32).
        top_k: experts per token (``num_experts_per_tok``).
        renormalize: scale the k weights to sum to 1 (``norm_topk_prob``; always for Mixtral).
    Returns:
        (weights [T, k] float32, expert ids [T, k] int32), highest weight first.
    """
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def experts_dense(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, weights: jax.Array,
                  ids: jax.Array, act: Callable) -> jax.Array:
    """The reference: every expert on every token, combined with the routing weights.

    Args:
        x: [T, hidden]; w_gate, w_up: [E, hidden, intermediate]; w_down: [E, intermediate, hidden]; each either
            an array in the model dtype or, quantized (`StackedExperts` with a quantization), a pair (int8 / fp8
            values of that shape, float32 scales [E, out]: one per expert and output channel).
        weights, ids: `route`'s [T, k] outputs. act: the gate activation (silu).
    Returns:
        [T, hidden] in x's dtype.
    """
    num_experts = _values(w_gate).shape[0]

    def each(eq, x, w):  # every expert's product [T, E, out], scaled per expert and output channel if quantized
        if not isinstance(w, tuple):
            return jnp.einsum(eq, x, w)
        q, scale = w
        return (jnp.einsum(eq, x, q.astype(x.dtype), preferred_element_type=jnp.float32) * scale).astype(x.dtype)

    h = act(each("td,edi->tei", x, w_gate)) * each("td,edi->tei", x, w_up)
    y = each("tei,eid->ted", h, w_down)
    combine = jnp.sum(jax.nn.one_hot(ids, num_experts, dtype=jnp.float32) * weights[..., None], axis=1)  # [T, E]
    return jnp.einsum("ted,te->td", y.astype(jnp.float32), combine).astype(x.dtype)


def _values(w):
    """The weight array of an expert weight given as an array or as a quantized (values, scales) pair."""
    return w[0] if isinstance(w, tuple) else w


def _grouped_product(matmul: Callable, x: jax.Array, w, group_sizes: jax.Array, row_expert: jax.Array):
    """`matmul`(x, w, group_sizes) for an expert weight given as an array or a quantized (values, scales) pair:
    quantized, the grouped matmul runs on the int8 / fp8 values (ragged_dot and the tiled loop take them as they
    are, converting inside the dot) and row r's result is scaled by its expert's (`row_expert` [M]) scales."""
    if not isinstance(w, tuple):
        return matmul(x, w, group_sizes)
    q, scale = w
    return (matmul(x, q, group_sizes).astype(jnp.float32) * scale[row_expert]).astype(x.dtype)


def _ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32).astype(lhs.dtype)


def _tile(n: int, cap: int = 128) -> int:
    """The largest tile <= cap that divides n (Megablox needs tiles that divide each dimension)."""
    for t in range(min(cap, n), 0, -1):
        if n % t == 0:
            return t
    return 1


def _gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, interpret: bool) -> jax.Array:
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    m, k = lhs.shape
    tiling = (_tile(m), _tile(k), _tile(rhs.shape[2]))
    if rhs.dtype != lhs.dtype:  # quantized experts: Megablox's kernel takes one dtype (a converted copy)
        rhs = rhs.astype(lhs.dtype)
    return gmm(lhs, rhs, group_sizes, preferred_element_type=jnp.float32, tiling=tiling,
               interpret=interpret).astype(lhs.dtype)


def tile_rows(num_rows: int, num_groups: int, cap: int = 128) -> int:
    """Rows per tile of `tiled_grouped_matmul`: the largest power of two <= the mean rows per group, in [1, cap]
    (decode: 1, so a tile is one token's row; a long prefill: `cap`)."""
    mean = max(1, num_rows // max(num_groups, 1))
    return min(cap, 1 << (mean.bit_length() - 1))


def tiled_grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """A grouped matmul that skips what has no rows: rows of lhs [M, K] in G consecutive groups (group_sizes [G]
    int32, summing to at most M), group g multiplied by rhs[g] [K, N]; returns [M, N] in lhs's dtype (float32
    accumulation; rows past the groups are 0).

    Each group is cut into tiles of `tile_rows` rows (its last tile partly masked), and a ``while_loop`` runs one
    [tile, K] x [K, N] product per tile that holds rows: empty groups cost nothing, and each group's weights are
    read once per tile. The tiling is Megablox's (Gale et al. 2022; JAX's ``megablox.gmm``) without a kernel: on
    CPU, XLA runs each product as a plain dot.
    """
    m, k = lhs.shape
    b = tile_rows(m, rhs.shape[0])
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes  # each group's first row
    tiles = (sizes + b - 1) // b
    tile_end = jnp.cumsum(tiles)  # each group's tiles end (exclusive) at this tile index
    rows = jnp.concatenate([lhs, jnp.zeros((b, k), lhs.dtype)])  # a tile may run past the last row

    def body(state):
        i, out = state
        g = jnp.searchsorted(tile_end, i, side="right")
        row0 = starts[g] + (i - (tile_end[g] - tiles[g])) * b
        x = jax.lax.dynamic_slice(rows, (row0, 0), (b, k))
        y = jnp.dot(x, jax.lax.dynamic_index_in_dim(rhs, g, keepdims=False), preferred_element_type=jnp.float32)
        y = jnp.where((jnp.arange(b) < starts[g] + sizes[g] - row0)[:, None], y, 0.0)
        cur = jax.lax.dynamic_slice(out, (row0, 0), (b, out.shape[1]))
        return i + 1, jax.lax.dynamic_update_slice(out, cur + y, (row0, 0))

    out = jnp.zeros((m + b, rhs.shape[2]), jnp.float32)
    _, out = jax.lax.while_loop(lambda s: s[0] < tile_end[-1], body, (jnp.int32(0), out))
    return out[:m].astype(lhs.dtype)


def grouped_matmul(backend: str, interpret: bool = False) -> Callable:
    """``f(lhs [M, K], rhs [G, K, N], group_sizes [G] int32) -> [M, N]``: rows of lhs in G consecutive
    groups, group g multiplied by rhs[g] (accumulated in float32). `backend`: "ragged_dot" or "gmm"
    (`interpret`: run the Pallas kernel in its interpreter, off TPU) or "tiled" (`tiled_grouped_matmul`).

    Raises:
        ValueError: another backend name.
    """
    if backend == "ragged_dot":
        return _ragged_dot
    if backend == "tiled":
        return tiled_grouped_matmul
    if backend == "gmm":
        return lambda lhs, rhs, sizes: _gmm(lhs, rhs, sizes, interpret)
    raise ValueError(f"no grouped matmul for backend {backend!r}")


def experts_grouped(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, weights: jax.Array,
                    ids: jax.Array, act: Callable, matmul: Callable) -> jax.Array:
    """Dropless grouped experts: the T*k (token, expert) pairs sorted by expert, each expert's rows multiplied
    by its own weights (`matmul`: a `grouped_matmul`), the results weighted and summed back per token.

    Shapes as `experts_dense`; an expert with no token is an empty group (no work, no padding). An id equal to E
    (a pair to skip: `experts_expert_parallel`) sorts after every group, where the grouped matmul gives 0.
    """
    num_tokens, top_k = ids.shape
    num_experts = _values(w_gate).shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # pairs grouped by expert
    token = order // top_k
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    row_expert = jnp.minimum(flat[order], num_experts - 1)  # (a skipped pair's rows are 0 whatever their scale)

    def mm(x, w):
        return _grouped_product(matmul, x, w, group_sizes, row_expert)

    xs = x[token]
    h = act(mm(xs, w_gate)) * mm(xs, w_up)
    y = mm(h, w_down).astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    out = jnp.zeros((num_tokens, x.shape[1]), jnp.float32).at[token].add(y)
    return out.astype(x.dtype)


def experts_expert_parallel(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                            weights: jax.Array, ids: jax.Array, act: Callable, matmul: Callable, mesh,
                            axes: Tuple[str, ...] = ("tensor",), zero_group: bool = True) -> jax.Array:
    """Expert parallelism: each device holds E / ep experts, split over the mesh `axes`
    (distributed/sharding.expert_axes: ``("tensor",)``, or ``("data", "tensor")`` for DP attention + EP), runs them
    on the (token, expert) pairs routed to them, and the partial outputs are summed back.

    - Over the tensor axis, each device already holds its data-parallel rank's tokens (replicated over the axis by
      attention's output projection), so dispatching costs nothing; the combine is one all-reduce over the axis,
      like a tensor-parallel row layer's.
    - Over every device, the ranks' tokens, routing weights and ids are first all-gathered over the ``data`` axis
      ([dp * T, ...] on every device), and the outputs are reduce-scattered back over it (each rank keeps its own
      T rows) before the all-reduce over the tensor axis. This is the all-gather / reduce-scatter dispatch; an
      all-to-all one (which moves only the pairs) needs ``ragged_all_to_all``, which XLA:CPU does not run
      (docs/parallelism.md has the bytes each moves per step).

    Pairs routed to another device sort last, after every group, where the grouped matmul gives 0 (tiled,
    ragged_dot) or, with `zero_group` (gmm, whose groups must cover every row), form one extra group multiplied
    by zero weights; every shape stays static. Dropless, as `experts_grouped`; shapes as `experts_dense`, global
    (x [dp * T, hidden] rows sharded over ``data``)."""
    from jax.sharding import PartitionSpec as P

    over_data = "data" in axes

    def local(x, wg, wu, wd, weights, ids):
        num_local = _values(wg).shape[0]
        if over_data:  # every rank's tokens on every device
            x, weights, ids = (jax.lax.all_gather(a, "data", axis=0, tiled=True) for a in (x, weights, ids))
        rel = ids - jax.lax.axis_index(tuple(axes)) * num_local
        mine = (rel >= 0) & (rel < num_local)

        def with_zero_group(w):
            if isinstance(w, tuple):
                return tuple(with_zero_group(a) for a in w)
            return jnp.concatenate([w, jnp.zeros((1, *w.shape[1:]), w.dtype)]) if zero_group else w

        out = experts_grouped(x, with_zero_group(wg), with_zero_group(wu), with_zero_group(wd),
                              jnp.where(mine, weights, 0.0), jnp.where(mine, rel, num_local), act,
                              matmul).astype(jnp.float32)
        if over_data:  # summed over every device of the data axis, each rank keeping its own rows
            out = jax.lax.psum_scatter(out, "data", scatter_dimension=0, tiled=True)
        return jax.lax.psum(out, "tensor").astype(x.dtype)

    split = tuple(axes) if over_data else axes[0]
    rows = P("data", None)

    def experts(w):  # an array [E, in, out], or quantized (values, scales [E, out])
        return (P(split, None, None), P(split, None)) if isinstance(w, tuple) else P(split, None, None)

    return jax.shard_map(local, mesh=mesh, in_specs=(rows, experts(w_gate), experts(w_up), experts(w_down), rows, rows),
                         out_specs=rows, check_vma=False)(x, w_gate, w_up, w_down, weights, ids)


def moe_experts(backend: str, x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                weights: jax.Array, ids: jax.Array, act: Callable = jax.nn.silu,
                interpret: bool = False) -> jax.Array:
    """The experts' output [T, hidden] for routed tokens, by `backend` ("dense", "tiled", "ragged_dot" or "gmm";
    a resolved `resolve_moe_backend` name). Shapes as `experts_dense`.

    Raises:
        ValueError: an unknown backend.
    """
    if backend == "dense":
        return experts_dense(x, w_gate, w_up, w_down, weights, ids, act)
    return experts_grouped(x, w_gate, w_up, w_down, weights, ids, act, grouped_matmul(backend, interpret))


class StackedExperts(nnx.Module):
    """The E experts' gated-MLP weights, stacked: ``<gate>`` and ``<up>`` [E, hidden, intermediate], ``<down>``
    [E, intermediate, hidden], under the checkpoint's own names (`names`: (gate, up, down), e.g.
    ("gate_proj", "up_proj", "down_proj"), Mixtral's ("w1", "w3", "w2")). The loader stacks the checkpoint's
    per-expert ``experts.<e>.<name>.weight`` [out, in] tensors into them, transposed.

    With a `quantization` (a --quantization method or QuantScheme), each is stored in the method's int8 / fp8
    dtype with ``<name>_scale`` float32 [E, out] (one scale per expert and output channel; the loader quantizes
    the stacked float weights), weight-only for every method: the grouped matmul takes the int8 / fp8 values and
    the scales multiply its rows (`experts_grouped`)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, names: Sequence[str], *, dtype,
                 rngs: Optional[nnx.Rngs], quantization=None):
        self.names = tuple(names)
        scheme = as_scheme(quantization)
        self.quantized = scheme is not None
        for name, shape in zip(self.names, ((hidden, intermediate), (hidden, intermediate), (intermediate, hidden))):
            if scheme is None:
                setattr(self, name, nnx.Param(initial_weight(rngs, (num_experts, *shape), dtype)))
            else:
                setattr(self, name, nnx.Param(jnp.zeros((num_experts, *shape), get_method(scheme.method).weight_dtype)))
                setattr(self, name + "_scale", nnx.Param(jnp.ones((num_experts, shape[1]), jnp.float32)))

    def weights(self) -> tuple:
        """(w_gate, w_up, w_down): arrays, or (values, scales) pairs when quantized."""
        if not self.quantized:
            return tuple(getattr(self, n)[...] for n in self.names)
        return tuple((getattr(self, n)[...], getattr(self, n + "_scale")[...]) for n in self.names)


class SparseMoeBlock(nnx.Module):
    """A top-k mixture-of-experts MLP (transformers' Qwen2-MoE / Qwen3-MoE / Mixtral sparse blocks): the router
    ``gate`` (Linear hidden -> E, no bias), the `StackedExperts`, and optionally Qwen2-MoE's shared expert (a
    dense gated MLP every token goes through, scaled by ``sigmoid(shared_expert_gate(x))``).

    Args:
        num_experts, top_k, renormalize: routing (see `route`).
        backend: a resolved `--moe-backend` ("dense", "tiled", "ragged_dot" or "gmm"; static: part of the
            program).
        expert_names: the checkpoint names of the experts' (gate, up, down) weights.
        shared_expert: a module computing the shared expert ([T, hidden] -> [T, hidden]), or None.
        mesh, ep_size: with ep_size > 1, `experts_expert_parallel` over the axes
            `distributed.sharding.expert_axes` gives (the tensor axis, or every device).
        quantization: the experts' --quantization method or QuantScheme (`StackedExperts`); the router stays in
            the model dtype.
    Raises:
        ValueError: ep_size > 1 without a mesh, not dividing num_experts, or not an ``--ep-size`` the mesh
            allows (`expert_axes`).
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, renormalize: bool,
                 backend: str, *, dtype, rngs: nnx.Rngs, expert_names: Sequence[str] = ("gate_proj", "up_proj",
                                                                                         "down_proj"),
                 shared_expert: Optional[nnx.Module] = None, mesh=None, ep_size: int = 1, quantization=None):
        if ep_size > 1 and (mesh is None or num_experts % ep_size):
            raise ValueError(f"--ep-size {ep_size} needs a mesh and must divide the {num_experts} experts")
        self.gate = Linear(hidden, num_experts, dtype=dtype, rngs=rngs)
        self.experts = StackedExperts(num_experts, hidden, intermediate, expert_names, dtype=dtype, rngs=rngs,
                                      quantization=quantization)
        self.num_experts, self.top_k = int(num_experts), int(top_k)
        self.renormalize = bool(renormalize)
        self.backend = backend
        self.shared_expert = shared_expert
        self.shared_expert_gate = Linear(hidden, 1, dtype=dtype, rngs=rngs) if shared_expert is not None else None
        self.mesh = mesh if ep_size > 1 else None  # (static: not a parameter)
        self.ep_axes = (expert_axes(ep_size, int(mesh.shape["tensor"]), int(mesh.shape["data"]))
                        if ep_size > 1 else ())

    def __call__(self, x: jax.Array, valid: Optional[jax.Array] = None) -> jax.Array:
        """x [T, hidden] -> [T, hidden] (x's dtype). The routing's expert ids [T, k] int32 are sown as the
        ``routed_ids`` intermediate (`routed_experts` reads them; unused, XLA drops them). `valid` [T] bool: the
        real rows; with the tiled and ragged_dot backends the others (a bucket's padding) skip the experts (their
        routed output is 0), so padding costs no expert work."""
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        self.sow(nnx.Intermediate, "routed_ids", ids, reduce_fn=lambda _, new: new, init_fn=lambda: None)
        if valid is not None and self.backend in ("tiled", "ragged_dot"):
            ids = jnp.where(valid[:, None], ids, self.num_experts)  # sorts after every group: no work
            weights = jnp.where(valid[:, None], weights, 0.0)
        interpret = jax.default_backend() != "tpu"
        if self.mesh is not None:
            if self.backend == "dense":
                raise ValueError("--moe-backend dense is the single-device reference; use tiled, ragged_dot or "
                                 "gmm with --ep-size")
            out = experts_expert_parallel(x, *self.experts.weights(), weights, ids, jax.nn.silu,
                                          grouped_matmul(self.backend, interpret), self.mesh,
                                          axes=self.ep_axes, zero_group=self.backend == "gmm")
        else:
            out = moe_experts(self.backend, x, *self.experts.weights(), weights, ids, interpret=interpret)
        if self.shared_expert is not None:
            gate = jax.nn.sigmoid(self.shared_expert_gate(x).astype(jnp.float32))
            out = (out.astype(jnp.float32) + gate * self.shared_expert(x).astype(jnp.float32)).astype(x.dtype)
        return out


def sown_routed_ids(block: SparseMoeBlock) -> jax.Array:
    """The expert ids [T, k] int32 that `block`'s last call routed to (after a call in the same trace).

    Raises:
        ValueError: the block has not been called.
    """
    sown = getattr(block, "routed_ids", None)
    if sown is None:
        raise ValueError("the MoE block has not run: no routed ids to read")
    return sown.get_value()


def expert_token_counts(routed: jax.Array, valid: jax.Array, num_experts: int) -> jax.Array:
    """Tokens routed to each expert of each layer.

    Args:
        routed: [L, T, k] int32 expert ids per layer and token (-1: a layer without experts).
        valid: [T] bool, the real tokens (padding rows are not counted).
        num_experts: E.
    Returns:
        [L, E] int32; each real token adds 1 to each of its k experts in each MoE layer.
    """
    num_layers = routed.shape[0]
    ok = (routed >= 0) & valid[None, :, None]
    layer = jnp.broadcast_to(jnp.arange(num_layers, dtype=jnp.int32)[:, None, None], routed.shape)
    return jnp.zeros((num_layers, num_experts), jnp.int32).at[layer, jnp.maximum(routed, 0)].add(
        ok.astype(jnp.int32))
