"""Model classes by the HF ``architectures`` name."""

from __future__ import annotations

from sgl_jax.srt.models.bert import (BertForSequenceClassification, BertModel, XLMRobertaForSequenceClassification,
                                     XLMRobertaModel)
from sgl_jax.srt.models.gemma3 import Gemma3ForCausalLM
from sgl_jax.srt.models.llama import LlamaDecoderModel, LlamaForCausalLM, LlamaForSequenceClassification
from sgl_jax.srt.models.llama_eagle import LlamaForCausalLMEagle
from sgl_jax.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
from sgl_jax.srt.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from sgl_jax.srt.models.qwen2 import Qwen2DecoderModel, Qwen2ForCausalLM, Qwen2ForSequenceClassification
from sgl_jax.srt.models.qwen3 import Qwen3DecoderModel, Qwen3ForCausalLM, Qwen3ForSequenceClassification

MODEL_REGISTRY = {
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "LlamaForCausalLMEagle": LlamaForCausalLMEagle,
    "LlamaForCausalLMEagle3": LlamaForCausalLMEagle3,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    # decoder stacks without an LM head (embedding models; configs.model_config.EMBEDDING_ARCHITECTURES)
    "LlamaModel": LlamaDecoderModel,
    "Qwen2Model": Qwen2DecoderModel,
    "Qwen3Model": Qwen3DecoderModel,
    # sequence-classification heads (rerankers) and encoders (configs.model_config.CLASSIFIER_ARCHITECTURES,
    # ENCODER_ARCHITECTURES)
    "LlamaForSequenceClassification": LlamaForSequenceClassification,
    "Qwen2ForSequenceClassification": Qwen2ForSequenceClassification,
    "Qwen3ForSequenceClassification": Qwen3ForSequenceClassification,
    "BertModel": BertModel,
    "XLMRobertaModel": XLMRobertaModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "XLMRobertaForSequenceClassification": XLMRobertaForSequenceClassification,
}


# --is-embedding on a causal LM: its decoder stack without the LM head (Qwen3-Embedding-4B / 8B name the causal
# class, store no lm_head and do not tie it)
EMBEDDING_VARIANTS = {"LlamaForCausalLM": LlamaDecoderModel, "Qwen2ForCausalLM": Qwen2DecoderModel,
                      "Qwen3ForCausalLM": Qwen3DecoderModel}


def get_model_class(architecture: str, embedding: bool = False):
    """The NNX class for an HF architecture name (`embedding`: the EMBEDDING_VARIANTS one where there is one).

    Raises:
        ValueError: unknown architecture; the message lists the supported ones.
    """
    if embedding and architecture in EMBEDDING_VARIANTS:
        return EMBEDDING_VARIANTS[architecture]
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"Model architecture {architecture!r} is not supported; supported: {sorted(MODEL_REGISTRY)}"
        ) from None
