"""Qwen3 (dense): the Llama architecture plus per-head RMSNorm on queries and keys before rotary."""

from sgl_jax.srt.models.llama import LlamaForCausalLM, LlamaForSequenceClassification


class Qwen3ForCausalLM(LlamaForCausalLM):
    """transformers' `Qwen3ForCausalLM` weights and numerics (q_norm / k_norm over head_dim)."""

    architectures = ("Qwen3ForCausalLM",)
    qk_norm = True


class Qwen3DecoderModel(Qwen3ForCausalLM):
    """transformers' `Qwen3Model` checkpoint (Qwen3-Embedding's form in sentence-transformers): the decoder stack
    without an LM head, served as an embedding model (models/llama.LlamaDecoderModel)."""

    architectures = ("Qwen3Model",)
    role = "embedding"
    embedding_form_of = ("Qwen3ForCausalLM",)


class Qwen3ForSequenceClassification(LlamaForSequenceClassification):
    """transformers' `Qwen3ForSequenceClassification` (models/llama.LlamaForSequenceClassification with Qwen3's
    q/k norms)."""

    architectures = ("Qwen3ForSequenceClassification",)
    qk_norm = True


EntryClass = [Qwen3ForCausalLM, Qwen3DecoderModel, Qwen3ForSequenceClassification]
