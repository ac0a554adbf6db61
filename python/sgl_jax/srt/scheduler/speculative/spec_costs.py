"""Whether drafting pays for a batch (issue #39: "when acceptance is too low for a batch to pay, that batch decodes
normally"). A verify step of S_pad sequences runs S_pad x --speculative-num-draft-tokens tokens; at batch 1 it costs
about what a decode step costs (the step reads the weights once), but at larger batches, and on a CPU at any
batch, it is compute-bound and costs several decode steps. So a batch drafts only when the tokens its verify step is
expected to give, per millisecond, beat a decode step's one token per sequence:

    expected_tokens / (verify_ms[S_pad] + draft_ms[S_pad]) >= PAY_MARGIN x num_seqs / decode_ms[S_pad]

- ``decode_ms`` and ``verify_ms``: the device time of the compiled decode and verify programs at each batch-size
  padding, measured once at start-up on all-padding batches (`measure_step_costs`), on this machine.
- ``draft_ms``: what drafting took (the n-gram lookups, a draft model's or EAGLE head's decode steps), a moving
  average of the wall time of the steps that drafted, per S_pad; 0 until a batch of that size first drafts.
- ``expected_tokens``: per sequence 1 (the token a decode step gives too) plus the draft tokens it is expected to
  have accepted (`speculation.Speculator.expected_tokens`: its moving average; its whole draft before its first
  verified draft token and when it probes, so every request gets to show what its drafts are worth wherever a wholly
  accepted draft would pay -- the average's optimistic start alone kept a copy-heavy request from ever drafting on a
  machine where a verify step at batch 1 costs over 2.7 decode steps: CI's, 2026-11-28).

SGLang serves speculation at every batch size; vLLM turns it off above a fixed batch size
(``speculative_disable_by_batch_size``). Both leave the choice to the operator; measuring the two programs instead
lets one server speculate at batch 1 and decode normally in a large batch on the same machine.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
from typing import Dict, List, Tuple

from sgl_jax.srt.forward_batch import ForwardMode
from sgl_jax.srt.model_executor.buckets import ShapeBuckets
from sgl_jax.srt.model_executor.device_timing import device_seconds_per_step

logger = logging.getLogger(__name__)

# drafting must promise this much more output per millisecond than decoding: the costs are measured on all-padding
# batches and drift with context length and machine load (issue #39 allows speculation to lose at most 5%)
PAY_MARGIN = 1.1
DRAFT_MS_WEIGHT = 0.3  # the newest drafting time's weight in `StepCosts.draft_ms`
TIMED_REPEATS = 3  # timed rounds of the programs at start-up, each program's fastest kept (after one untimed run)
# Test hook: when "1", the batch rule is off (every batch drafts what its requests may draft), so that tests verify
# drafts at every batch size whatever this machine's step costs
ALWAYS_DRAFT_ENV = "SGL_JAX_TEST_SPEC_ALWAYS_DRAFT"


def batch_rule_on() -> bool:
    """Whether speculation's batch rule runs (off under the ALWAYS_DRAFT_ENV test hook)."""
    return os.environ.get(ALWAYS_DRAFT_ENV) != "1"


@dataclasses.dataclass
class StepCosts:
    """Milliseconds per step at each batch-size padding (see the module docstring). ``decode_ms`` and
    ``verify_ms``: S_pad -> ms of the target's decode / verify program; ``draft_ms``: S_pad -> ms of drafting
    (observed; missing: not observed yet, taken as 0)."""

    decode_ms: Dict[int, float]
    verify_ms: Dict[int, float]
    draft_ms: Dict[int, float] = dataclasses.field(default_factory=dict)

    def s_pad(self, num_seqs: int) -> int:
        """The batch-size padding a step of `num_seqs` sequences runs at (the largest when none holds them)."""
        paddings = sorted(self.decode_ms)
        return paddings[min(bisect.bisect_left(paddings, num_seqs), len(paddings) - 1)]

    def pays(self, num_seqs: int, expected_tokens: float) -> bool:
        """Whether a verify step of `num_seqs` sequences expected to give `expected_tokens` tokens (num_seqs of
        them without any accepted draft) beats a decode step of the same sequences by PAY_MARGIN."""
        s = self.s_pad(num_seqs)
        spec_ms = self.verify_ms[s] + self.draft_ms.get(s, 0.0)
        return expected_tokens * self.decode_ms[s] >= PAY_MARGIN * num_seqs * spec_ms

    def observe_draft(self, num_seqs: int, ms: float) -> None:
        """Drafting for `num_seqs` sequences took `ms` milliseconds of wall time."""
        s = self.s_pad(num_seqs)
        old = self.draft_ms.get(s)
        self.draft_ms[s] = ms if old is None else old + DRAFT_MS_WEIGHT * (ms - old)

    def table(self) -> List[Tuple[int, float, float, float]]:
        """(S_pad, decode ms, verify ms, draft ms) rows, for the log and the internal state."""
        return [(s, round(self.decode_ms[s], 3), round(self.verify_ms[s], 3), round(self.draft_ms.get(s, 0.0), 3))
                for s in sorted(self.decode_ms)]


def measure_step_costs(runner, buckets: ShapeBuckets, mirror=None) -> StepCosts:
    """Time the target's compiled decode and verify programs at every batch-size padding on all-padding batches
    (`ModelRunner.dummy_batch`: nothing but the padding page is written; `device_timing.device_seconds_per_step`).
    Each program runs once untimed, then the programs of a padding take turns for TIMED_REPEATS rounds and each
    keeps its fastest run: a burst of other work on the machine then slows both programs' runs alike instead of
    skewing their ratio, which the rule decides by. `mirror`: a STANDALONE draft model's runner, which runs every
    target step too (its forward is added to both; an EAGLE head's step over the same rows is one layer and left
    out). Call after warm-up (nothing compiles here) and before serving. Returns the `StepCosts` without
    drafting times."""
    decode, verify = {}, {}
    runners = [(runner, True)] + ([] if mirror is None else [(mirror, False)])
    for s in buckets.bs_paddings:
        programs = [(into, r, r.dummy_batch(mode, *shape), sample) for r, sample in runners
                    for mode, shape, into in ((ForwardMode.DECODE, buckets.decode_shape(s), decode),
                                              (ForwardMode.TARGET_VERIFY, buckets.verify_shape(s), verify))]
        for _, r, batch, sample in programs:
            device_seconds_per_step(r, batch, 1, sample)
        fastest = [float("inf")] * len(programs)
        for _ in range(TIMED_REPEATS):
            for i, (_, r, batch, sample) in enumerate(programs):
                fastest[i] = min(fastest[i], 1000.0 * device_seconds_per_step(r, batch, 1, sample))
        for (into, *_), ms in zip(programs, fastest):
            into[s] = into.get(s, 0.0) + ms
    costs = StepCosts(decode, verify)
    logger.info("Speculation's batch rule: decode / verify ms per step measured at S_pad %s",
                ", ".join(f"{s}: {d:.1f} / {v:.1f}" for s, d, v, _ in costs.table()))
    return costs
