"""SamplingBatch: the per-row sampling arrays of one step (host numpy arrays; the same fields on device).

One builder (`SamplingBatch.build`) serves batch building (scheduler/schedule_batch.py) and the all-padding
warm-up batch (`SamplingBatch.padding`), and one table says what padding rows hold: `ENGINE_ROWS` (the
`_engine_row` declarations below) for the rows the scheduler fills, the `device_row` declarations of
`SamplingParams` for the request's parameters. The
pytree fields follow from the dataclass (layers/pytrees.py registers it where JAX is), so adding a sampling
parameter touches the protocols, `sampling_params.py` and the sampler, nothing here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from sgl_jax.srt.sampling.sampling_params import SamplingParams, device_rows


def vocab_mask_words(vocab_size: int) -> int:
    """int32 words per row of the packed vocabulary bitmask: ceil(vocab_size / 32) (llguidance's layout)."""
    return -(-vocab_size // 32)


def all_allowed_mask(rows: int, words: int) -> np.ndarray:
    """int32[rows, words] of -1: every token allowed (a batch, or a rank's rows, without a grammar)."""
    return np.full((rows, words), -1, np.int32)


STOP_IDS_WIDTH = 4  # stop token ids per row that a multi-step decode checks on device (`stop_ids`)


def _engine_row(dtype, pad, width: int = 0):
    """A row the scheduler fills (not a request parameter): its dtype, the value of a padding row and, for a row of
    several values, their number (0: one value)."""
    return dataclasses.field(metadata={"engine_row": (np.dtype(dtype), pad, width)})


@dataclasses.dataclass
class SamplingBatch:
    """Per-row sampling inputs of a step of S_pad rows (padding rows change nothing: greedy, unpenalized).

    params: SamplingParams field name -> [S_pad] array of that field (the `device_row` fields: temperature
        float32 (0 = greedy), top_p float32 in (0, 1], top_k int32 (<= 0: off), min_p float32 in [0, 1],
        frequency_penalty / presence_penalty float32 (0: off), repetition_penalty float32 (1: off)).
    seeds: int32 per-request seed; steps: int32 tokens generated so far (the random stream of a request is
        fold_in(key(seed), step), so sampling does not depend on the batch); suppress_eos: bool, mask EOS logits.
    slots: int32 the request's ReqToTokenPool row (its PenaltyState row; padding: 0); penalized: bool, apply the
        slot's penalties and logit bias (see layers/sampler.PenaltyState).
    last_token: int32 the row's newest output token and last_token_index its index in the output (-1: none),
        counted into the slot's history before sampling; a placeholder ``-(slot + 1)`` when that token is still
        being sampled by the step before (the overlap scheduler: the model runner reads it from its future-token
        buffer, see model_executor/future_tokens.py). writes_future: bool, the row samples a token the next step
        may read from that buffer (its request's row; padding and mid-prompt chunk rows: False).
    min_new_tokens: int32, ignore_eos: bool, stop_ids: int32[S_pad, STOP_IDS_WIDTH] (the request's first stop token
        ids, -1 padded): not read by the sampler; the model runner keeps them per request slot, so that a
        multi-step decode can stop a row on device (model_executor/slot_state.py).
    constrained: bool, the row's grammar bitmask applies. vocab_mask: int32[S_pad, ceil(V / 32)] packed allowed-
        token bitmask (bit v % 32 of word v // 32); None on the host when no row has a grammar (the model runner
        then passes a cached all-ones mask, so the compiled program is the same).
    """

    params: Dict[str, Any]
    seeds: Any = _engine_row(np.int32, 0)
    steps: Any = _engine_row(np.int32, 0)
    suppress_eos: Any = _engine_row(np.bool_, False)
    slots: Any = _engine_row(np.int32, 0)
    penalized: Any = _engine_row(np.bool_, False)
    last_token: Any = _engine_row(np.int32, 0)
    writes_future: Any = _engine_row(np.bool_, False)
    last_token_index: Any = _engine_row(np.int32, -1)
    constrained: Any = _engine_row(np.bool_, False)
    min_new_tokens: Any = _engine_row(np.int32, 0)
    ignore_eos: Any = _engine_row(np.bool_, False)
    stop_ids: Any = _engine_row(np.int32, -1, STOP_IDS_WIDTH)
    vocab_mask: Any = None

    @classmethod
    def build(cls, params: Sequence[SamplingParams], rows: Mapping[str, Sequence], s_pad: int,
              vocab_mask: Optional[np.ndarray] = None) -> "SamplingBatch":
        """The arrays of len(params) real rows padded to `s_pad` rows.

        Args:
            params: each real row's SamplingParams (its `device_row` fields become ``self.params``).
            rows: ENGINE_ROWS name -> one value per real row (a name left out: every row holds its padding
                value).
            s_pad: rows of the compiled bucket (>= len(params)).
            vocab_mask: int32[s_pad, W] or None.
        Raises:
            ValueError: an unknown row name, or more rows than s_pad.
        """
        n = len(params)
        if n > s_pad:
            raise ValueError(f"{n} sampling rows do not fit a batch of {s_pad}")
        unknown = set(rows) - set(ENGINE_ROWS)
        if unknown:
            raise ValueError(f"unknown sampling rows {sorted(unknown)}; known: {sorted(ENGINE_ROWS)}")

        def column(values, dtype, pad, width=0):
            out = np.full((s_pad, width) if width else s_pad, pad, dtype)
            if len(values):
                out[:len(values)] = values
            return out

        param_arrays = {name: column([getattr(p, name) for p in params], spec.dtype, spec.pad)
                        for name, spec in device_rows().items()}
        engine = {name: column(rows.get(name, ()), *spec) for name, spec in ENGINE_ROWS.items()}
        return cls(params=param_arrays, vocab_mask=vocab_mask, **engine)

    @classmethod
    def padding(cls, s_pad: int) -> "SamplingBatch":
        """All padding rows (a warm-up or idle-rank batch)."""
        return cls.build([], {}, s_pad)

    @staticmethod
    def stack(batches: List["SamplingBatch"], s_pad: int, slots_per_rank: int) -> "SamplingBatch":
        """The batches of D data-parallel ranks (s_pad rows each) as one of D * s_pad rows: rank r's rows at
        [r * s_pad, (r + 1) * s_pad), its ``slots`` shifted into the stacked penalty-state rows (rank r's slot
        s -> r * slots_per_rank + s); a rank without grammar rows gets an all-allowed mask when another has one.
        """
        mask = stack_vocab_masks([b.vocab_mask for b in batches], s_pad)
        cat = lambda parts: np.concatenate([np.asarray(p) for p in parts])  # noqa: E731
        engine = {name: cat([getattr(b, name) for b in batches]) for name in ENGINE_ROWS}
        engine["slots"] = cat([np.asarray(b.slots) + r * slots_per_rank for r, b in enumerate(batches)]
                              ).astype(np.int32)
        engine["last_token"] = cat([shift_placeholders(b.last_token, r * slots_per_rank)
                                    for r, b in enumerate(batches)]).astype(np.int32)
        params = {name: cat([b.params[name] for b in batches]) for name in batches[0].params}
        return SamplingBatch(params=params, vocab_mask=mask, **engine)


def stack_vocab_masks(masks: Sequence[Optional[np.ndarray]], s_pad: int) -> Optional[np.ndarray]:
    """The vocab masks of D data-parallel ranks (int32[s_pad, words] each, or None: no grammar row) as one
    int32[D * s_pad, words], a rank without one all allowed; None when no rank has one."""
    if all(m is None for m in masks):
        return None
    width = next(np.shape(m)[1] for m in masks if m is not None)
    return np.concatenate([all_allowed_mask(s_pad, width) if m is None else np.asarray(m) for m in masks])


def shift_placeholders(ids, offset: int) -> np.ndarray:
    """int32 token ids whose placeholders ``-(slot + 1)`` (a rank's local request slot) are moved to the stacked
    rows of the future-token buffer: ``-(offset + slot + 1)``; real ids (>= 0) unchanged."""
    ids = np.asarray(ids, np.int32)
    return np.where(ids < 0, ids - offset, ids).astype(np.int32)


# the one table of the rows the scheduler fills: name -> (dtype, value of a padding row)
ENGINE_ROWS = {f.name: f.metadata["engine_row"] for f in dataclasses.fields(SamplingBatch)
               if "engine_row" in f.metadata}
