"""ForwardBatch: the device-side description of one model step (a registered JAX pytree).

The chain is ScheduleBatch (scheduler, Python objects) -> ModelWorkerBatch (host numpy arrays padded to
a compiled bucket, built by `schedule_batch`) -> ForwardBatch (the same arrays on device) -> model.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import List, Optional

import jax
import numpy as np


class ForwardMode(enum.IntEnum):
    """EXTEND: prefill / extend of one or more sequences (any query lengths). DECODE: one token each."""

    EXTEND = 1
    DECODE = 2

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


@dataclasses.dataclass
class ForwardBatch:
    """Arrays for one forward step, padded to a bucket (T tokens, S sequences).

    input_ids: int32[T]; positions: int32[T] absolute positions; out_cache_loc: int32[T] KV slot per token
    (padding -> slot 0, a reserved page).
    cu_q_lens: int32[S + 1]; kv_lens: int32[S]; page_indices: int32[S, pages_per_seq]; num_seqs: int32[]
    -- the ragged paged attention metadata.
    (With data-parallel ranks the model sees D such batches stacked along axis 0, `stack_ranks`.)
    logits_indices: int32[S] row of each sequence's last token in the T axis (where next-token logits
    are taken).
    prefix_lens: int32[S], segment_starts: int32[T] -- the multi-item scoring segment mask (see
    `ragged_paged_attention`); zeros for ordinary sequences. ``positions`` are then the rotary positions,
    which restart after the shared prefix, while causality follows the KV position.
    shared_prefix_len: int32[] KV positions at the start of every sequence that are the same pages in all
    of them and precede every query (see `shared_prefix_len`); 0: none. Attention then reads them once
    for the whole batch.
    swa_out_cache_loc: int32[T], swa_page_indices: int32[S, pages_per_seq] -- what sliding-window layers use
    instead of out_cache_loc / page_indices when the model has a separate SWA KV pool (hybrid SWA memory): the
    same slots and pages translated through the full-to-SWA page mapping (page 0 where a page's SWA KV is
    gone, which only positions outside every query's window have). None without a separate SWA pool.
    forward_mode, attention_backend: static (part of the compiled program's identity); attention_backend is
    the resolved ``--attention-backend`` ("native" or "pallas"), set by the model runner.
    """

    input_ids: jax.Array
    positions: jax.Array
    out_cache_loc: jax.Array
    cu_q_lens: jax.Array
    kv_lens: jax.Array
    page_indices: jax.Array
    num_seqs: jax.Array
    logits_indices: jax.Array
    prefix_lens: jax.Array
    segment_starts: jax.Array
    shared_prefix_len: jax.Array
    swa_out_cache_loc: Optional[jax.Array] = None
    swa_page_indices: Optional[jax.Array] = None
    forward_mode: ForwardMode = ForwardMode.EXTEND
    attention_backend: str = "native"


jax.tree_util.register_dataclass(
    ForwardBatch,
    data_fields=["input_ids", "positions", "out_cache_loc", "cu_q_lens", "kv_lens", "page_indices",
                 "num_seqs", "logits_indices", "prefix_lens", "segment_starts",
                 "shared_prefix_len", "swa_out_cache_loc", "swa_page_indices"],
    meta_fields=["forward_mode", "attention_backend"],
)


@dataclasses.dataclass
class SamplingMetadata:
    """Per-sequence sampling parameters, arrays of length S (padding rows are greedy).

    temperatures: float32 (0 = greedy); top_ps: float32 in (0, 1]; top_ks: int32 (<= 0: off);
    min_ps: float32 in [0, 1]; seeds: int32 per-request seed; steps: int32 tokens generated so far (the
    random stream of a request is fold_in(key(seed), step), so sampling does not depend on the batch);
    suppress_eos: bool, mask EOS logits (min_new_tokens not reached).
    slots: int32 the request's ReqToTokenPool row (its PenaltyState row; padding: 0).
    penalized: bool, apply the slot's penalties and logit bias (see layers/sampler.PenaltyState).
    frequency_penalties, presence_penalties: float32 (0: off); repetition_penalties: float32 (1: off).
    last_token: int32 the row's newest output token and last_token_index its index in the output (-1: none,
    e.g. a prefill row), counted into the slot's history before sampling.
    vocab_mask: int32[S, ceil(V / 32)] packed allowed-token bitmask (bit v % 32 of word v // 32), read for
    rows with ``constrained``; None on the host when no row has a grammar (the model runner then passes a
    cached all-ones mask, so the compiled program is the same).
    """

    temperatures: jax.Array
    top_ps: jax.Array
    top_ks: jax.Array
    min_ps: jax.Array
    seeds: jax.Array
    steps: jax.Array
    suppress_eos: jax.Array
    slots: jax.Array
    penalized: jax.Array
    frequency_penalties: jax.Array
    presence_penalties: jax.Array
    repetition_penalties: jax.Array
    last_token: jax.Array
    last_token_index: jax.Array
    constrained: jax.Array
    vocab_mask: object = None


jax.tree_util.register_dataclass(
    SamplingMetadata,
    data_fields=["temperatures", "top_ps", "top_ks", "min_ps", "seeds", "steps", "suppress_eos", "slots",
                 "penalized", "frequency_penalties", "presence_penalties", "repetition_penalties", "last_token",
                 "last_token_index", "constrained", "vocab_mask"],
    meta_fields=[],
)


@dataclasses.dataclass
class ModelWorkerBatch:
    """Host (numpy) version of ForwardBatch + SamplingMetadata, plus the unpadded sizes.

    num_tokens / num_seqs: real (unpadded) token and sequence counts.
    """

    forward_batch: ForwardBatch
    sampling: SamplingMetadata
    num_tokens: int
    num_seqs: int

    @property
    def padded_shape(self) -> tuple:
        fb = self.forward_batch
        return (fb.forward_mode, int(np.shape(fb.input_ids)[0]), int(np.shape(fb.kv_lens)[0]))


_PER_RANK_SCALARS = ("num_seqs", "shared_prefix_len")


def stack_ranks(batches: List[ModelWorkerBatch], slots_per_rank: int) -> ModelWorkerBatch:
    """The batches of D data-parallel ranks (one padded shape, T_pad tokens and S_pad sequences each) as one
    batch whose arrays are the ranks' stacked along axis 0: rank r's tokens at rows [r*T_pad, (r+1)*T_pad),
    its sequences at [r*S_pad, (r+1)*S_pad). KV slots and page indices stay local to the rank's KV block (the
    cache is sharded over ranks, see distributed/sharding.py); ``num_seqs`` and ``shared_prefix_len`` become
    int32[D]; ``logits_indices`` point into the stacked token axis and sampling ``slots`` into the stacked
    penalty-state rows (rank r's slot s -> ``r * slots_per_rank + s``). A single rank gives the same arrays
    (its two scalars as int32[1]).

    Raises:
        ValueError: the batches' padded shapes differ.
    """
    shapes = {b.padded_shape for b in batches}
    if len(shapes) != 1:
        raise ValueError(f"rank batches must share one padded shape, got {sorted(map(str, shapes))}")
    _, t_pad, s_pad = shapes.pop()
    fbs = [b.forward_batch for b in batches]
    fields = {}
    for f in dataclasses.fields(ForwardBatch):
        if f.name in ("forward_mode", "attention_backend"):
            continue
        if getattr(fbs[0], f.name) is None:  # an optional field (no SWA pool): absent in every rank's batch
            continue
        parts = [np.asarray(getattr(fb, f.name)) for fb in fbs]
        if f.name in _PER_RANK_SCALARS:
            fields[f.name] = np.stack([p.reshape(()) for p in parts]).astype(np.int32)
        elif f.name == "logits_indices":
            fields[f.name] = np.concatenate([p + r * t_pad for r, p in enumerate(parts)]).astype(np.int32)
        else:
            fields[f.name] = np.concatenate(parts)
    fb = ForwardBatch(**fields, forward_mode=fbs[0].forward_mode, attention_backend=fbs[0].attention_backend)
    samplings = [b.sampling for b in batches]
    sfields = {}
    for f in dataclasses.fields(SamplingMetadata):
        if f.name == "vocab_mask":
            masks = [s.vocab_mask for s in samplings]
            if all(m is None for m in masks):
                sfields[f.name] = None
            else:
                width = next(np.shape(m)[1] for m in masks if m is not None)
                sfields[f.name] = np.concatenate([np.full((s_pad, width), -1, np.int32) if m is None
                                                  else np.asarray(m) for m in masks])
            continue
        parts = [np.asarray(getattr(s, f.name)) for s in samplings]
        if f.name == "slots":
            parts = [p + r * slots_per_rank for r, p in enumerate(parts)]
        sfields[f.name] = np.concatenate(parts).astype(parts[0].dtype)
    return ModelWorkerBatch(forward_batch=fb, sampling=SamplingMetadata(**sfields),
                            num_tokens=sum(b.num_tokens for b in batches),
                            num_seqs=sum(b.num_seqs for b in batches))
