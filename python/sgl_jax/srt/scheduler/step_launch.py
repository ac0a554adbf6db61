"""From the ranks' batches to a dispatched step: which program runs them and what the host hands it.

Two ways, chosen per step:

- a decode step on a runner with slot state (one KV pool, no speculative decoding) sends `DecodeRows`: each row's
  slot, position, KV slots and step count (`ModelRunner.launch_decode`); page tables, sampling parameters and input
  tokens are already on the device. With --num-continuous-decode-steps K it runs K steps when every running
  request may (`decode_steps_for`);
- every other step sends its host-built batches (`ModelRunner.launch_ranks`: an extend, a mixed chunk, a verify
  step, a decode step of a hybrid sliding-window pool).

In each, the penalty rows of requests new to their slot are loaded first, and a STANDALONE draft model runs the
step's forward too (scheduler/speculative/draft_model.py).

A decode step with grammar rows on a runner that splits them (`ModelRunner.grammar_split`: slot state, the overlap
scheduler on) is launched in two: `launch` dispatches its slot decode with every token allowed and returns a
`LaunchedForward` (`ModelRunner.launch_decode_split`); `sample` fills the masks and dispatches the sampling of the
step's logits again with them. The scheduler calls `sample` after applying the step before (its grammars have
accepted their tokens by then), so the masks are computed while the step's forward runs (scheduler/overlap.py).
"""

from __future__ import annotations

from typing import List, Optional

from sgl_jax.srt import fault_injection
from sgl_jax.srt.forward_batch import ForwardMode
from sgl_jax.srt.model_executor.step_output import LaunchedForward
from sgl_jax.srt.sampling.sampling_batch import stack_vocab_masks
from sgl_jax.srt.scheduler.schedule_batch import Req, ScheduleBatch, step_shape
from sgl_jax.srt.scheduler.speculative.speculation import build_verify_batch


def multi_step_ok(req: Req) -> bool:
    """Whether `req`'s decode rows may run several steps in one program: nothing of it needs the host between
    its tokens (a grammar's mask, the logits' top logprobs or token-id logprobs, routed experts)."""
    return (req.grammar is None and not (req.return_logprob and (req.top_logprobs_num > 0 or req.token_ids_logprob))
            and not req.return_routed_experts)


class StepLauncher:
    """Builds and dispatches the steps of a scheduler (see the module docstring).

    Args:
        runner: the `ModelRunner`.
        ranks: the scheduler's `RankScheduler`s (their KV memory).
        buckets: the compiled shapes; slots_per_rank: request slots per rank (--max-running-requests).
        draft_model: the scheduler's drafter with a model (``mirror``), or None.
    """

    def __init__(self, runner, ranks, buckets, slots_per_rank: int, draft_model=None):
        self.runner, self.ranks, self.buckets = runner, ranks, buckets
        self.slots_per_rank, self.draft_model = slots_per_rank, draft_model
        self.num_multi_steps = 0  # steps that ran more than one decode step in one program
        self.num_grammar_split_steps = 0  # decode steps with grammar rows drawn again once their masks were filled

    def decode_steps_for(self) -> int:
        """K for the next step: --num-continuous-decode-steps when the runner has slot state, no rank has prefill
        work (the step is a decode step) and every running request may run several steps (`multi_step_ok`);
        else 1."""
        k = self.runner.decode_steps
        if k <= 1 or not self.runner.slot_decode:
            return 1
        for rank in self.ranks:
            if rank.has_prefill_work() or not all(multi_step_ok(r) for r in rank.running_batch.reqs):
                return 1
        return k

    def launch(self, batches: List[Optional[ScheduleBatch]]):
        """Dispatch one step of every rank's batch (None: idle); returns its `PendingStep`, or the
        `LaunchedForward` of a decode step with grammar rows on a runner that splits them (`sample` launches its
        sampling; see the module docstring). Other steps' grammar masks are filled now."""
        live = [(r, b) for r, b in enumerate(batches) if b is not None and b.reqs]
        fault_injection.check("forward", [req.rid for _, b in live for req in b.reqs])
        self._init_penalty_rows(live)
        shape = step_shape([b for _, b in live], self.buckets)
        decode = shape[0] == ForwardMode.DECODE and all(b.forward_mode == ForwardMode.DECODE for _, b in live)
        split = decode and self.runner.grammar_split and any(r.grammar is not None for _, b in live for r in b.reqs)
        if decode and self.runner.slot_decode and not split:
            return self._launch_decode(batches, shape[2])
        worker_batches = [None] * len(batches)
        for r, batch in live:
            memory = self.ranks[r].memory
            if batch.forward_mode == ForwardMode.TARGET_VERIFY:
                worker_batches[r] = build_verify_batch(batch, self.buckets, memory, shape)
            else:
                worker_batches[r] = batch.build_model_worker_batch(self.buckets, memory, shape,
                                                                   fill_vocab_mask=not split)
        out = self.runner.launch_decode_split(worker_batches) if split else self.runner.launch_ranks(worker_batches)
        if self.draft_model is not None:
            self.draft_model.mirror(worker_batches)
        self.num_grammar_split_steps += split
        return out

    def sample(self, fwd: LaunchedForward, batches: List[Optional[ScheduleBatch]]):
        """Fill the grammar masks of a split decode step's rows from their grammars' state now and dispatch its
        sampling (`launch` returned `fwd` for `batches`); returns the step's `PendingStep`."""
        masks = [None if b is None or not b.reqs else b.vocab_mask(fwd.s_pad, [True] * len(b.reqs)) for b in batches]
        return self.runner.launch_sample(fwd, stack_vocab_masks(masks, fwd.s_pad))

    def run(self, batches: List[Optional[ScheduleBatch]]) -> list:
        """Run one step and wait for it: each rank's StepOutput (None when idle)."""
        out = self.launch(batches)
        if isinstance(out, LaunchedForward):
            out = self.sample(out, batches)
        return out.resolve()

    def _launch_decode(self, batches: List[Optional[ScheduleBatch]], s_pad: int):
        """A slot decode of every rank's DECODE batch (grammar masks filled now; K is 1 with grammars)."""
        k = max(b.num_steps for b in batches if b is not None and b.reqs)
        rows, masks = [], []
        for r, batch in enumerate(batches):
            if batch is None or not batch.reqs:
                rows.append(None)
                masks.append(None)
                continue
            rows.append(batch.build_decode_rows(self.ranks[r].memory, s_pad, k))
            masks.append(batch.vocab_mask(s_pad, [True] * len(batch.reqs)) if k == 1 else None)
        self.num_multi_steps += k > 1
        return self.runner.launch_decode(rows, stack_vocab_masks(masks, s_pad))

    def _init_penalty_rows(self, live) -> None:
        """Load the penalty history of requests new to their slot (admission, after a retract)."""
        for r, batch in live:
            for req in batch.reqs:
                if req.penalty_slot != req.req_pool_idx and req.sampling_params.uses_penalties():
                    self.runner.init_penalty_row(r * self.slots_per_rank + req.req_pool_idx, req.fill_ids,
                                                 len(req.origin_input_ids), req.sampling_params.logit_bias)
                    req.penalty_slot = req.req_pool_idx
