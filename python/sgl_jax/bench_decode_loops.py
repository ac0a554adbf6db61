"""The decode loops bench_one_batch times, built from the scheduler's own parts, with each iteration split by where
its time goes.

An iteration launches one decode step (K steps with --num-continuous-decode-steps K) and applies one step's
result. Without overlap it applies the step it launched; with overlap (the scheduler's default) it applies the one
launched before, whose input tokens the device took from its own future-token buffer. Its wall time splits into:

- build: the scheduler's host work before the dispatch -- the batch, its KV slots (`prepare_for_decode`) and its
  inputs (`ScheduleBatch.build_decode_rows`, or the host-built `build_model_worker_batch` on a runner without slot
  state) and their packing;
- h2d: the explicit host-to-device copy of the packed inputs; dispatch: the compiled program's call, from entry to
  return (`ModelRunner.launch_decode` / `launch_ranks`: `StepTimes`);
- wait: blocked until the applied step's tokens are computed (the device finishing it); d2h: then until they are
  on the host (their copy starts at launch);
- apply: the tokens appended, the KV counted as written (`commit_launched_row`), the memory's after-step work.

The device's own time per step is measured apart (`device_timing.device_seconds_per_decode`: the same program
re-run back to back); with overlap, what the host adds is visible as the part of an iteration the device is idle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import List, Optional

import jax
import numpy as np

from sgl_jax.srt.forward_batch import ForwardMode
from sgl_jax.srt.scheduler.output import commit_launched_row
from sgl_jax.srt.scheduler.schedule_batch import Req, ScheduleBatch

SPLIT_FIELDS = ("build", "h2d", "dispatch", "wait", "d2h", "apply")


@dataclasses.dataclass
class IterationTimes:
    """One loop iteration's wall time and its parts (seconds; see the module docstring)."""

    total: float = 0.0
    build: float = 0.0
    h2d: float = 0.0
    dispatch: float = 0.0
    wait: float = 0.0
    d2h: float = 0.0
    apply: float = 0.0


def medians_ms(times: List[IterationTimes]) -> dict:
    """{field: median ms} over iterations (total included)."""
    return {f: 1e3 * float(np.median([getattr(t, f) for t in times])) for f in ("total",) + SPLIT_FIELDS}


class DecodeLoop:
    """Decode steps of a fixed set of requests, driven as the scheduler drives them.

    Args:
        runner: the `ModelRunner`; memory: its rank's `KVMemory`; buckets: the compiled shapes.
        num_steps: decode steps per launch (K).
    """

    def __init__(self, runner, memory, buckets, num_steps: int = 1):
        self.runner, self.memory, self.buckets, self.num_steps = runner, memory, buckets, num_steps
        self.last_inputs = None  # the last launch's (DecodeRows or ModelWorkerBatch), for device timing

    def launch(self, reqs: List[Req], it: IterationTimes):
        """Prepare, build and dispatch one decode step of `reqs`: (the step's launched batch copy, PendingStep)."""
        t0 = time.perf_counter()
        batch = ScheduleBatch(reqs, ForwardMode.DECODE)
        if not batch.prepare_for_decode(self.memory, self.num_steps):
            raise RuntimeError("KV pool ran out during decode (sizing bug)")
        _, s_pad = self.buckets.decode_shape(len(reqs))
        idle = [None] * (self.runner.dp_size - 1)
        if self.runner.slot_decode:
            self.last_inputs = batch.build_decode_rows(self.memory, s_pad, batch.num_steps)
            launched = batch.launched()
            it.build += time.perf_counter() - t0
            pending = self.runner.launch_decode([self.last_inputs] + idle)
        else:
            self.last_inputs = batch.build_model_worker_batch(self.buckets, self.memory)
            launched = batch.launched()
            it.build += time.perf_counter() - t0
            pending = self.runner.launch_ranks([self.last_inputs] + idle)
        it.h2d += pending.times.h2d_s
        it.dispatch += pending.times.dispatch_s
        return launched, pending

    def apply(self, launched: ScheduleBatch, pending, it: IterationTimes) -> None:
        """Wait for a launched step's tokens and apply them (`it.wait`, `it.apply`)."""
        out = pending.resolve()[0]
        it.wait += pending.times.wait_s
        it.d2h += pending.times.d2h_s
        t0 = time.perf_counter()
        for i, r in enumerate(launched.reqs):
            commit_launched_row(launched, i)
            if out.multi_token_ids is not None:
                r.output_ids.extend(out.multi_token_ids[i, :launched.row_samples[i]].tolist())
            else:
                r.output_ids.append(int(out.next_token_ids[i]))
        self.memory.after_step(launched.reqs)
        it.apply += time.perf_counter() - t0

    def run(self, reqs: List[Req], iterations: int, overlap: bool, profile_dir: Optional[str] = None,
            profile_steps: int = 0) -> List[IterationTimes]:
        """`iterations` iterations (each launching one step; see the module docstring), with or without overlap:
        the times of those that launch one step and apply one (with overlap the first only launches and one more
        only applies). The first `profile_steps` run under a `jax.profiler` trace written to `profile_dir`, each
        iteration a step of it (``StepTraceAnnotation``)."""
        times, prev = [], None
        with contextlib.ExitStack() as stack:
            if profile_dir is not None and profile_steps > 0:
                stack.enter_context(jax.profiler.trace(profile_dir, create_perfetto_trace=True))
            for j in range(iterations + overlap):
                if j == profile_steps:
                    stack.close()  # (the trace is written; the rest runs untraced)
                with jax.profiler.StepTraceAnnotation("decode", step_num=j):
                    it, t0 = IterationTimes(), time.perf_counter()
                    cur = self.launch(reqs, it) if j < iterations else None
                    if overlap and prev is not None:
                        self.apply(*prev, it)
                    elif not overlap:
                        self.apply(*cur, it)
                    prev = cur
                    it.total = time.perf_counter() - t0
                if not overlap or 0 < j < iterations:
                    times.append(it)
        return times
