"""The overlap scheduler's placeholders (model_executor/future_tokens.py, forward_batch.stack_ranks,
SamplingBatch.stack): placeholders resolve to the slot's token, padding rows write nothing, and data-parallel
stacking moves each rank's placeholders to its own rows of the buffer."""

from __future__ import annotations

import dataclasses

import numpy as np

from sgl_jax.srt.forward_batch import ForwardBatch, ForwardMode, ModelWorkerBatch, stack_ranks
from sgl_jax.srt.model_executor.future_tokens import new_future_tokens, resolve_placeholders, write_future
from sgl_jax.srt.sampling.sampling_batch import SamplingBatch
from sgl_jax.srt.sampling.sampling_params import SamplingParams


def test_resolve_and_write():
    future = write_future(new_future_tokens(6), np.array([4, 0, 0, 0], np.int32),
                          np.array([True, True, False, False]), np.array([77, 55, 99, 98], np.int32))
    # row 1 (slot 0) wrote 55; the padding rows (slot 0 too) wrote nothing
    assert np.asarray(future).tolist() == [55, 0, 0, 0, 77, 0]
    ids = np.array([5, -5, -1, 0, 12], np.int32)  # -5: slot 4, -1: slot 0
    assert np.asarray(resolve_placeholders(ids, future)).tolist() == [5, 77, 55, 0, 12]


def _rank_batch(input_ids, slots, s_pad=4, t_pad=4) -> ModelWorkerBatch:
    """A rank's decode batch of len(input_ids) rows (each also its row's last_token), padded to (t_pad, s_pad)."""
    n = len(input_ids)
    ids = np.zeros(t_pad, np.int32)
    ids[:n] = input_ids
    fb = dataclasses.replace(ForwardBatch.padding(ForwardMode.DECODE, t_pad, s_pad, 2), input_ids=ids)
    rows = {"last_token": input_ids, "slots": slots, "writes_future": [True] * n}
    sampling = SamplingBatch.build([SamplingParams(max_new_tokens=1)] * n, rows, s_pad)
    return ModelWorkerBatch(forward_batch=fb, sampling=sampling, num_tokens=n, num_seqs=n)


def test_stack_ranks_moves_placeholders_to_each_ranks_rows():
    slots_per_rank = 8
    r0 = _rank_batch([-3, 17], [2, 5])  # slot 2 waits for its token, slot 5 has it
    r1 = _rank_batch([-1, -8], [0, 7])
    stacked = stack_ranks([r0, r1], slots_per_rank)
    ids = np.asarray(stacked.forward_batch.input_ids)
    assert ids[:2].tolist() == [-3, 17] and ids[4:6].tolist() == [-(8 + 0 + 1), -(8 + 7 + 1)]
    s = stacked.sampling
    assert np.asarray(s.last_token)[[0, 1, 4, 5]].tolist() == [-3, 17, -9, -16]
    assert np.asarray(s.slots)[[0, 1, 4, 5]].tolist() == [2, 5, 8, 15]
    # a placeholder resolves to what its own slot's row of the stacked buffer holds
    future = write_future(new_future_tokens(16), np.asarray(s.slots), np.asarray(s.writes_future),
                          np.arange(100, 108, dtype=np.int32))
    assert np.asarray(resolve_placeholders(ids[[0, 4, 5]], future)).tolist() == [100, 104, 105]
