"""Qwen2 (dense): the Llama architecture with biases on the q/k/v projections (transformers' `Qwen2Attention`:
``bias=True`` on q_proj, k_proj, v_proj, none on o_proj; its config has no flag for it, so the class says it:
``qkv_bias``). No q/k norm (Qwen3's). gte-Qwen2 embedders are served as SGLang serves them: causal attention, the
last token pooled."""

from sgl_jax.srt.models.llama import LlamaForCausalLM, LlamaForSequenceClassification


class Qwen2ForCausalLM(LlamaForCausalLM):
    """transformers' `Qwen2ForCausalLM` weights and numerics (q/k/v biases)."""

    architectures = ("Qwen2ForCausalLM",)
    qkv_bias = True


class Qwen2DecoderModel(Qwen2ForCausalLM):
    """transformers' `Qwen2Model` checkpoint: the decoder stack without an LM head, served as an embedding model
    (models/llama.LlamaDecoderModel)."""

    architectures = ("Qwen2Model",)
    role = "embedding"
    embedding_form_of = ("Qwen2ForCausalLM",)


class Qwen2ForSequenceClassification(LlamaForSequenceClassification):
    """transformers' `Qwen2ForSequenceClassification`: the ``score`` head on the last token
    (models/llama.LlamaForSequenceClassification) over Qwen2's layers."""

    architectures = ("Qwen2ForSequenceClassification",)
    qkv_bias = True


EntryClass = [Qwen2ForCausalLM, Qwen2DecoderModel, Qwen2ForSequenceClassification]
