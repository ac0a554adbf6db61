"""The device's own time per step of a `ModelRunner`, host work excluded: a step's inputs put on the device once,
its program dispatched back to back, one wait at the end. Speculation's batch rule
(scheduler/speculative/spec_costs.py) and the benchmarks (bench_one_batch, bench_buckets) time programs with it.
"""

from __future__ import annotations

import time

import jax

from sgl_jax.srt.forward_batch import DecodeRows, ForwardMode, ModelWorkerBatch
from sgl_jax.srt.model_executor.packed_inputs import pack
from sgl_jax.srt.model_executor.step_output import StepTimes


def device_seconds_per_step(runner, batch: ModelWorkerBatch, repeats: int, sample: bool = True) -> float:
    """Seconds the device takes per step of `batch` (rank 0), host work excluded: its inputs are put on the device
    once, the step (forward and sampling in one program; the forward alone without `sample`) is dispatched
    `repeats` times back to back without reading a result, then waited for once. Re-running a step rewrites the
    same KV slots with the same values; its sampled ids are dropped (benchmarks only: the penalty rows of its
    sequences count its tokens again). Times the programs for speculation's batch rule
    (scheduler/speculative/spec_costs.py)."""
    stacked = runner._step_batch([batch] + [None] * (runner.dp_size - 1))
    packed, layout = runner._step_inputs(stacked, StepTimes())
    mask = runner._vocab_mask(batch.rows_pad * runner.dp_size, stacked.sampling.vocab_mask)
    jax.block_until_ready(runner.kv_caches)
    t0 = time.perf_counter()
    for _ in range(repeats):
        if sample and runner.fused_steps and batch.forward_batch.forward_mode != ForwardMode.EXTEND:
            runner.kv_caches, runner._state, out = runner._step(runner._param_leaves, runner.kv_caches,
                                                                runner._state, packed, mask, layout)
        else:
            runner.kv_caches, runner.slot_state, out, *_, head = runner._forward(
                runner._param_leaves, runner.kv_caches, runner.slot_state, runner.future_tokens, packed, layout)
            if sample:
                runner.penalty_state, runner.future_tokens, out, _ = runner._sample(
                    out, runner.penalty_state, runner.future_tokens, head, mask, runner._sampling_layout(layout))
    jax.block_until_ready((runner.kv_caches, out))
    return (time.perf_counter() - t0) / repeats


def device_seconds_per_decode(runner, rows: DecodeRows, repeats: int) -> float:
    """Seconds the device takes per call of the decode program of rank 0's `rows` (K steps each), as
    `device_seconds_per_step` times a host-built step: the inputs copied once, `repeats` calls back to back,
    one wait. The rows' KV slots and their page-table entries are rewritten with the same values; each call
    reads the future tokens the one before wrote (benchmarks only)."""
    stacked = DecodeRows.stack([rows] + [DecodeRows.padding(rows.rows_pad, rows.num_steps)] * (runner.dp_size - 1),
                               runner.num_request_slots)
    buf, layout = pack(stacked)
    packed, mask = runner._put(buf), runner._all_allowed_mask(rows.rows_pad * runner.dp_size)
    jax.block_until_ready(runner.kv_caches)
    t0 = time.perf_counter()
    program = runner._decode(rows.num_steps)
    for _ in range(repeats):
        runner.kv_caches, runner._state, out = program(runner._param_leaves, runner.kv_caches, runner._state, packed,
                                                       mask, layout)
    jax.block_until_ready((runner.kv_caches, out))
    return (time.perf_counter() - t0) / repeats
