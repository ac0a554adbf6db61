"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE (with its shared expert) and Mixtral, in Flax NNX.

Attention is Llama's (`models/llama.py`: Qwen3-MoE with q/k RMSNorm, Qwen2-MoE with q/k/v biases); the MLP of
each sparse layer is a `layers.moe.SparseMoeBlock` (top-k routing, dropless, the experts' weights stacked, by
the resolved ``--moe-backend`` in ``model_config.moe_backend``). Parameter paths mirror transformers' state-dict
keys (``model.layers.0.mlp.gate.weight``, Mixtral's ``model.layers.0.block_sparse_moe.gate.weight``), except the
stacked experts: ``model.layers.0.mlp.experts.gate_proj`` [E, hidden, intermediate] holds every
``model.layers.0.mlp.experts.<e>.gate_proj.weight`` (model_loader/loader.py stacks them).

Which layers are sparse (transformers' Qwen2-MoE / Qwen3-MoE rule): layer i is, unless it is in
``mlp_only_layers``, when ``num_experts > 0`` and ``(i + 1) % decoder_sparse_step == 0``; the others have a dense
MLP of ``intermediate_size``. Every Mixtral layer is sparse.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import jax
import jax.numpy as jnp
from flax import nnx

from sgl_jax.srt.layers.moe import SparseMoeBlock, sown_routed_ids
from sgl_jax.srt.models.llama import LlamaForCausalLM, LlamaMLP


def is_sparse_layer(cfg, layer_id: int) -> bool:
    """Whether layer `layer_id` of a Qwen2-/Qwen3-MoE config has experts (see the module docstring)."""
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    return (layer_id not in (getattr(cfg, "mlp_only_layers", None) or [])
            and int(getattr(cfg, "num_experts", 0) or 0) > 0 and (layer_id + 1) % step == 0)


class _MoeForCausalLM(LlamaForCausalLM):
    """A causal LM whose layers' MLPs are `SparseMoeBlock`s (or dense `LlamaMLP`s on dense layers; the shared
    decoder stack of models/llama.py runs them); subclasses say how each layer's MLP is built (`build_mlp`).
    Same call, logits and sharding as `LlamaForCausalLM`."""

    def build_mlp(self, cfg, model_config, layer_id: int, dtype, rngs: nnx.Rngs) -> nnx.Module:
        """Layer `layer_id`'s MLP (each subclass builds its own)."""
        raise NotImplementedError

    def moe_routing(self) -> Optional[Tuple[int, int, List[int]]]:
        """(num_experts E, experts per token k, the indices of the sparse layers); None if there are none."""
        sparse = [i for i, b in enumerate(self._mlps()) if isinstance(b, SparseMoeBlock)]
        if not sparse:
            return None
        block = self._mlps()[sparse[0]]
        return block.num_experts, block.top_k, sparse

    def routed_experts(self) -> Optional[jax.Array]:
        """After a forward of T tokens (in the same trace): the expert ids [L, T, k] int32 each layer routed each
        token to, -1 on layers with a dense MLP; None without sparse layers."""
        routing = self.moe_routing()
        if routing is None:
            return None
        per_layer, num_tokens = [], None
        for block in self._mlps():
            if isinstance(block, SparseMoeBlock):
                per_layer.append(sown_routed_ids(block))
                num_tokens = per_layer[-1].shape[0]
            else:
                per_layer.append(None)
        dense = jnp.full((num_tokens, routing[1]), -1, jnp.int32)
        return jnp.stack([dense if ids is None else ids for ids in per_layer])

    def _mlps(self):
        return [getattr(layer, layer.mlp_name) for layer in self.model.layers]


class Qwen3MoeForCausalLM(_MoeForCausalLM):
    """transformers' `Qwen3MoeForCausalLM`: q/k RMSNorm, ``num_experts`` experts of ``moe_intermediate_size``,
    top ``num_experts_per_tok``, renormalised when ``norm_topk_prob``."""

    architectures = ("Qwen3MoeForCausalLM",)
    qk_norm = True

    def build_mlp(self, cfg, model_config, layer_id, dtype, rngs):
        hidden = model_config.hidden_size
        if not is_sparse_layer(cfg, layer_id):
            return LlamaMLP(hidden, int(cfg.intermediate_size), dtype, rngs, quantization=model_config.quant_scheme)
        return SparseMoeBlock(hidden, int(cfg.moe_intermediate_size), int(cfg.num_experts),
                              int(cfg.num_experts_per_tok), bool(cfg.norm_topk_prob), model_config.moe_backend,
                              dtype=dtype, rngs=rngs, mesh=self.mesh, ep_size=model_config.ep_size,
                              shared_expert=self.shared_expert(cfg, hidden, dtype, rngs, model_config.quant_scheme),
                              quantization=model_config.quant_scheme)

    def shared_expert(self, cfg, hidden: int, dtype, rngs, quantization=None) -> Optional[nnx.Module]:
        return None


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """transformers' `Qwen2MoeForCausalLM`: q/k/v biases (``qkv_bias``), no q/k norm, and per sparse layer a
    shared expert of ``shared_expert_intermediate_size`` scaled by ``sigmoid(shared_expert_gate(x))``."""

    architectures = ("Qwen2MoeForCausalLM",)
    qk_norm = False

    def shared_expert(self, cfg, hidden, dtype, rngs, quantization=None):
        size = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
        return LlamaMLP(hidden, size, dtype, rngs, quantization=quantization) if size > 0 else None


class MixtralForCausalLM(_MoeForCausalLM):
    """transformers' `MixtralForCausalLM`: every layer sparse (``block_sparse_moe``), ``num_local_experts``
    experts of ``intermediate_size`` named w1 (gate), w3 (up), w2 (down), top ``num_experts_per_tok``
    renormalised (Mixtral's softmax over the top-k logits)."""

    architectures = ("MixtralForCausalLM",)
    mlp_name = "block_sparse_moe"

    def build_mlp(self, cfg, model_config, layer_id, dtype, rngs):
        return SparseMoeBlock(model_config.hidden_size, int(cfg.intermediate_size), int(cfg.num_local_experts),
                              int(cfg.num_experts_per_tok), True, model_config.moe_backend, dtype=dtype, rngs=rngs,
                              expert_names=("w1", "w3", "w2"), mesh=self.mesh, ep_size=model_config.ep_size,
                              quantization=model_config.quant_scheme)


EntryClass = [Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, MixtralForCausalLM]
