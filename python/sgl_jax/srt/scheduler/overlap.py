"""The overlap scheduler's bookkeeping: the step in flight, and when the next one may be chosen before its result.

SGLang's default event loop (``event_loop_overlap``), here without a thread (JAX dispatch is already asynchronous):
the scheduler launches step n+1 and only then waits for step n's result and applies it, so the host's work
between steps (applying results, streaming, scheduling, building the batch) runs while the device computes. A
decode row whose input token step n is still sampling carries a placeholder that the device resolves
(model_executor/future_tokens.py), so outputs are identical with ``--disable-overlap-schedule``.

Only decode steps stay in flight past their iteration (a prefill step's result is applied at once, so the inputs
taken in at the next iteration -- aborts, score releases, sessions -- never see a prefill whose result is pending),
and step n+1 is chosen ahead of step n's result only when the next one is a decode step too: no rank has prefill
work (waiting or chunk-prefilled requests). Any other step is chosen after the result is applied
(``Scheduler.drain``), as are retracts and the re-runs that isolate a faulty request.

A request with a grammar needs every earlier token accepted before its vocabulary mask can be computed. A decode
step with such rows runs as two programs (scheduler/step_launch.py): its slot decode is launched with every token
allowed, step n is applied (the grammars accept their tokens), the masks are filled while the device runs that
step, and then the step's logits are sampled again with them, as SGLang's overlap worker waits for the masks before
sampling. Each decode row count's sampling program is compiled at start-up for it (`ModelRunner.grammar_split`).
Without the split -- --grammar-overlap off, or auto on a CPU device (there the host's mask work shares the cores
with the device and the second draw costs more than the overlap gives), or a runner without slot state (a hybrid
sliding-window pool) -- a step with grammar rows is chosen after the result before it is applied.

While speculating with NGRAM, a step chosen ahead is a decode step: its drafts would need step n's tokens. So the
next step is chosen ahead only when no rank would verify whatever step n gives (`Speculator.may_verify`: the batch
rule finds no draft paying, or no request may draft) -- a large batch on a machine where verify steps cost several
decode steps; otherwise step n is applied first and the next step drafts from its tokens. A verify step itself is
applied at once (its accepted lengths decide the next step's positions). A draft model (STANDALONE, EAGLE, EAGLE3)
runs every step of the target and drafts from its results, so the overlap scheduler is off with one.

Requests that finish by length are left out of the step chosen ahead (`Req.done_by_length_ahead`); one that stops
on a stop token or string runs one extra decode row, whose token is dropped and whose KV slot its release frees
(`ScheduleBatch.drop_finished_rows`), as in SGLang.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from sgl_jax.srt.forward_batch import ForwardMode
from sgl_jax.srt.scheduler.schedule_batch import ScheduleBatch


@dataclasses.dataclass
class LaunchedStep:
    """A step dispatched to the device whose result is not applied yet.

    batches: per rank, the step's own copy of its batch (`ScheduleBatch.launched`; None: the rank idled).
    pending: the model runner's `PendingStep`.
    launched_at: time.perf_counter() at dispatch (s); cost_features: the step-time model's features, or None.
    """

    batches: List[Optional[ScheduleBatch]]
    pending: object
    launched_at: float
    cost_features: object = None

    @property
    def is_decode(self) -> bool:
        """Every rank that runs decodes (no prefill row, no chunk)."""
        return all(b.forward_mode == ForwardMode.DECODE for b in self.batches if b is not None)


def may_choose_ahead(inflight: Optional[LaunchedStep], ranks, grammar_split: bool) -> bool:
    """Whether the next step may be chosen while `inflight` runs (see the module docstring); `ranks` the
    `RankScheduler`s after this iteration's inputs were taken in; `grammar_split`: whether a decode step with
    grammar rows can launch its sampling after its forward (else such a step waits for the result)."""
    if inflight is None or not inflight.is_decode:
        return False
    for rank in ranks:
        if rank.has_prefill_work():
            return False
        if rank.speculator is not None and rank.speculator.may_verify(rank.running_batch.reqs):
            return False
        if not grammar_split and any(r.grammar is not None for r in rank.running_batch.reqs):
            return False
    return True
