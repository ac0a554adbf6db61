"""Qwen3 (dense): the Llama architecture plus per-head RMSNorm on queries and keys before rotary."""

from sgl_jax.srt.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """transformers' `Qwen3ForCausalLM` weights and numerics (q_norm / k_norm over head_dim)."""

    qk_norm = True
