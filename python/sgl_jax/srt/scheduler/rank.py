"""One data-parallel attention rank of the scheduler: its memory, its queues, and its batches.

Each rank owns a ReqToTokenPool, a paged KV allocator over its own block of the KV cache, a prefix cache
(a radix hit on rank 0 is not a hit on rank 1), a waiting queue, a running batch, a chunked request and its
scoring groups and handles. The `Scheduler` (scheduler/scheduler.py) owns the ranks, the model runner and
the sockets: it assigns each request a rank, asks every rank for its next batch, runs them all as one step
and hands each rank its results (`apply_step`). With ``--dp-size 1`` there is one rank and this is the
whole scheduling policy.

Batches: prefill first, but one decode step of the running batch after every prefill step (between two
chunks of a long prompt too). Chunked prefill: a prompt longer than --chunked-prefill-size is prefilled a
chunk per step. Mixed chunked prefill (--enable-mixed-chunk): the running requests' decode rows ride in
the prefill step itself, so running streams get a token every step. --max-prefill-step-ms: while requests
run, the chunk is cut so that it adds at most the budget to their inter-token latency
(scheduler/step_budget.py).
Retract: when a decode step cannot get KV pages even after evicting cached prefixes, the
latest admitted requests are retracted (KV released, requeued) and resume later from prompt + generated
tokens.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, List, Optional

from sgl_jax.srt import fault_injection
from sgl_jax.srt.errors import RequestError
from sgl_jax.srt.io_struct import AbortReq, ScorePrefillReq, ScoreReleaseReq, TokenizedScoreReqInput
from sgl_jax.srt.preflight import KVLimits, check_fits
from sgl_jax.srt.scheduler.schedule_batch import FinishReason, Req, ScheduleBatch, finish_abort
from sgl_jax.srt.scheduler.admission import (
    INIT_NEW_TOKEN_RATIO,
    MIN_NEW_TOKEN_RATIO,
    NEW_TOKEN_RATIO_DECAY,
    PrefillAdder,
    ratio_after_retract,
)
from sgl_jax.srt.scheduler.output import extend_offsets, process_batch_result, token_out
from sgl_jax.srt.scheduler.scoring import SchedulerScoring
from sgl_jax.srt.scheduler.step_budget import PrefillStepBudget
from sgl_jax.srt.mem_cache.cache_manager import release_swa_out_of_window
from sgl_jax.srt.mem_cache.common import release_kv_cache
from sgl_jax.srt.mem_cache.kv_invariants import check_kv_invariants
from sgl_jax.srt.model_executor.forward_batch_info import ForwardMode

logger = logging.getLogger(__name__)

DECODE_LOG_INTERVAL = 40  # decode steps between "Decode batch" log lines (SGLang's default)
TEST_RETRACT_INTERVAL = 5


def session_state(session, page_size: int) -> dict:
    """One session's entry of the internal state (its KV fields between turns, for checks and debugging)."""
    out = {"session_id": session.session_id, "streaming": session.streaming, "num_turns": len(session.req_nodes)}
    kv = session.kv
    if kv is not None:
        h = kv.holder
        out.update({"holds_kv": kv.has_kv(), "turn_running": kv.lent_to is not None,
                    "last_turn_rid": None if h is None else h.rid,
                    "kv_tokens_session_held": kv.held_tokens(page_size)})
        if h is not None:
            out.update({f: getattr(h, f) for f in ("kv_committed_len", "kv_allocated_len", "cache_protected_len",
                                                    "swa_evicted_len")})
    return out


def fail_reason(req: Req, what: str, exc: BaseException) -> FinishReason:
    """A 500 abort whose message is one line: what failed and why (also logged, once)."""
    text = " ".join(str(exc).split())[:300]
    message = f"internal error while {what}: {type(exc).__name__}: {text}"
    logger.error("Request %s failed, aborted (the others go on): %s", req.rid, message)
    return finish_abort(message, 500)


class RankScheduler:
    """The scheduling state and policy of one DP rank.

    Args:
        rank: the rank's index (its KV block and penalty-state rows on device).
        dp_size: ranks in all (log lines name the rank when > 1).
        req_to_token_pool, allocator, tree_cache: the rank's memory (KV slots local to its block).
        scoring: the rank's `SchedulerScoring`.
        buckets, max_running_requests, max_prefill_tokens, chunk_size: admission limits (per rank).
        stream_interval: --stream-interval.
        send: list of TokenOut (None entries skipped) -> the detokenizer.
        decode_tail: (req, token ids) -> text, for stop strings.
        full_logprobs, label_logprobs, kv_cache_lost: the model runner's.
        test_retract: retract half the running requests every TEST_RETRACT_INTERVAL decode steps.
        swa_window: the model's sliding window when `allocator` has a separate SWA pool (hybrid SWA memory):
            admission then accounts for the SWA pool and, with `swa_release`, each running request's SWA KV
            that left the window is freed after every step.
        enable_mixed_chunk: mix the running requests' decode rows into prefill steps (needs chunked prefill).
        step_budget: the --max-prefill-step-ms chunk limit (None: chunks are --chunked-prefill-size).
    """

    def __init__(self, rank: int, dp_size: int, *, req_to_token_pool, allocator, tree_cache,
                 scoring: SchedulerScoring, buckets, max_running_requests: int, max_prefill_tokens: int,
                 chunk_size: Optional[int], stream_interval: int, send: Callable[[list], None],
                 decode_tail: Callable[[Req, List[int]], str], full_logprobs, label_logprobs,
                 kv_cache_lost: Callable[[], bool], test_retract: bool = False, swa_window: Optional[int] = None,
                 swa_release: bool = True, enable_mixed_chunk: bool = False,
                 step_budget: Optional[PrefillStepBudget] = None):
        self.rank = rank
        self.tag = f"[DP {rank}] " if dp_size > 1 else ""
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.scoring = scoring
        self.buckets = buckets
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.chunk_size = chunk_size
        self.stream_interval = stream_interval
        self._send = send
        self.decode_tail = decode_tail
        self.full_logprobs = full_logprobs
        self.label_logprobs = label_logprobs
        self.kv_cache_lost = kv_cache_lost
        self.test_retract = test_retract
        self.swa_window = swa_window
        self.swa_release = swa_release
        self.enable_mixed_chunk = enable_mixed_chunk and chunk_size is not None
        self.step_budget = step_budget if chunk_size is not None else None
        self.waiting_queue: List[Req] = []
        self.running_batch = ScheduleBatch([], ForwardMode.DECODE)
        self.chunked_req: Optional[Req] = None  # a request whose prompt is being prefilled in chunks
        self.last_mode: Optional[ForwardMode] = None
        self.last_mixed = False  # the last step carried the running requests' decode rows
        self.num_mixed_steps = 0
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.num_retracted_reqs = 0
        self.num_assigned_reqs = 0  # requests (and scoring groups) the load balancer gave this rank
        self.peak_running_reqs = 0  # most requests admitted at once (decoding + being chunk-prefilled)
        self.memory_errors = 0
        self.idle_checked = False
        self._last_forced_retract = 0
        self._decode_steps = 0
        self._decode_log_start = (time.time(), 0)  # (time, tokens generated) at the last decode log line
        self.num_generated_tokens = 0
        self.sessions: Callable[[], list] = lambda: []  # this rank's open sessions (set by the Scheduler)
        self.check_invariants = False  # SGL_JAX_CHECK_KV_INVARIANTS: the exact page-ownership check every step

    # ------------------------------------------------------------ load
    def is_busy(self) -> bool:
        """Requests queued, running or being chunk-prefilled."""
        return bool(self.waiting_queue) or not self.running_batch.is_empty() or self.chunked_req is not None

    def num_reqs(self) -> int:
        """Requests assigned to this rank and not finished (the load balancer's queue length)."""
        return len(self.waiting_queue) + len(self.running_batch.reqs) + (self.chunked_req is not None)

    # ------------------------------------------------------------ requests in
    def enqueue(self, req: Req) -> None:
        self.waiting_queue.append(req)

    def handle_score_request(self, msg: TokenizedScoreReqInput, limits: KVLimits) -> None:
        """Queue the sequences of a score request (see scheduler_scoring)."""
        self.waiting_queue.extend(self.scoring.handle_score_request(msg, limits))

    def handle_score_prefill(self, msg: ScorePrefillReq, limits: KVLimits) -> None:
        """Queue a scoring-cache query's prefill; 400 for an empty query, 413 when it cannot fit (preflight)."""
        n = len(msg.input_ids)
        try:
            if n == 0:
                raise RequestError("the scoring query is empty")
            check_fits(limits, n, what="the scoring query")
        except RequestError as e:
            self.scoring.fail(msg.rid, e.message, e.status_code)
            return
        self.waiting_queue.append(self.scoring.handle_prefill_request(msg))

    def abort(self, msg: AbortReq) -> bool:
        """Abort request (or scoring handle / group) ``msg.rid`` if this rank has it; returns whether it did."""
        if msg.rid in self.scoring.handles:  # a live scoring-cache handle: release it
            self.scoring.release_request(ScoreReleaseReq(msg.rid))
            return True
        group_reqs = self.scoring.abort_group(msg.rid, msg.message)
        if group_reqs:
            self._drop_waiting(group_reqs)
            return True
        for i, req in enumerate(self.waiting_queue):
            if req.rid == msg.rid:
                del self.waiting_queue[i]
                req.finished_reason = finish_abort(msg.message)
                if req.score is not None:
                    self.scoring.on_finished(req)
                else:
                    self._send([token_out(req, self.stream_interval)])
                return True
        running = self.running_batch.reqs + ([self.chunked_req] if self.chunked_req is not None else [])
        for req in running:
            if req.rid == msg.rid:
                req.to_abort = finish_abort(msg.message)
                return True
        return False

    def _drop_waiting(self, reqs: List[Req]) -> None:
        """Abort scoring Reqs of a failed group: queued ones leave the queue (they hold no KV yet), the one
        being chunk-prefilled finishes with an abort at its next step."""
        drop = set(id(r) for r in reqs)
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in drop]
        for req in reqs:
            if req is self.chunked_req:
                req.to_abort = finish_abort("score request aborted")
                continue
            req.finished_reason = finish_abort("score request aborted")
            self.scoring.on_finished(req)

    # ------------------------------------------------------------ batching
    def get_next_batch_to_run(self) -> Optional[ScheduleBatch]:
        """Prefill first, but one decode step of the running batch after every prefill step (between two
        chunks of a long prompt too), so a flood of prefill work -- long prompts, scoring requests --
        delays each running stream by at most one prefill step per token. A mixed prefill step (decode rows
        included) needs no decode step after it."""
        after_prefill = self.last_mode == ForwardMode.EXTEND and not self.last_mixed
        if not (after_prefill and not self.running_batch.is_empty()):
            batch = None
            if self.enable_mixed_chunk and not self.running_batch.is_empty() and self.has_prefill_work():
                batch = self.get_new_batch_prefill(mixed=True)
            if batch is None:
                batch = self.get_new_batch_prefill()
            if batch is not None:
                return batch
        return self.get_decode_batch()

    def has_prefill_work(self) -> bool:
        return bool(self.waiting_queue) or self.chunked_req is not None

    def prefill_token_limit(self, mixed: bool) -> Optional[int]:
        """The --max-prefill-step-ms chunk limit for the next prefill step (None: no limit)."""
        running = self.running_batch.reqs
        if self.step_budget is None or not running:
            return None
        prefix = self.chunked_req.kv_committed_len if self.chunked_req is not None else 0
        return self.step_budget.chunk_limit(self.chunk_size, prefix, [r.seqlen for r in running], mixed)

    def get_new_batch_prefill(self, mixed: bool = False) -> Optional[ScheduleBatch]:
        """The next extend batch: the chunked request first, then waiting requests in admission order
        (items of live scoring-cache handles first, then first come first served; see
        SchedulerScoring.admission_order), stopping at the first that does not fit. A new handle's query
        is skipped, not waited for, while the handle reserve is used up.

        mixed: the running requests' decode rows ride in the batch (each takes a token of the budget and a
        sequence of the bucket). Their KV slots are taken first (`prepare_for_decode`, evicting cached
        prefixes if needed); None when they cannot be had or nothing is admitted (the caller then asks again
        without mixing; slots already taken serve the next decode step, which takes only the missing ones)."""
        if not self.has_prefill_work():
            return None
        if mixed and not self._prepare_decode_slots():
            return None
        running = self.running_batch.reqs
        in_flight = len(running) + (1 if self.chunked_req is not None else 0)
        token_limit = self.prefill_token_limit(mixed)
        adder = PrefillAdder(self.buckets, self.allocator, self.tree_cache, running,
                             max_prefill_tokens=self.max_prefill_tokens, chunk_size=self.chunk_size,
                             free_req_slots=self.req_to_token_pool.available_size(),
                             free_running=self.max_running_requests - in_flight,
                             new_token_ratio=self.new_token_ratio, swa_window=self.swa_window,
                             swa_release=self.swa_release, decode_rows=len(running) if mixed else 0,
                             token_limit=token_limit)
        if self.chunked_req is not None and not adder.add_chunked(self.chunked_req):
            return None
        handle_room = self.scoring.handle_room(self.chunked_req, self.max_running_requests, self.allocator.size)
        failed = []
        for req in self.scoring.admission_order(self.waiting_queue):
            is_handle = req.score is not None and req.score.is_handle_prefill
            if is_handle and not handle_room.admits(req):
                continue
            try:
                fault_injection.check("schedule", (req.rid,))
                admitted = adder.add(req)
            except Exception as exc:  # this request cannot be scheduled: fail it, go on with the others
                failed.append((req, exc))
                continue
            if not admitted:
                break
            if is_handle:
                handle_room.take(req)
        if failed:
            dropped = set(id(r) for r, _ in failed)
            self.waiting_queue = [r for r in self.waiting_queue if id(r) not in dropped]
            for req, exc in failed:
                req.finished_reason = fail_reason(req, "scheduling the request", exc)
                self.finish_failed(req)
        if not adder.can_run:
            return None
        admitted = set(id(r) for r in adder.can_run)
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        self.chunked_req = adder.new_chunked_req
        if self.step_budget is not None:
            self.step_budget.record_step(token_limit, self.chunk_size)
        batch = ScheduleBatch(adder.can_run, ForwardMode.EXTEND)
        in_flight = {id(r) for r in self.running_batch.reqs + adder.can_run}
        self.peak_running_reqs = max(self.peak_running_reqs, len(in_flight))
        batch.prepare_for_extend(self.req_to_token_pool, self.allocator, self.tree_cache)
        if mixed:
            batch.mix_with_running(self.running_batch.reqs)
            self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        return batch

    def _prepare_decode_slots(self) -> bool:
        """Each running request's KV slot for its next decode row (True when every one has it)."""
        return self.running_batch.prepare_for_decode(self.req_to_token_pool, self.allocator, self.tree_cache)

    def get_decode_batch(self) -> Optional[ScheduleBatch]:
        """The running batch, with a KV slot per request; retracts requests when pages run out."""
        batch = self.running_batch
        if batch.is_empty():
            return None
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        if self.test_retract and self._decode_steps - self._last_forced_retract >= TEST_RETRACT_INTERVAL:
            self._last_forced_retract = self._decode_steps
            self.retract(max(1, len(batch.reqs) // 2))
        while not batch.is_empty() and not batch.prepare_for_decode(self.req_to_token_pool, self.allocator,
                                                                    self.tree_cache):
            self.retract(1)
            self.new_token_ratio = ratio_after_retract(batch.reqs)
        return None if batch.is_empty() else batch

    def retract(self, n: int) -> None:
        """Release the KV of the latest `n` admitted running requests and requeue them (at the front,
        oldest first); they resume from prompt + generated tokens."""
        victims = self.running_batch.reqs[-n:]
        del self.running_batch.reqs[-n:]
        for req in victims:
            release_kv_cache(req, self.tree_cache, is_insert=False)
            req.reset_for_retract()
        self.waiting_queue[:0] = victims
        self.num_retracted_reqs += len(victims)
        logger.info("%sRetracted %d requests (KV %d tokens free); %d running", self.tag, len(victims),
                    self.allocator.available_size(), len(self.running_batch.reqs))

    # ------------------------------------------------------------ after a step
    def apply_step(self, batch: ScheduleBatch, out) -> None:
        """Apply this rank's part of a step (`out`: its StepOutput; None when every request of the batch
        failed before running), then stream progress and release the finished."""
        self.last_mode = batch.forward_mode
        self.last_mixed = batch.forward_mode == ForwardMode.EXTEND and batch.num_decode_rows > 0
        self.num_mixed_steps += self.last_mixed
        self.idle_checked = False
        if out is not None:
            starts = [r.kv_committed_len for r in batch.reqs]  # positions this step computed start here
            process_batch_result(batch, out, self.tree_cache, self.full_logprobs, self.decode_tail,
                                 on_error=self.fail_after_step,
                                 check=lambda req: fault_injection.check("sample", (req.rid,)))
            if batch.forward_mode == ForwardMode.EXTEND and any(r.score is not None for r in batch.reqs):
                self.collect_scores(batch, out, starts)
        if batch.reqs:
            self.log_batch(batch)
        self.stream_and_release(batch)
        if self.swa_window and self.swa_release:
            for req in batch.reqs:
                if not req.finished():
                    release_swa_out_of_window(req, self.req_to_token_pool, self.allocator, self.swa_window)
        if self.check_invariants:
            self.check_kv_invariants()

    def check_kv_invariants(self) -> None:
        """The exact page-ownership check (mem_cache/kv_invariants.py); a violation counts as a memory error
        and is logged. Skipped while scoring handles or groups hold KV (they own rows of their own)."""
        if self.scoring.handles or self.scoring.groups:
            return
        holders = list(self.running_batch.reqs) + ([self.chunked_req] if self.chunked_req is not None else [])
        holders += [s.kv.holder for s in self.sessions() if s.holds_kv()]
        problems = check_kv_invariants(self.allocator, self.tree_cache, self.req_to_token_pool, holders)
        if problems:
            self.memory_errors += 1
            logger.error("%sKV invariants violated: %s", self.tag, "; ".join(problems))

    def collect_scores(self, batch: ScheduleBatch, out, starts: List[int]) -> None:
        """Label logprobs of the step's score positions; a request whose scores fail alone is failed."""
        offsets = [o + out.token_offset for o in extend_offsets(batch)]
        before = [len(r.score.label_logprobs) if r.score is not None else 0 for r in batch.reqs]
        try:
            self.scoring.collect(batch.reqs, out.hidden, offsets, starts, self.label_logprobs)
            return
        except Exception as exc:
            if self.kv_cache_lost():
                raise
            first_exc = exc
        failed = 0
        for i, (req, n) in enumerate(zip(batch.reqs, before)):  # one at a time, to find the ones that fail
            if req.score is None:
                continue
            del req.score.label_logprobs[n:]  # undo what the failed attempt appended
            try:
                self.scoring.collect([req], out.hidden, [offsets[i]], [starts[i]], self.label_logprobs)
            except Exception as exc:
                self.fail_after_step(req, exc, "computing the request's scores")
                failed += 1
        if failed == 0:
            raise first_exc

    def fail_in_batch(self, batch: ScheduleBatch, req: Req, exc: BaseException) -> None:
        """Fail a request of a batch that has not run: drop it, answer 500, free its KV."""
        batch.reqs.remove(req)
        if req in self.running_batch.reqs:  # a decode row of a mixed batch
            self.running_batch.reqs.remove(req)
        if req is self.chunked_req:
            self.chunked_req = None
        req.finished_reason = fail_reason(req, "running the request's step", exc)
        self.finish_failed(req)

    def fail_after_step(self, req: Req, exc: BaseException, what: str = "processing the request's sampled token"
                        ) -> None:
        """Fail a request whose step ran: it finishes now with a 500 (stream_and_release frees its KV)."""
        req.finished_reason = fail_reason(req, what, exc)

    def finish_failed(self, req: Req) -> None:
        """Answer and release a failed request that is in no batch (nor the waiting queue)."""
        if req.score is not None:
            if self.scoring.on_finished(req):
                release_kv_cache(req, self.tree_cache)
            return
        self._send([token_out(req, self.stream_interval)])
        release_kv_cache(req, self.tree_cache)

    def log_batch(self, batch: ScheduleBatch) -> None:
        """One line per prefill batch, and one per DECODE_LOG_INTERVAL decode steps (with throughput)."""
        acc = self.kv_accounting()
        used = 100.0 * acc["kv_tokens_in_use"] / max(acc["kv_tokens_total"], 1)
        if batch.forward_mode == ForwardMode.EXTEND:
            n_dec = batch.num_decode_rows
            prefill = [r for r in batch.reqs if not batch.is_decode_row(r)]
            limit = ""
            if self.step_budget is not None and self.step_budget.last_limit is not None:
                limit = f", chunk limit {self.step_budget.last_limit} (step budget {self.step_budget.budget_ms:g} ms)"
            logger.info("%sPrefill batch: %d new seqs, %d new tokens, %d running%s, %d waiting, KV %.1f%% used%s",
                        self.tag, len(prefill), sum(r.extend_input_len for r in prefill),
                        len(self.running_batch.reqs), f" ({n_dec} decoding in this step)" if n_dec else "",
                        len(self.waiting_queue), used, limit)
            self.num_generated_tokens += n_dec
            return
        self._decode_steps += 1
        self.num_generated_tokens += len(batch.reqs)
        if self._decode_steps % DECODE_LOG_INTERVAL == 0:
            t0, n0 = self._decode_log_start
            now = time.time()
            logger.info("%sDecode batch: %d running, %d waiting, KV %.1f%% used, gen throughput %.1f token/s",
                        self.tag, len(batch.reqs), len(self.waiting_queue), used,
                        (self.num_generated_tokens - n0) / max(now - t0, 1e-9))
            self._decode_log_start = (now, self.num_generated_tokens)

    def stream_and_release(self, batch: ScheduleBatch) -> None:
        """Send progress, release finished requests, and move fully prefilled ones into the running batch.

        A request between prefill chunks stays out of the running batch (it keeps its pool row and KV).
        """
        outs = []
        for req in batch.reqs:
            if req.score is None:
                try:
                    outs.append(token_out(req, self.stream_interval))
                except Exception as exc:  # one request's output failed: fail that request only
                    self.fail_after_step(req, exc, "sending the request's output")
                    outs.append(token_out(req, self.stream_interval, with_logprobs=False))
        self._send(outs)
        for req in batch.reqs:
            if req.finished():
                if req is self.chunked_req:
                    self.chunked_req = None
                if req.score is not None and not self.scoring.on_finished(req):
                    continue  # a query prefill that became a scoring-cache handle keeps its KV
                release_kv_cache(req, self.tree_cache)
        if batch.forward_mode == ForwardMode.EXTEND:
            if batch.num_decode_rows:  # (the mixed-in running requests)
                self.running_batch.filter_finished()
            done = [r for r in batch.reqs if not r.finished() and not r.is_chunked and not batch.is_decode_row(r)]
            self.running_batch.merge(ScheduleBatch(done, ForwardMode.DECODE))
        else:
            self.running_batch.filter_finished()

    # ------------------------------------------------------------ state
    def kv_accounting(self) -> dict:
        """KV tokens by owner: free, cached (the prefix cache's: evictable + locked), held by streaming
        sessions between turns (whole pages past their cached prefix), in use (running requests, scoring
        handles); with hybrid SWA memory the same for the SWA pool."""
        total = self.allocator.size
        free = self.allocator.available_size()
        cached = self.tree_cache.evictable_size()
        protected = self.tree_cache.protected_size()
        ps = self.allocator.page_size
        kv_sessions = [s.kv for s in self.sessions() if s.kv is not None]
        held = sum(kv.held_tokens(ps) for kv in kv_sessions)
        acc = {
            "kv_tokens_total": total,
            "kv_tokens_free": free,
            "kv_tokens_cached": cached + protected,
            "kv_tokens_session_held": held,
            "kv_tokens_in_use": total - free - cached - protected - held,
        }
        if self.swa_window:
            swa_total, swa_free = self.allocator.swa_size, self.allocator.swa_available_size()
            swa_cached = self.tree_cache.swa_evictable_size() + self.tree_cache.swa_protected_size()
            swa_held = sum(kv.held_swa_tokens(ps) for kv in kv_sessions)
            acc.update({
                "swa_tokens_total": swa_total,
                "swa_tokens_free": swa_free,
                "swa_tokens_cached": swa_cached,
                "swa_tokens_session_held": swa_held,
                "swa_tokens_in_use": swa_total - swa_free - swa_cached - swa_held,
                "swa_tokens_evictable": self.tree_cache.swa_evictable_size(),
                "swa_tokens_protected": self.tree_cache.swa_protected_size(),
            })
        return acc

    def internal_state(self) -> dict:
        """This rank's queues, KV accounting and counters (the per-rank entries of /get_server_info)."""
        state = self.kv_accounting()
        state.update({
            "dp_rank": self.rank,
            "num_running_reqs": len(self.running_batch.reqs),
            "num_waiting_reqs": len(self.waiting_queue),
            "req_slots_free": self.req_to_token_pool.available_size(),
            "memory_errors": self.memory_errors,
            "kv_tokens_evictable": self.tree_cache.evictable_size(),
            "kv_tokens_protected": self.tree_cache.protected_size(),
            "num_retracted_reqs": self.num_retracted_reqs,
            "num_assigned_reqs": self.num_assigned_reqs,
            "peak_running_reqs": self.peak_running_reqs,
            "num_mixed_steps": self.num_mixed_steps,
            "new_token_ratio": self.new_token_ratio,
            "num_score_handles": len(self.scoring.handles),
            "num_expired_score_handles": self.scoring.num_expired_handles,
            "num_score_groups": len(self.scoring.groups),
            "num_sessions": len(self.sessions()),
            "num_streaming_sessions": sum(s.streaming for s in self.sessions()),
            "req_slots_session_held": sum(s.holds_kv() for s in self.sessions()),
            "sessions": [session_state(s, self.allocator.page_size) for s in self.sessions()],
        })
        return state

    def holds_work(self) -> bool:
        """Anything that legitimately holds KV or a request slot: queued, running, chunking, live handles."""
        return self.is_busy() or bool(self.scoring.handles)

    def on_idle(self) -> None:
        """When this rank runs nothing: free + evictable + protected + session-held == total, no prefix
        locked but by streaming sessions, every request slot free but theirs (checked once per idle period)."""
        if self.idle_checked or self.holds_work():
            return  # (live scoring-cache handles hold KV and request slots by design)
        self.idle_checked = True
        self._decode_log_start = (time.time(), self.num_generated_tokens)
        acc = self.kv_accounting()
        free, evictable = self.allocator.available_size(), self.tree_cache.evictable_size()
        protected, held = self.tree_cache.protected_size(), acc["kv_tokens_session_held"]
        held_slots = sum(s.holds_kv() for s in self.sessions())
        slots_ok = self.req_to_token_pool.available_size() + held_slots == self.req_to_token_pool.size
        swa_ok = not self.swa_window or (acc["swa_tokens_in_use"] == 0 and
                                         (acc["swa_tokens_protected"] == 0 or held_slots > 0))
        if free + evictable + protected + held != acc["kv_tokens_total"] or (protected != 0 and not held_slots) \
                or not slots_ok or not swa_ok:
            self.memory_errors += 1
            logger.error("%sKV accounting mismatch while idle: free %d + evictable %d + protected %d + session-held "
                         "%d != total %d (or a prefix is still locked), free request slots %d + %d held by "
                         "sessions of %d", self.tag, free, evictable, protected, held, acc["kv_tokens_total"],
                         self.req_to_token_pool.available_size(), held_slots, self.req_to_token_pool.size)
            if not swa_ok:
                logger.error("%sSWA KV accounting mismatch while idle: %s", self.tag,
                             {k: v for k, v in acc.items() if k.startswith("swa_")})
