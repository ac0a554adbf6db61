"""Speculative decoding in the scheduler (``--speculative-algorithm NGRAM|STANDALONE|EAGLE|EAGLE3``): drafts, the verify
step's layout, and acceptance. One `Speculator` per DP rank. With STANDALONE a draft model drafts chains or trees
instead of the n-gram cache (scheduler/speculative/draft_model.py, asking `Speculator.draft_budget`), with EAGLE /
EAGLE3 an EAGLE head (scheduler/speculative/eagle_draft.py); the rest is the same.

A rank that speculates turns a decode step into a verify step (``ForwardMode.TARGET_VERIFY``) when some running
request has a draft (SGLang's n-gram worker; Leviathan et al. 2023, Miao et al. 2024 for the tree):

1. Draft (`Speculator.verify_batch`): each request that may speculate gets a draft tree from the rank's n-gram cache
   (speculative/ngram_cache.py), of at most --speculative-num-draft-tokens slots (fewer when max_new_tokens or the
   context is near), and KV slots for its draft positions after its root's (`KVMemory.allocate_drafts`). A batch in
   which nothing was drafted stays a decode step: speculation costs nothing where it has nothing to offer.
2. Layout (`build_verify_batch`): request i's tree slots are its queries; slot j is written at KV position
   ``seq_len - 1 + j`` and rotated at position ``seq_len - 1 + depth[j]``, attending to the committed KV and to its
   ancestors (``ForwardBatch.tree_bits``). Logits are taken at every slot and every slot is a sampling row, sampled
   as its request samples (its step index ``output tokens + depth``), so the greedy token after each slot comes
   out of the ordinary sampling program.
3. Acceptance (`Speculator.apply_verify`): `draft_tree.verify_greedy` walks the tree with the target's token after
   each slot; the accepted tokens and the bonus token are appended one at a time (`output.append_token`), so a stop
   token, a stop string or max_new_tokens ends the run where it lands. Under sampling the target's token after a
   slot is drawn with the request's own random stream at that output index (fold_in(key(seed), step), as without
   speculation), so the accepted path's tokens are exactly the tokens sampling one at a time draws: the output
   keeps the target's distribution and, for a seeded request, is the same as without speculation. (For a drafter
   without probabilities, as the n-gram one, this accepts a draft token with the target's probability of it, as
   the rejection sampling of Leviathan et al. 2023 does for a point-mass draft.) The K/V of the accepted slots
   moves to the positions they end at (`take_moves`, run by `ModelRunner.move_kv` before the next step), and every
   position past the last accepted one is given back (`KVMemory.rollback`): the prefix cache only ever sees
   accepted tokens.

Requests that use penalties or logit_bias, or follow a grammar, decode without drafts: their row in a verify step is
a one-slot tree (the root), sampled exactly as in a decode step, so their output is what it is without
speculation. The overlap scheduler chooses a step ahead only when no rank would verify whatever the step in flight
gives (`may_verify`; scheduler/overlap.py): a verify step needs the tokens before it, and the step after it needs its
accepted lengths (SGLang's first speculative worker turns overlap off).

A verify step's shape is keyed by its sequences (T = S_pad x draft slots), so one drafting request in a large batch
pads the whole step to that many tokens. A batch therefore drafts only when the tokens it is expected to give pay for
its verify step, by the step costs measured at start-up (scheduler/speculative/spec_costs.py:
`Speculator.batch_pays`); else it decodes normally.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from sgl_jax.srt.forward_batch import ForwardBatch, ForwardMode, ModelWorkerBatch
from sgl_jax.srt.model_executor.buckets import ShapeBuckets
from sgl_jax.srt.sampling.sampling_batch import SamplingBatch, all_allowed_mask
from sgl_jax.srt.scheduler.output import append_token, commit_launched_row
from sgl_jax.srt.scheduler.schedule_batch import Req, ScheduleBatch, cumulative_lens, last_input_token, pad_to, \
    page_table
from sgl_jax.srt.scheduler.speculative.spec_costs import StepCosts
from sgl_jax.srt.speculative.draft_tree import NO_TREE, first_chain, tree_bits, tree_depths, verify_greedy
from sgl_jax.srt.speculative.ngram_cache import NgramCache, NgramConfig

logger = logging.getLogger(__name__)


# Adaptive drafting (see `Speculator.draft_size`): a verify step of n slots costs about a decode step plus ~0.11 of
# one per draft slot (SmolLM2 on CPU: 8 slots 93 ms, a decode step 52 ms at 1,500 tokens of context), so drafts
# pay when more than about 0.11 x (n - 1) of them are accepted.
ACCEPT_EMA_START = 2.0  # a new request's expected accepted tokens per verify step: its first draft is 2 + 2 x 2 slots
ACCEPT_EMA_WEIGHT = 0.3  # the newest verify step's weight in the average
MIN_ACCEPT_EMA = 0.25  # below it a request stops drafting (the batch rule of spec_costs.py stops it sooner)
# ... but a request that has not drafted for this many decode steps probes: one draft sized and counted as a new
# request's (ACCEPT_EMA_START), to notice when its drafts match again (a copy that starts late in an answer). A probe
# that leaves the average below ACCEPT_EMA_START / 2 doubles the interval, up to MAX_PROBE_INTERVAL (on text with
# nothing to copy probes then cost ~1% of the steps); one that lifts it above resets it
PROBE_INTERVAL = 16
MAX_PROBE_INTERVAL = 256
# a prompt's last this many tokens enter the n-gram cache when its prefill ends (in Python the insertion costs ~30 us
# a token: a 2,000-token prompt ~60 ms on a 2-core CPU, a few % of its prefill; longer prompts are cut to bound it)
PROMPT_INSERT_TOKENS = 4096


@dataclasses.dataclass
class SpecCounts:
    """A request's speculative-decoding counts, reported in ``meta_info`` (SGLang's names): ``verify_ct`` decode
    steps run while speculating (verify steps, and decode steps in which nothing was drafted), ``draft_tokens``
    draft slots verified (roots not counted), ``accepted_tokens`` of them accepted. ``accept_ema``: the moving
    average of its accepted tokens per verify step with drafts; ``last_draft_ct``: the verify_ct of its last
    draft, ``probe_interval``: the decode steps without a draft after which it probes (`probing`);
    ``new_tokens``: what its last step appended; ``last_slot``: the slot of its last verify step's tree whose K/V
    its last kept position holds once the step's K/V moves ran (an EAGLE head's draft extend, run before them,
    stores that slot's row: scheduler/speculative/eagle_draft.py)."""

    verify_ct: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accept_ema: float = ACCEPT_EMA_START
    last_draft_ct: int = 0
    probe_interval: int = PROBE_INTERVAL
    new_tokens: int = 1  # tokens its last step appended (the n-gram cache takes in every window ending in them)
    last_slot: int = 0  # the slot of its last verify tree that its last kept position's K/V came from

    @property
    def probing(self) -> bool:
        """Whether it has gone `probe_interval` decode steps without a draft: its next draft is a probe."""
        return self.verify_ct - self.last_draft_ct >= self.probe_interval

    @property
    def unproven(self) -> bool:
        """Whether the batch rule counts its next draft as wholly accepted (`Speculator.expected_tokens`): it has
        verified no draft token yet, or it probes."""
        return self.draft_tokens == 0 or self.probing

    @property
    def expected_accepted(self) -> float:
        """Draft tokens its next verify step is expected to accept: its average, or a new request's when probing
        (what its draft is sized by, `Speculator.draft_size`; the batch rule counts a probe's whole draft)."""
        return ACCEPT_EMA_START if self.probing else self.accept_ema

    def observe(self, drafted: int, accepted: int) -> None:
        """A verify step verified `drafted` draft tokens of the request and accepted `accepted` of them."""
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        if drafted:
            probe = self.probing
            self.accept_ema += ACCEPT_EMA_WEIGHT * (accepted - self.accept_ema)
            self.last_draft_ct = self.verify_ct
            if self.accept_ema >= ACCEPT_EMA_START / 2:
                self.probe_interval = PROBE_INTERVAL
            elif probe:
                self.probe_interval = min(2 * self.probe_interval, MAX_PROBE_INTERVAL)


def may_draft(req: Req) -> bool:
    """Whether `req` may run draft tokens: without penalties or logit_bias (their history would have to follow each
    tree path) and without a grammar (so would its matcher); greedy or sampled alike (see the module docstring)."""
    return not req.sampling_params.uses_penalties() and req.grammar is None


def _tail(req: Req, n: int) -> List[int]:
    """The last `n` tokens of `req`'s prompt + output."""
    out = req.output_ids
    if len(out) >= n:
        return out[len(out) - n:]
    return req.origin_input_ids[max(0, len(req.origin_input_ids) - (n - len(out))):] + out


def _root_tree(req: Req) -> Tuple[np.ndarray, np.ndarray]:
    """The one-slot tree of a request that drafted nothing: its last token."""
    return np.asarray([last_input_token(req)], np.int32), np.asarray([-1], np.int32)


class Speculator:
    """One rank's speculation (see the module docstring).

    Args:
        config: the n-gram drafter's settings (`NgramConfig.from_server_args`); None: a draft model drafts
            (STANDALONE, scheduler/speculative/draft_model.py: it asks `draft_budget` and builds the verify batch
            itself).
        context_len: tokens per sequence (a draft never reaches past it).
        chain_only: draft chains, each tree's first branch (`draft_tree.first_chain`): for sliding-window models,
            whose windows are measured on the KV position, which a chain's slots have in depth order. A chain's
            accepted slots are its first ones: no K/V ever moves (so a separate SWA pool needs no move either).
        num_draft_tokens: the draft-tree slots of a draft model's chains (root included), without `config`.
    """

    def __init__(self, config: Optional[NgramConfig], context_len: int, chain_only: bool = False,
                 num_draft_tokens: Optional[int] = None):
        self.costs: Optional[StepCosts] = None  # the batch rule's step costs (set after warm-up; None: always draft)
        self.num_unpaid_steps = 0  # decode batches that would have drafted but did not pay (`batch_pays`)
        self.chain_only = chain_only
        self.cache = None if config is None else NgramCache(config)
        self.num_draft_tokens = config.num_draft_tokens if config is not None else num_draft_tokens
        self.context_len = context_len
        self._moves: Tuple[List[int], List[int]] = ([], [])
        self.num_verify_steps = 0
        self.num_drafted_rows = 0  # (request, verify step) pairs with a draft
        self.num_draft_tokens_total = 0
        self.num_accepted_tokens_total = 0
        self.num_kv_moves = 0

    # ---- before a step
    def _context(self, req: Req) -> List[int]:
        """The last tokens of `req` that the cache matches (its newest output last)."""
        return _tail(req, self.cache.config.max_match_window)

    def _budget(self, req: Req) -> int:
        """Draft slots `req` may run this step (root included): `draft_size`, and since a verify step emits at most
        one token per slot, no more than max_new_tokens leaves; no slot past the context."""
        n = min(self.draft_size(req.spec), self.context_len - req.seqlen + 1)
        mx = req.sampling_params.max_new_tokens
        return n if mx is None else min(n, mx - req.num_output_total)

    def draft_size(self, counts: Optional[SpecCounts]) -> int:
        """Draft-tree slots (root included) for a request with `counts` (None: the most): sized to what its drafts
        are expected to be accepted for (`SpecCounts.expected_accepted`) -- 2 + twice that, so a tree grows while
        its drafts match and shrinks when they do not --, and 0 while that is below MIN_ACCEPT_EMA (until it
        probes)."""
        if counts is None:
            return self.num_draft_tokens
        expected = counts.expected_accepted
        if expected < MIN_ACCEPT_EMA:
            return 0
        return max(2, min(self.num_draft_tokens, 2 + int(2 * expected)))

    def draft_budget(self, req: Req) -> int:
        """Draft slots (root included) `req` may run this step; 0 when it may not draft (`may_draft`)."""
        return self._budget(req) if may_draft(req) else 0

    @staticmethod
    def expected_tokens(num_seqs: int, drafts: Sequence[Tuple[Req, int]]) -> float:
        """Tokens a verify step of `num_seqs` sequences is expected to give when `drafts` (request, draft slots with
        the root) draft: one per sequence, plus per drafting request its expected accepted tokens -- its whole
        draft before it has verified a draft token and when it probes (`SpecCounts.unproven`: so a request gets to
        show what its drafts are worth wherever a fully accepted draft would pay; an estimate below that could keep
        a request whose drafts would all be accepted from ever drafting), else its moving average, at most its
        draft's length."""
        return num_seqs + sum(slots - 1 if req.spec is None or req.spec.unproven
                              else min(req.spec.accept_ema, slots - 1) for req, slots in drafts)

    def batch_pays(self, num_seqs: int, drafts: Sequence[Tuple[Req, int]]) -> bool:
        """Whether a batch of `num_seqs` sequences in which `drafts` draft should verify rather than decode
        (`spec_costs.StepCosts.pays`; always without measured costs). Counts the batches that do not pay."""
        if not drafts:
            return False
        if self.costs is None or self.costs.pays(num_seqs, self.expected_tokens(num_seqs, drafts)):
            return True
        self.num_unpaid_steps += 1
        return False

    def observe_draft(self, num_seqs: int, seconds: float) -> None:
        """Drafting for a batch of `num_seqs` sequences took `seconds` of wall time (`StepCosts.draft_ms`)."""
        if self.costs is not None:
            self.costs.observe_draft(num_seqs, 1000.0 * seconds)

    def _budgets(self, reqs: Sequence[Req]) -> List[Tuple[Req, int]]:
        """(request, draft slots) of the requests of `reqs` that may draft at least one token this step."""
        budgets = [(req, self._budget(req)) for req in reqs if may_draft(req)]
        return [(req, b) for req, b in budgets if b >= 2]

    def may_verify(self, reqs: Sequence[Req]) -> bool:
        """Whether a decode step of `reqs` might verify, whatever its drafts turn out to be: some request may draft
        and the batch rule finds drafting its whole budget paying (`verify_batch`'s first test, without counting).
        With a draft model: True (it decides per step)."""
        if self.cache is None:
            return True
        budgets = self._budgets(reqs)
        return bool(budgets) and (self.costs is None or
                                  self.costs.pays(len(reqs), self.expected_tokens(len(reqs), budgets)))

    def verify_batch(self, batch: ScheduleBatch, memory) -> ScheduleBatch:
        """The step for a decode batch whose requests each have their root's KV slot (`prepare_for_decode`): a
        TARGET_VERIFY batch with the drafts found and their KV slots taken, or `batch` itself when nothing was
        drafted. A request whose draft slots cannot be had, even by evicting cached KV, runs without a draft. With a
        draft model (no n-gram cache) `batch` itself: the scheduler drafts for every rank at once."""
        if self.cache is None:
            return batch
        n = len(batch.reqs)
        budgets = self._budgets(batch.reqs)
        if not self.batch_pays(n, budgets):  # not even if every request drafted its whole budget
            return batch
        t0 = time.perf_counter()
        found = []
        for req, budget in budgets:
            tokens, parents = self.cache.draft(self._context(req), pad=False, max_tokens=budget)
            if self.chain_only:
                tokens, parents = first_chain(tokens, parents)
            if len(tokens) > 1:
                found.append((req, tokens, parents))
        self.observe_draft(n, time.perf_counter() - t0)
        if not self.batch_pays(n, [(req, len(tokens)) for req, tokens, _ in found]):
            return batch
        drafts = {id(req): (tokens, parents) for req, tokens, parents in found
                  if memory.allocate_drafts(req, len(tokens) - 1)}
        if not drafts:
            return batch
        return ScheduleBatch(list(batch.reqs), ForwardMode.TARGET_VERIFY, drafts)

    @staticmethod
    def as_decode(batch: ScheduleBatch, memory) -> ScheduleBatch:
        """A verify batch without its drafts (their KV slots given back): a decode batch, for a step that another
        DP rank's extend decides (`unify_step`)."""
        for req in batch.reqs:
            if id(req) in batch.drafts:
                memory.rollback(req, req.seqlen)
        return ScheduleBatch(list(batch.reqs), ForwardMode.DECODE)

    # ---- after a step
    def apply_verify(self, batch: ScheduleBatch, out, memory, decode_tail: Callable,
                     on_error: Optional[Callable] = None, check: Optional[Callable] = None) -> None:
        """Apply a verify step's result (`batch`: its launched copy; `out`: the rank's StepOutput, a row per slot):
        accept each request's longest matching path, append its tokens, queue its K/V moves and give back the rest
        of its draft slots. `on_error` / `check` as in `output.process_batch_result`."""
        lp_rows = None
        if any(r.return_logprob and (r.top_logprobs_num > 0 or r.token_ids_logprob) for r in batch.reqs):
            lp_rows = out.logprob_rows()
        self.num_verify_steps += 1
        for i, req in enumerate(batch.reqs):
            commit_launched_row(batch, i)
            tree = batch.drafts.get(id(req)) or _root_tree(req)
            try:
                self._accept(req, tree, batch.row_token_starts[i], out, lp_rows, memory, decode_tail, check)
            except Exception as exc:
                if on_error is None:
                    raise
                on_error(req, exc)

    def _accept(self, req: Req, tree, first: int, out, lp_rows, memory, decode_tail, check) -> None:
        """One request of a verify step: `first` its root's row among the rank's sampling rows."""
        tokens, parents = tree
        base = req.seqlen - 1  # the root's position
        appended = 0
        try:
            if req.to_abort is not None:
                req.finished_reason = req.to_abort
                return
            if check is not None:
                check(req)
            target = np.asarray(out.next_token_ids[first:first + len(tokens)])
            accepted, emitted = verify_greedy(tokens, parents, target)
            row = memory.row(req)
            for k, token in enumerate(emitted):
                append_token(req, token, first + accepted[k], out, lp_rows, decode_tail)
                appended += 1  # positions up to base + k are kept: accepted slot accepted[k] must sit at base + k
                if k and accepted[k] != k:  # (queued at once, so a later failure keeps only positions in place)
                    self._moves[0].append(int(row[base + accepted[k]]))
                    self._moves[1].append(int(row[base + k]))
                if req.finished():
                    break
            if req.spec is not None:
                req.spec.observe(len(tokens) - 1, max(appended - 1, 0))
                req.spec.new_tokens = appended
                req.spec.last_slot = accepted[max(appended, 1) - 1]
            if len(tokens) > 1:
                self.num_drafted_rows += 1
                self.num_draft_tokens_total += len(tokens) - 1
                self.num_accepted_tokens_total += max(appended - 1, 0)
        finally:  # positions past the root and the accepted drafts are given back, whatever happened
            memory.rollback(req, base + max(appended, 1))

    def take_moves(self) -> Tuple[np.ndarray, np.ndarray]:
        """The K/V moves the steps applied since the last call queued, (src, dst) int32 rank-local slots; they must
        run before the next step's forward (the freed pages may be handed out again)."""
        src, dst = self._moves
        self._moves = ([], [])
        self.num_kv_moves += len(src)
        return np.asarray(src, np.int32), np.asarray(dst, np.int32)

    def after_step(self, batch: ScheduleBatch) -> None:
        """Feed the n-gram cache (a request's prompt, its last PROMPT_INSERT_TOKENS tokens, once its prefill
        completes; every decode row's windows that end in the tokens its step appended) and count the decode rows'
        verify steps."""
        for req in batch.reqs:
            if req.score is not None:
                continue
            if batch.is_decode_row(req):
                new = 1
                if req.spec is not None:
                    req.spec.verify_ct += 1
                    new, req.spec.new_tokens = req.spec.new_tokens, 1
                if self.cache is None:
                    continue
                if new <= 1:
                    self.cache.insert_tail(_tail(req, self.cache.config.branch_length))
                else:  # every window that ends in one of the new tokens
                    self.cache.insert_prompt(_tail(req, self.cache.config.branch_length + new - 1))
            elif not req.is_chunked and self.cache is not None:
                self.cache.insert_prompt(req.origin_input_ids[-PROMPT_INSERT_TOKENS:])

    def stats(self) -> dict:
        """Totals for the internal state: verify steps, the requests' drafts verified in them (a request with a
        draft in a verify step: the mean accepted length is (accepted + drafted rows) / drafted rows), draft tokens
        verified, accepted, accepted slots whose K/V moved (a path off the tree's first branch), decode batches that
        decoded normally because drafting did not pay (chosen after the step before was applied; one chosen ahead
        of it because no draft could pay, `may_verify`, counts in the scheduler's num_overlapped_steps), and the
        batch rule's step costs (`StepCosts.table`)."""
        return {"spec_verify_steps": self.num_verify_steps, "spec_drafted_rows": self.num_drafted_rows,
                "spec_draft_tokens": self.num_draft_tokens_total,
                "spec_accepted_tokens": self.num_accepted_tokens_total, "spec_kv_moves": self.num_kv_moves,
                "spec_unpaid_steps": self.num_unpaid_steps,
                "spec_step_costs_ms": None if self.costs is None else self.costs.table()}


def move_accepted_kv(speculators: Sequence[Speculator], runner, draft_model=None) -> None:
    """Dispatch the K/V moves of the verify steps just applied (`Speculator.take_moves`, one speculator per rank)
    on the target's `runner` and the draft model's (a STANDALONE drafter's `move_kv`; None: none), before any later
    step's forward reads the positions they fill."""
    moves = [s.take_moves() for s in speculators]
    if any(len(src) for src, _ in moves):
        runner.move_kv(moves)
        if draft_model is not None:
            draft_model.move_kv(moves)


def unify_step(batches: List[Optional[ScheduleBatch]],
               memories: Sequence) -> Tuple[List[Optional[ScheduleBatch]], bool]:
    """Make the DP ranks' batches of one step share a mode: a verify batch runs only with verify batches (a rank's
    decode batch then runs as a verify batch without drafts); when another rank extends, verify batches drop their
    drafts and decode inside the extend step. Returns (the batches, whether any changed mode)."""
    modes = {b.forward_mode for b in batches if b is not None and b.reqs}
    if ForwardMode.TARGET_VERIFY not in modes or len(modes) == 1:
        return batches, False
    out = []
    for b, memory in zip(batches, memories):
        if b is not None and b.forward_mode == ForwardMode.TARGET_VERIFY and ForwardMode.EXTEND in modes:
            b = Speculator.as_decode(b, memory)
        elif b is not None and b.forward_mode == ForwardMode.DECODE and ForwardMode.EXTEND not in modes:
            b = ScheduleBatch(list(b.reqs), ForwardMode.TARGET_VERIFY)
        out.append(b)
    return out, True


def tree_forward_batch(reqs: Sequence[Req], trees: Sequence[Tuple[np.ndarray, np.ndarray]], memory, t_pad: int,
                       s_pad: int) -> ForwardBatch:
    """The forward arrays of a TARGET_VERIFY step over draft trees (a verify step, and a top-k draft model's tree
    step, scheduler/speculative/draft_model.py): request i's tree ``trees[i]`` (tokens, parents) in its KV slots from
    its root's (seq_len - 1) on, slot j at position ``seq_len - 1 + depth[j]`` under the tree mask, its KV length the
    root's position + the tree's slots, logits at every slot; padded to (t_pad, s_pad). Full-attention pool fields
    only (`KVMemory.layer_pool_fields` adds the others)."""
    pool = memory.req_to_token_pool
    base = np.asarray([r.seqlen - 1 for r in reqs], np.int64)
    q_lens = np.asarray([len(t) for t, _ in trees], np.int64)
    rows = np.asarray([r.req_pool_idx for r in reqs], np.int64)
    kv_pos = np.concatenate([b + np.arange(n) for b, n in zip(base, q_lens)])
    positions = np.concatenate([b + tree_depths(p) for b, (_, p) in zip(base, trees)])
    bits = np.concatenate([tree_bits(p) if len(p) > 1 else np.full(1, NO_TREE, np.int32) for _, p in trees])
    T = int(q_lens.sum())
    return ForwardBatch(
        input_ids=pad_to(np.concatenate([t for t, _ in trees]).astype(np.int32), t_pad),
        positions=pad_to(positions.astype(np.int32), t_pad),
        out_cache_loc=pad_to(pool.req_to_token[np.repeat(rows, q_lens), kv_pos], t_pad),
        cu_q_lens=cumulative_lens(q_lens, s_pad), kv_lens=pad_to((base + q_lens).astype(np.int32), s_pad),
        page_indices=page_table(pool, rows, s_pad, memory.page_size), num_seqs=np.asarray(len(reqs), np.int32),
        logits_indices=pad_to(np.arange(T), t_pad), prefix_lens=np.zeros(s_pad, np.int32),
        segment_starts=np.zeros(t_pad, np.int32), shared_prefix_len=np.asarray(0, np.int32),
        tree_bits=pad_to(bits, t_pad, value=NO_TREE), forward_mode=ForwardMode.TARGET_VERIFY)


def build_verify_batch(batch: ScheduleBatch, buckets: ShapeBuckets, memory,
                       padded_shape: Optional[tuple] = None) -> ModelWorkerBatch:
    """Host arrays of a verify step (see the module docstring), padded to ``padded_shape`` (TARGET_VERIFY, T_pad,
    S_pad) or the verify bucket of the batch.

    Raises:
        ValueError: the batch does not fit the shape. RuntimeError: a request's KV slots are not its tree's.
    """
    reqs = batch.reqs
    S = len(reqs)
    trees = [batch.drafts.get(id(r)) or _root_tree(r) for r in reqs]
    q_lens = np.asarray([len(t[0]) for t in trees], np.int64)
    T = int(q_lens.sum())
    _, T_pad, S_pad = padded_shape or (ForwardMode.TARGET_VERIFY, *buckets.verify_shape(S))
    if T > T_pad or S > S_pad:
        raise ValueError(f"a verify batch of {T} slots in {S} trees does not fit the step shape ({T_pad}, {S_pad})")
    base = np.asarray([r.seqlen - 1 for r in reqs], np.int64)
    if np.any(np.asarray([r.kv_allocated_len for r in reqs]) != base + q_lens):
        raise RuntimeError("a verify row's KV slots do not match its draft tree")
    fb = tree_forward_batch(reqs, trees, memory, T_pad, S_pad)
    fb = dataclasses.replace(fb, **memory.layer_pool_fields(fb.page_indices, fb.out_cache_loc))
    sampling = _verify_sampling(reqs, trees, [tree_depths(p) for _, p in trees], fb.cu_q_lens[:S], T_pad)
    return ModelWorkerBatch(forward_batch=fb, sampling=sampling, num_tokens=T, num_seqs=S)


def _verify_sampling(reqs: List[Req], trees: list, depths: list, starts: np.ndarray, rows_pad: int) -> SamplingBatch:
    """A sampling row per slot: the request's parameters and seed, the step index of the token after the slot
    (output tokens + depth); the root row is the request's decode row (its penalties and grammar mask), a draft
    slot's row is plain (requests with penalties or a grammar never draft)."""
    sps, cols = [], {k: [] for k in ("seeds", "steps", "suppress_eos", "slots", "penalized", "last_token",
                                     "last_token_index", "constrained")}
    for req, (tokens, _), depth in zip(reqs, trees, depths):
        sp, n_out = req.sampling_params, req.num_output_total
        for j in range(len(tokens)):
            root = j == 0
            sps.append(sp)
            cols["seeds"].append(req.seed)
            cols["steps"].append(n_out + int(depth[j]))
            cols["suppress_eos"].append(n_out + int(depth[j]) < sp.min_new_tokens)
            cols["slots"].append(req.req_pool_idx)
            cols["penalized"].append(root and sp.uses_penalties())
            cols["last_token"].append(int(tokens[0]) if root else 0)
            cols["last_token_index"].append(n_out - 1 if root else -1)
            cols["constrained"].append(root and req.grammar is not None)
    mask = None
    grammar_reqs = [(req, int(s)) for req, s in zip(reqs, starts) if req.grammar is not None]
    if grammar_reqs:
        mask = all_allowed_mask(rows_pad, grammar_reqs[0][0].grammar.mask_width)
        for req, row in grammar_reqs:
            req.grammar.fill_vocab_mask(mask, row)
    return SamplingBatch.build(sps, cols, rows_pad, mask)


def new_speculators(server_args, context_len: int, num_ranks: int,
                    sliding_window: bool = False) -> List[Optional[Speculator]]:
    """One `Speculator` per DP rank when ``--speculative-algorithm`` is set, else Nones; `sliding_window`: the
    model has sliding-window layers (n-gram drafts: chains only; a draft model's trees are refused for such models
    at start-up, scheduler/speculative/drafters.py)."""
    if server_args.speculative_algorithm is None:
        return [None] * num_ranks
    if server_args.speculative_algorithm != "NGRAM":  # (the draft model's drafts: `chain_only` is the n-gram path's)
        return [Speculator(None, context_len, chain_only=True,
                           num_draft_tokens=server_args.speculative_num_draft_tokens) for _ in range(num_ranks)]
    config = NgramConfig.from_server_args(server_args)
    return [Speculator(config, context_len, chain_only=sliding_window) for _ in range(num_ranks)]
