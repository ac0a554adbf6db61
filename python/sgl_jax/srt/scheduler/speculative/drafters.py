"""Which drafter --speculative-algorithm runs on a draft model: STANDALONE's model (draft_model.py) or an EAGLE /
EAGLE-3 head (eagle_draft.py); NGRAM needs none (speculation.py). (Files of scheduler/speculative/.)"""

from __future__ import annotations

from typing import Optional, Tuple

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.model_executor.buckets import ShapeBuckets
from sgl_jax.srt.model_executor.model_runner import ModelRunner
from sgl_jax.srt.models.llama_eagle3 import eagle_aux_layer_ids
from sgl_jax.srt.scheduler.speculative.draft_model import (
    DraftModel, check_draft_config, draft_server_args, new_draft_model)
from sgl_jax.srt.scheduler.speculative.eagle_draft import eagle_head_config, new_eagle_draft

DRAFT_MODEL_ALGORITHMS = ("STANDALONE", "EAGLE", "EAGLE3")


def draft_model_config(server_args, target_config, context_len: int, platform: str
                       ) -> Tuple[Optional[ModelConfig], Tuple[int, ...]]:
    """(the draft model's or head's `ModelConfig`, checked against the target's `target_config`; None without one,
    the target layers whose outputs an EAGLE-3 head reads (`ModelRunner.aux_layers`; empty otherwise)).

    Raises:
        ValueError: a draft that cannot serve the target (naming --speculative-draft-model-path).
    """
    algo = server_args.speculative_algorithm
    if algo not in DRAFT_MODEL_ALGORITHMS:
        return None, ()
    if (server_args.speculative_eagle_topk or 1) > 1 and target_config.sliding_window is not None:
        raise ValueError(f"--speculative-eagle-topk {server_args.speculative_eagle_topk}: a model with "
                         f"sliding-window layers verifies chains only (its windows are measured on the KV "
                         f"position); use --speculative-eagle-topk 1")
    draft = ModelConfig.from_server_args(draft_server_args(server_args, context_len), platform)
    if algo == "STANDALONE":
        check_draft_config(draft, target_config)
        return draft, ()
    draft = eagle_head_config(draft, target_config, algo)
    aux = eagle_aux_layer_ids(draft.hf_config, target_config.num_hidden_layers) if algo == "EAGLE3" else ()
    return draft, aux


def new_drafter(server_args, target_runner: ModelRunner, buckets: ShapeBuckets, draft_config) -> DraftModel:
    """The `DraftModel` (STANDALONE) or `EagleDraft` (EAGLE, EAGLE3) of `draft_config` beside the target's runner."""
    new = new_draft_model if server_args.speculative_algorithm == "STANDALONE" else new_eagle_draft
    return new(server_args, target_runner, buckets, draft_config)
