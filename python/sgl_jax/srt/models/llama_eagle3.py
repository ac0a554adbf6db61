"""An EAGLE-3 draft head (Li et al. 2025, "EAGLE-3") in its published checkpoint format,
``LlamaForCausalLMEagle3`` (SGLang's and SpecForge's; the yuhuili / lmsys releases).

One decoder layer over the target model's features. Draft row p sits in position p's KV slot, is rotated at p, and
reads ``(embed(t[p+1]), h[p])``:

- ``h[p]`` is ``fc(aux[p])``, the target's hidden states of three layers at p concatenated (the draft extend after
  a target step), or the draft's own output of the row before (a draft decode step);
- ``x = concat(input_layernorm(embed), hidden_norm(h))`` [T, 2H] feeds q/k/v; the residual is ``h``;
- ``out = h' + mlp(post_attention_layernorm(h'))`` with ``h' = h + o_proj(attn(x))`` is the next step's ``h``;
- ``logits = lm_head(norm(out))`` [T, draft_vocab_size]: a draft id i is target id ``i + d2t[i]`` (the "hot"
  map, `hot_token_ids`).

The embedding is the target's (passed in: the head has none), so are token ids. Parameter paths equal the
checkpoint's keys (``fc.weight``, ``midlayer.self_attn.q_proj.weight``, ``norm.weight``, ``lm_head.weight``); ``d2t``
(int64, an offset per draft id) and ``t2d`` are read apart (`hot_token_ids`), never cast to the weights' dtype.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from sgl_jax.srt.forward_batch import ForwardBatch
from sgl_jax.srt.layers.attention import LayerKV
from sgl_jax.srt.layers.layernorm import RMSNorm
from sgl_jax.srt.layers.linear import Linear
from sgl_jax.srt.layers.embedding import Table, lookup
from sgl_jax.srt.layers.logits_processor import compute_logits
from sgl_jax.srt.models.llama import LlamaAttention, LlamaMLP

DEFAULT_NUM_AUX_LAYERS = 3


def eagle_aux_layer_ids(draft_hf_config, target_num_layers: int) -> Tuple[int, ...]:
    """The target layers whose outputs an EAGLE-3 head reads: ``eagle_config.eagle_aux_hidden_state_layer_ids`` of
    the head's config, else SGLang's default (1, L/2 - 1, L - 4) for a target of L layers; id l is the output of
    layer l (before the final norm).

    Raises:
        ValueError: ids that repeat or fall outside the target's layers, or a config that turns the aux hidden
            states off (``use_aux_hidden_state: false``).
    """
    eagle = getattr(draft_hf_config, "eagle_config", None) or {}
    if eagle.get("use_aux_hidden_state", True) is False:
        raise ValueError("an EAGLE-3 head with use_aux_hidden_state false is not supported")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (1, target_num_layers // 2 - 1, target_num_layers - 4)
    ids = tuple(int(i) for i in ids)
    if len(set(ids)) != len(ids) or any(not 0 <= i < target_num_layers for i in ids):
        raise ValueError(f"EAGLE-3 aux hidden-state layers {list(ids)} must be distinct layers of the target's "
                         f"{target_num_layers} (set eagle_config.eagle_aux_hidden_state_layer_ids in the head's "
                         f"config.json)")
    return tuple(sorted(ids))


def hot_token_ids(d2t: Optional[np.ndarray], draft_vocab_size: int) -> np.ndarray:
    """int32[draft_vocab_size]: the target id of each draft id, ``i + d2t[i]`` (SGLang's ``hot_token_id``); the
    identity without a ``d2t`` tensor (a head over the target's whole vocabulary).

    Raises:
        ValueError: a d2t of another length.
    """
    ids = np.arange(draft_vocab_size, dtype=np.int64)
    if d2t is None:
        return ids.astype(np.int32)
    d2t = np.asarray(d2t).reshape(-1)
    if d2t.shape[0] != draft_vocab_size:
        raise ValueError(f"the head's d2t has {d2t.shape[0]} entries, its draft_vocab_size is {draft_vocab_size}")
    return (ids + d2t.astype(np.int64)).astype(np.int32)


class Eagle3Midlayer(nnx.Module):
    """The head's one decoder layer: attention over [embedding, hidden] (2H wide), the residual stream ``h``."""

    def __init__(self, cfg, model_config, *, dtype, rngs: nnx.Rngs, mesh: Optional[Mesh] = None):
        hidden, eps = model_config.hidden_size, float(cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(hidden, eps=eps, dtype=dtype)
        self.hidden_norm = RMSNorm(hidden, eps=eps, dtype=dtype)
        self.self_attn = LlamaAttention(cfg, model_config, 0, qk_norm=False, dtype=dtype, rngs=rngs, mesh=mesh,
                                        in_features=2 * hidden)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps, dtype=dtype)
        self.mlp = LlamaMLP(hidden, int(cfg.intermediate_size), dtype, rngs)

    def __call__(self, emb: jax.Array, h: jax.Array, fb: ForwardBatch, kv: LayerKV) -> Tuple[jax.Array, LayerKV]:
        x = jnp.concatenate([self.input_layernorm(emb), self.hidden_norm(h)], axis=-1)
        attn_out, kv = self.self_attn(x, fb, kv)
        h = h + attn_out
        return h + self.mlp(self.post_attention_layernorm(h)), kv


class LlamaForCausalLMEagle3(nnx.Module):
    """The EAGLE-3 head (see the module docstring).

    Args:
        model_config: the head's `ModelConfig` (``hidden_size`` H, one layer; ``hf_config`` gives
            ``target_hidden_size`` Ht (default H), ``draft_vocab_size`` Dv (default the vocabulary),
            ``eagle_config`` (the aux layer ids: their number n sizes ``fc``), ``bias`` (fc's bias)).
        dtype, rngs, mesh: as `LlamaForCausalLM`.

    Raises:
        ValueError: a config with other than one hidden layer.
    """

    architectures = ("LlamaForCausalLMEagle3",)  # the registry's hooks (models/llama.LlamaForCausalLM's docstring)
    role = "causal"
    is_encoder = False
    embedding_form_of: Tuple[str, ...] = ()

    def __init__(self, model_config, *, dtype=jnp.float32, rngs: nnx.Rngs, mesh: Optional[Mesh] = None):
        cfg = model_config.hf_config
        if model_config.num_hidden_layers != 1:
            raise ValueError(f"an EAGLE-3 head has one layer; {model_config.model_path} has "
                             f"{model_config.num_hidden_layers}")
        hidden = model_config.hidden_size
        target_hidden = int(getattr(cfg, "target_hidden_size", None) or hidden)
        ids = (getattr(cfg, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
        self.num_aux = len(ids) if ids else DEFAULT_NUM_AUX_LAYERS
        self.hidden_size = hidden
        self.draft_vocab_size = int(getattr(cfg, "draft_vocab_size", None) or model_config.vocab_size)
        self.fc = Linear(self.num_aux * target_hidden, hidden, use_bias=bool(getattr(cfg, "bias", False)),
                         dtype=dtype, rngs=rngs)
        self.midlayer = Eagle3Midlayer(cfg, model_config, dtype=dtype, rngs=rngs, mesh=mesh)
        self.norm = RMSNorm(hidden, eps=float(cfg.rms_norm_eps), dtype=dtype)
        self.lm_head = Linear(hidden, self.draft_vocab_size, dtype=dtype, rngs=rngs)

    def __call__(self, fb: ForwardBatch, kv_caches: List[LayerKV], hidden_in: jax.Array, embed_weight: Table,
                 *, project: bool) -> Tuple[jax.Array, List[LayerKV]]:
        """One draft forward of T rows.

        Args:
            fb: ForwardBatch (``input_ids`` the tokens after each row's position, see the module docstring).
            kv_caches: the head's one (k_pages, v_pages).
            hidden_in: [T, n * Ht] the target's aux hidden states (`project`: through ``fc``), or [T, H] the
                head's own outputs (used as they are).
            embed_weight: the target's embedding table [V, Ht] (`layers.embedding.Table`: quantized or not).
            project: static: whether `hidden_in` is the target's (a draft extend) or the head's (a draft decode).
        Returns:
            (the pre-norm outputs [T, H]: the next draft step's hidden input, [the updated KV]).
        """
        h = self.fc(hidden_in) if project else hidden_in
        emb = lookup(embed_weight, fb.input_ids, h.dtype)
        out, kv = self.midlayer(emb, h, fb, kv_caches[0])
        return out, [kv]

    def moe_routing(self):
        """None: the head routes nothing (see `LlamaForCausalLM.moe_routing`)."""
        return None

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """Pre-norm outputs [N, H] -> float32 logits [N, draft_vocab_size] over draft ids."""
        return compute_logits(self.norm(hidden), self.lm_head.weight[...])

    def draft_logits(self, hidden: jax.Array, target_head: Table) -> jax.Array:
        """`compute_logits` (the head has its own LM head; `target_head` is not read)."""
        return self.compute_logits(hidden)


EntryClass = [LlamaForCausalLMEagle3]
