"""ForwardBatch: the description of one model step that models and layers read (JAX-free: host numpy arrays
when the scheduler builds it, the same fields as device arrays inside the jitted step).

The chain is ScheduleBatch (scheduler, Python objects) -> ModelWorkerBatch (host numpy arrays padded to a
compiled bucket, built by `scheduler/schedule_batch.py`) -> ForwardBatch + SamplingBatch on device (the
model runner's ``launch_forward`` and ``launch_sample``) -> model and sampler. This module sits below the layers
and models that read it; layers/pytrees.py registers the dataclasses as JAX pytrees (fields marked ``static``
are part of the compiled program's identity, every other field is an array leaf).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, List, Optional, Sequence

import numpy as np

from sgl_jax.srt.sampling.sampling_batch import SamplingBatch, shift_placeholders
from sgl_jax.srt.speculative.draft_tree import NO_TREE


class ForwardMode(enum.IntEnum):
    """EXTEND: prefill / extend of one or more sequences (any query lengths). DECODE: one token each.
    TARGET_VERIFY (SGLang's name): speculative decoding's verify step, an extend whose queries are each request's
    draft tree (``tree_bits``) and whose logits are taken at every token, not only at each sequence's last."""

    EXTEND = 1
    DECODE = 2
    TARGET_VERIFY = 3

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


def static_field(default):
    """A field that is part of the compiled program's identity (a pytree meta field), not an array."""
    return dataclasses.field(default=default, metadata={"static": True})


@dataclasses.dataclass
class ForwardBatch:
    """Arrays for one forward step, padded to a bucket (T tokens, S sequences).

    input_ids: int32[T]; positions: int32[T] absolute positions; out_cache_loc: int32[T] KV slot per token
    (padding -> slot 0, a reserved page).
    cu_q_lens: int32[S + 1]; kv_lens: int32[S]; page_indices: int32[S, pages_per_seq]; num_seqs: int32[]
    -- the ragged paged attention metadata.
    (With data-parallel ranks the model sees D such batches stacked along axis 0, `stack_ranks`.)
    logits_indices: int32[S] row of each sequence's last token in the T axis (where next-token logits
    are taken); in a TARGET_VERIFY step int32[T], every token's row (each draft slot's logits are sampled).
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
    tree_bits: int32[T] -- speculative verification's draft-tree mask (see `ragged_paged_attention`): a
    sequence whose queries are a draft tree's slots gives each slot the bits of its ancestors and itself, every
    other token -1. None in every step that verifies no tree (ordinary steps compile without it).
    token_type_ids: int32[T] -- an encoder model's segment (sentence A 0 / B 1) per token; set (zeros by
    default) in every step of an encoder model (the model runner sees to it), None for every other model.
    encoder_branch: int32[1], encoder_slots: int32[slot_count(T)], encoder_back: int32[T] -- an encoder step's
    tokens laid out in rows for attention (layers/encoder_attention.py `plan_rows`: the layout's branch, the
    token in each row slot, each token's slot); set by the model runner in every step of an encoder model, None
    for every other model.
    lora_ids: int32[T] -- each token's LoRA adapter slot (layers/lora.py; -1: none, so padding too); set in every
    step of a server with --enable-lora (the model runner sees to it), None otherwise.
    forward_mode, attention_backend: static (part of the compiled program's identity); attention_backend is
    the resolved ``--attention-backend`` ("native" or "pallas"), set by the model runner.
    """

    input_ids: Any
    positions: Any
    out_cache_loc: Any
    cu_q_lens: Any
    kv_lens: Any
    page_indices: Any
    num_seqs: Any
    logits_indices: Any
    prefix_lens: Any
    segment_starts: Any
    shared_prefix_len: Any
    swa_out_cache_loc: Optional[Any] = None
    swa_page_indices: Optional[Any] = None
    tree_bits: Optional[Any] = None
    token_type_ids: Optional[Any] = None
    encoder_branch: Optional[Any] = None
    encoder_slots: Optional[Any] = None
    encoder_back: Optional[Any] = None
    lora_ids: Optional[Any] = None
    forward_mode: ForwardMode = static_field(ForwardMode.EXTEND)
    attention_backend: str = static_field("native")

    def real_tokens(self):
        """bool[T]: the rows of real tokens. A bucket's padding rows (and every row of an idle rank's batch)
        write the padding sink, KV slot 0, which no real token is ever given."""
        return self.out_cache_loc != 0

    @classmethod
    def padding(cls, mode: ForwardMode, t_pad: int, s_pad: int, pages_per_seq: int,
                num_pools: int = 1) -> "ForwardBatch":
        """An all-padding batch of the padded shape (T_pad tokens, S_pad sequences): num_seqs 0, every token
        writes the padding page 0. `num_pools` 2 (a KV spec with a second pool, read by the sliding-window
        layers): the second pool's slot and page fields too."""
        z = lambda n: np.zeros(n, np.int32)  # noqa: E731
        verify = mode == ForwardMode.TARGET_VERIFY
        fb = cls(input_ids=z(t_pad), positions=z(t_pad), out_cache_loc=z(t_pad), cu_q_lens=z(s_pad + 1),
                 kv_lens=z(s_pad), page_indices=np.zeros((s_pad, pages_per_seq), np.int32),
                 num_seqs=np.asarray(0, np.int32), logits_indices=z(t_pad if verify else s_pad),
                 prefix_lens=z(s_pad), segment_starts=z(t_pad), shared_prefix_len=np.asarray(0, np.int32),
                 tree_bits=np.full(t_pad, NO_TREE, np.int32) if verify else None, forward_mode=mode)
        if num_pools > 1:
            fb.swa_out_cache_loc, fb.swa_page_indices = fb.out_cache_loc, fb.page_indices
        return fb


def array_fields(cls) -> List[str]:
    """The pytree data fields of a batch dataclass: every field not marked static."""
    return [f.name for f in dataclasses.fields(cls) if not f.metadata.get("static")]


def static_fields(cls) -> List[str]:
    """The pytree meta fields of a batch dataclass (part of the compiled program's identity)."""
    return [f.name for f in dataclasses.fields(cls) if f.metadata.get("static")]


@dataclasses.dataclass
class ModelWorkerBatch:
    """Host (numpy) ForwardBatch + SamplingBatch of one step, plus the unpadded sizes.

    num_tokens / num_seqs: real (unpadded) token and sequence counts.
    """

    forward_batch: ForwardBatch
    sampling: SamplingBatch
    num_tokens: int
    num_seqs: int

    @property
    def padded_shape(self) -> tuple:
        fb = self.forward_batch
        return (fb.forward_mode, int(np.shape(fb.input_ids)[0]), int(np.shape(fb.kv_lens)[0]))

    @property
    def rows_pad(self) -> int:
        """Sampling rows of the padded batch: S_pad, or T_pad in a TARGET_VERIFY step (a row per token)."""
        return int(np.shape(self.forward_batch.logits_indices)[0])

    @property
    def num_rows(self) -> int:
        """Real sampling rows: the sequences, or the tokens in a TARGET_VERIFY step."""
        return self.num_tokens if self.forward_batch.forward_mode == ForwardMode.TARGET_VERIFY else self.num_seqs


# Decode buckets of at most this many rows per rank also get a program whose sampler leaves the filters out
# (`DecodeRows.filtering`): a user alone, whose step is the shortest and whose launch costs most in proportion. On a
# 2-core CPU the program saved the scheduler's thread ~80 us of CPU per token at batch 1 (issue #69: the constant
# buffers XLA's CPU runtime allocates at each execution), a quarter of the step; each such program costs start-up
# another decode program's compile (4.7-8.8 s cold there, ~0.5 s loaded from the cache).
# (reports/hot-loop-cpu-2026-12-07r.notes.md)
UNFILTERED_DECODE_ROWS = 1


@dataclasses.dataclass
class DecodeRows:
    """The host inputs of a decode step that reads its sequences' page tables and sampling parameters from the
    device's per-slot state (model_executor/slot_state.py) instead of carrying them: O(S) int32 per step, whatever
    the context length.

    Rows are rank-stacked as in `stack_ranks` (D ranks x S_pad rows); a rank's real rows come first, then padding.
    slots: int32[D * S_pad] each row's stacked request slot (rank r's ReqToTokenPool row s -> r * slots_per_rank +
        s; padding 0). input_ids: int32[D * S_pad] the row's input token (its newest token), or the placeholder
        ``-(stacked slot + 1)`` while a launched step is still sampling it (model_executor/future_tokens.py).
        positions: int32[D * S_pad] the position of the row's input token. kv_slots: int32[K, D * S_pad] the rank-local KV slot
        that step k of the K steps writes (0, the padding sink: the row takes no step k -- it reaches
        max_new_tokens before). steps: int32[D * S_pad] output tokens the row has before this step (the sampling
        stream's index). constrained: bool[D * S_pad] the row's grammar mask applies (K is then 1).
        num_seqs: int32[D] real rows per rank. The number of steps K is static (part of the program).
    filtering: static: some row samples with top-k / top-p / min-p / typical-p (`SamplingParams.filters`), or S_pad
        has no program without them (`has_unfiltered_program`; set so by the constructors); the other steps run a decode program whose
        sampler leaves the filters out (layers/sampler.sample).
    """

    slots: Any
    input_ids: Any
    positions: Any
    kv_slots: Any
    steps: Any
    constrained: Any
    num_seqs: Any
    filtering: bool = static_field(True)

    @property
    def num_steps(self) -> int:
        return int(np.shape(self.kv_slots)[0])

    @property
    def rows_pad(self) -> int:
        """Rows per rank (S_pad)."""
        return int(np.shape(self.slots)[0]) // int(np.shape(self.num_seqs)[0])

    @classmethod
    def build(cls, slots: Sequence[int], input_ids: Sequence[int], positions: Sequence[int], kv_slots: np.ndarray,
              steps: Sequence[int], constrained: Sequence[bool], s_pad: int, filtering: bool = True) -> "DecodeRows":
        """One rank's rows padded to `s_pad` (kv_slots int32[K, n] for n real rows; slots and placeholders
        rank-local; `filtering`: the field, True without `has_unfiltered_program` whatever given). The int32 fields are
        views of one buffer in the fields' order (``packed``: what `packed_inputs.pack` gives for the rows, built
        without a concatenation; the decode step's one H2D copy)."""
        n = len(slots)
        if n > s_pad:
            raise ValueError(f"{n} decode rows do not fit a batch of {s_pad}")
        K = int(np.shape(kv_slots)[0])
        buf = np.zeros((5 + K) * s_pad + 1, np.int32)
        cols = buf[:(5 + K) * s_pad].reshape(5 + K, s_pad)  # slots, input_ids, positions, kv[K], steps, constrained
        cols[0, :n], cols[1, :n], cols[2, :n] = slots, input_ids, positions
        cols[3:3 + K, :n] = kv_slots
        cols[3 + K, :n], cols[4 + K, :n] = steps, constrained
        buf[-1] = n
        return cls._over(buf, K, s_pad, filtering)

    @classmethod
    def from_rows(cls, rows: Sequence[tuple], s_pad: int, filtering: bool = True) -> "DecodeRows":
        """`build` of a one-step decode (K = 1) from each real row's (slot, input_id, position, kv_slot, steps,
        constrained) tuple, written with scalar stores: for a few rows, cheaper than `build`'s column copies (a
        batch-1 decode step's host work; issue #69). Raises ValueError when the rows do not fit `s_pad`."""
        n = len(rows)
        if n > s_pad:
            raise ValueError(f"{n} decode rows do not fit a batch of {s_pad}")
        buf = np.zeros(6 * s_pad + 1, np.int32)
        for i, row in enumerate(rows):
            for j, value in enumerate(row):
                buf[j * s_pad + i] = value
        buf[-1] = n
        return cls._over(buf, 1, s_pad, filtering)

    @classmethod
    def _over(cls, buf: np.ndarray, K: int, s_pad: int, filtering: bool) -> "DecodeRows":
        """The rows whose int32 fields are views of `buf` (int32[(5 + K) * s_pad + 1], the packed layout)."""
        cols = buf[:(5 + K) * s_pad].reshape(5 + K, s_pad)
        rows = cls(slots=cols[0], input_ids=cols[1], positions=cols[2], kv_slots=cols[3:3 + K], steps=cols[3 + K],
                   constrained=cols[4 + K] != 0, num_seqs=buf[-1:],
                   filtering=bool(filtering) or not cls.has_unfiltered_program(s_pad))
        rows.packed = buf
        return rows

    @staticmethod
    def has_unfiltered_program(s_pad: int) -> bool:
        """Whether decode steps of `s_pad` rows per rank have a program without the sampler's filters
        (UNFILTERED_DECODE_ROWS, read at each call)."""
        return s_pad <= UNFILTERED_DECODE_ROWS

    @classmethod
    def padding(cls, s_pad: int, num_steps: int = 1, filtering: bool = False) -> "DecodeRows":
        """An all-padding rank (idle, or warm-up)."""
        return cls.build([], [], [], np.zeros((num_steps, 0), np.int32), [], [], s_pad, filtering)

    @staticmethod
    def stack(ranks: List["DecodeRows"], slots_per_rank: int) -> "DecodeRows":
        """D ranks' rows (one S_pad and K each) as one: slots and placeholders moved to the stacked request slots;
        filtering when any rank's is.

        Raises:
            ValueError: the ranks' S_pad or K differ."""
        if len({(r.rows_pad, r.num_steps) for r in ranks}) != 1:
            raise ValueError("rank decode rows must share one S_pad and one number of steps")
        cat = lambda name: np.concatenate([np.asarray(getattr(r, name)) for r in ranks], axis=-1)  # noqa: E731
        slots = np.concatenate([np.asarray(r.slots) + i * slots_per_rank for i, r in enumerate(ranks)])
        ids = np.concatenate([shift_placeholders(r.input_ids, i * slots_per_rank) for i, r in enumerate(ranks)])
        return DecodeRows(slots=slots.astype(np.int32), input_ids=ids, positions=cat("positions"),
                          kv_slots=cat("kv_slots"),
                          steps=cat("steps"), constrained=cat("constrained"),
                          num_seqs=np.concatenate([np.asarray(r.num_seqs) for r in ranks]).astype(np.int32),
                          filtering=any(r.filtering for r in ranks))


_PER_RANK_SCALARS = ("num_seqs", "shared_prefix_len")


def stack_ranks(batches: List[ModelWorkerBatch], slots_per_rank: int) -> ModelWorkerBatch:
    """The batches of D data-parallel ranks (one padded shape, T_pad tokens and S_pad sequences each) as one
    batch whose arrays are the ranks' stacked along axis 0: rank r's tokens at rows [r*T_pad, (r+1)*T_pad),
    its sequences at [r*S_pad, (r+1)*S_pad). KV slots and page indices stay local to the rank's KV block (the
    cache is sharded over ranks, see distributed/sharding.py); ``num_seqs`` and ``shared_prefix_len`` become
    int32[D]; ``logits_indices`` point into the stacked token axis and sampling ``slots`` into the stacked
    penalty-state rows (rank r's slot s -> ``r * slots_per_rank + s``), as do the placeholders ``-(s + 1)``
    of ``input_ids`` and ``last_token`` (the overlap scheduler's, see model_executor/future_tokens.py). A
    single rank gives the same arrays (its two scalars as int32[1]).

    Raises:
        ValueError: the batches' padded shapes differ.
    """
    shapes = {b.padded_shape for b in batches}
    if len(shapes) != 1:
        raise ValueError(f"rank batches must share one padded shape, got {sorted(map(str, shapes))}")
    _, t_pad, s_pad = shapes.pop()
    fbs = [b.forward_batch for b in batches]
    fields = {}
    for name in array_fields(ForwardBatch):
        if getattr(fbs[0], name) is None:  # an optional field (no SWA pool): absent in every rank's batch
            continue
        parts = [np.asarray(getattr(fb, name)) for fb in fbs]
        if name in _PER_RANK_SCALARS:
            fields[name] = np.stack([p.reshape(()) for p in parts]).astype(np.int32)
        elif name == "logits_indices":
            fields[name] = np.concatenate([p + r * t_pad for r, p in enumerate(parts)]).astype(np.int32)
        elif name == "input_ids":  # placeholders of tokens still being sampled: into the stacked buffer rows
            fields[name] = np.concatenate([shift_placeholders(p, r * slots_per_rank) for r, p in enumerate(parts)])
        else:
            fields[name] = np.concatenate(parts)
    fb = ForwardBatch(**fields, forward_mode=fbs[0].forward_mode, attention_backend=fbs[0].attention_backend)
    sampling = SamplingBatch.stack([b.sampling for b in batches], batches[0].rows_pad, slots_per_rank)
    return ModelWorkerBatch(forward_batch=fb, sampling=sampling,
                            num_tokens=sum(b.num_tokens for b in batches),
                            num_seqs=sum(b.num_seqs for b in batches))
