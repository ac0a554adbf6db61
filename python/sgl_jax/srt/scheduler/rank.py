"""One data-parallel attention rank of the scheduler: its memory, its queues, and its batches.

Each rank owns its KV memory (`mem_cache/kv_memory.KVMemory`: request slots, the allocators over its own block of
the KV cache, its prefix cache -- a radix hit on rank 0 is not a hit on rank 1), its admission policy
(scheduler/admission.py), a waiting queue, a running batch, a chunked request and its scoring groups and
handles. A rank is built from a `RankConfig`, its memory, scoring and admission, and the `RankHooks` it calls
back (the Scheduler); nothing is assigned after construction. The `Scheduler` (scheduler/scheduler.py) owns the ranks, the model runner and
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

import dataclasses
import logging
import time
from typing import List, Optional, Protocol

import numpy as np

from sgl_jax.srt import fault_injection
from sgl_jax.srt.errors import RequestError
from sgl_jax.srt.forward_batch import ForwardMode
from sgl_jax.srt.io_struct import AbortReq, ScorePrefillReq, ScoreReleaseReq, TokenizedScoreReqInput
from sgl_jax.srt.mem_cache.kv_memory import KVMemory
from sgl_jax.srt.mem_cache.req_kv import kv_fields
from sgl_jax.srt.model_executor.buckets import ShapeBuckets
from sgl_jax.srt.preflight import KVLimits, check_fits
from sgl_jax.srt.scheduler.admission import AdmissionPolicy
from sgl_jax.srt.scheduler.output import process_batch_result, token_out
from sgl_jax.srt.scheduler.schedule_batch import FinishReason, Req, ScheduleBatch, finish_abort
from sgl_jax.srt.scheduler.scoring import SchedulerScoring
from sgl_jax.srt.scheduler.speculative.speculation import Speculator

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
            out.update(kv_fields(h))
    return out


def fail_reason(req: Req, what: str, exc: BaseException) -> FinishReason:
    """A 500 abort whose message is one line: what failed and why (also logged, once); a RequestError (the request
    itself at fault, e.g. a grammar this model's vocabulary cannot follow) aborts with its own status and message."""
    if isinstance(exc, RequestError):
        logger.warning("Request %s aborted: %s", req.rid, exc.message)
        return finish_abort(exc.message, exc.status_code)
    text = " ".join(str(exc).split())[:300]
    message = f"internal error while {what}: {type(exc).__name__}: {text}"
    logger.error("Request %s failed, aborted (the others go on): %s", req.rid, message)
    return finish_abort(message, 500)


@dataclasses.dataclass(frozen=True)
class RankConfig:
    """What a rank is configured with.

    rank: the rank's index (its KV block and penalty-state rows on device); dp_size: ranks in all (log lines name
    the rank when > 1). buckets, max_running_requests, max_prefill_tokens, chunk_size: its limits (per rank).
    stream_interval: --stream-interval. enable_mixed_chunk: mix the running requests' decode rows into prefill
    steps (needs chunked prefill). test_retract: retract half the running requests every TEST_RETRACT_INTERVAL
    decode steps (SGL_JAX_TEST_RETRACT). check_invariants: the exact page-ownership check after every step
    (SGL_JAX_CHECK_KV_INVARIANTS).
    """

    rank: int
    dp_size: int
    buckets: ShapeBuckets
    max_running_requests: int
    max_prefill_tokens: int
    chunk_size: Optional[int]
    stream_interval: int = 1
    enable_mixed_chunk: bool = False
    test_retract: bool = False
    check_invariants: bool = False


class RankHooks(Protocol):
    """What a rank calls back (the `Scheduler` implements it)."""

    def send(self, outs: list) -> None:
        """TokenOut messages (None entries skipped) -> the detokenizer."""

    def decode_tail(self, req: Req, ids: List[int]) -> str:
        """Token ids -> text, for stop strings."""

    def full_logprobs(self, hidden_rows: np.ndarray) -> np.ndarray:
        """float32[N, hidden] -> float32[N, V] log-softmax (input-token logprobs)."""

    def label_logprobs(self, hidden_rows: np.ndarray, label_ids) -> np.ndarray:
        """float32[N, hidden], L label ids -> float32[N, L] log-probabilities (scoring)."""

    def kv_cache_lost(self) -> bool:
        """Whether a failed step lost the donated device state (the scheduler must stop)."""

    def sessions_on_rank(self, rank: int) -> list:
        """The open sessions whose KV lives on `rank`."""

    def drain(self) -> bool:
        """Apply the step in flight, if any (the overlap scheduler's sync point; every rank's part); returns whether
        there was one."""

    def step_in_flight(self) -> bool:
        """Whether a launched step's result is not applied yet (the overlap scheduler chose this step ahead)."""


class RankScheduler:
    """The scheduling state and policy of one DP rank.

    Args:
        config: `RankConfig`.
        memory: the rank's `KVMemory`.
        scoring: the rank's `SchedulerScoring`.
        admission: the rank's `AdmissionPolicy`.
        hooks: `RankHooks`.
        speculator: the rank's `speculation.Speculator` with --speculative-algorithm, else None.
    """

    def __init__(self, config: RankConfig, memory: KVMemory, scoring: SchedulerScoring, admission: AdmissionPolicy,
                 hooks: RankHooks, speculator: Optional[Speculator] = None):
        self.config = config
        self.speculator = speculator
        self.rank = config.rank
        self.tag = f"[DP {config.rank}] " if config.dp_size > 1 else ""
        self.memory = memory
        self.scoring = scoring
        self.admission = admission
        self.hooks = hooks
        self.max_running_requests = config.max_running_requests
        self.stream_interval = config.stream_interval
        self.enable_mixed_chunk = config.enable_mixed_chunk and config.chunk_size is not None
        self.waiting_queue: List[Req] = []
        self.running_batch = ScheduleBatch([], ForwardMode.DECODE)
        self.chunked_req: Optional[Req] = None  # a request whose prompt is being prefilled in chunks
        self.admit_new = True  # False: queued requests wait (a weight update waits for the running ones)
        self.last_mode: Optional[ForwardMode] = None
        self.last_mixed = False  # the last step carried the running requests' decode rows
        self.num_mixed_steps = 0
        self.num_retracted_reqs = 0
        self.num_assigned_reqs = 0  # requests (and scoring groups) the load balancer gave this rank
        self.peak_running_reqs = 0  # most requests admitted at once (decoding + being chunk-prefilled)
        self.memory_errors = 0
        self.idle_checked = False
        self._last_forced_retract = 0
        self._decode_steps = 0
        self._decode_log_start = (time.time(), 0)  # (time, tokens generated) at the last decode log line
        self.num_generated_tokens = 0

    def sessions(self) -> list:
        """This rank's open sessions."""
        return self.hooks.sessions_on_rank(self.rank)

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
        """Queue the sequences of a score request (see scheduler/scoring.py)."""
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
        req = self.scoring.handle_prefill_request(msg)
        if req is not None:
            self.waiting_queue.append(req)

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
                    self.hooks.send([token_out(req, self.stream_interval)])
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
    def get_next_batch_to_run(self, num_steps: int = 1) -> Optional[ScheduleBatch]:
        """Prefill first, but one decode step of the running batch after every prefill step (between two
        chunks of a long prompt too), so a flood of prefill work -- long prompts, scoring requests --
        delays each running stream by at most one prefill step per token. A mixed prefill step (decode rows
        included) needs no decode step after it. `num_steps`: K of a decode step (a multi-step decode, chosen by
        the scheduler only when no rank has prefill work)."""
        after_prefill = self.last_mode == ForwardMode.EXTEND and not self.last_mixed
        if not (after_prefill and not self.running_batch.is_empty()):
            batch = None
            if self.enable_mixed_chunk and not self.running_batch.is_empty() and self.has_prefill_work():
                batch = self.get_new_batch_prefill(mixed=True)
            if batch is None:
                batch = self.get_new_batch_prefill()
            if batch is not None:
                return batch
        return self.get_decode_batch(num_steps)

    def has_prefill_work(self) -> bool:
        return bool(self.waiting_queue) and self.admit_new or self.chunked_req is not None

    def get_new_batch_prefill(self, mixed: bool = False) -> Optional[ScheduleBatch]:
        """The next extend batch, as the admission policy decides it (scheduler/admission.py); requests whose
        admission failed are failed here.

        mixed: the running requests' decode rows ride in the batch (each takes a token of the budget and a
        sequence of the bucket). Their KV slots are taken first (`prepare_for_decode`, evicting cached
        prefixes if needed); None when they cannot be had or nothing is admitted (the caller then asks again
        without mixing; slots already taken serve the next decode step, which takes only the missing ones)."""
        if not self.has_prefill_work():
            return None
        if mixed and not self.running_batch.prepare_for_decode(self.memory):
            return None
        running = self.running_batch.reqs
        waiting = self.waiting_queue if self.admit_new else []  # (a chunk-prefilled request goes on)
        decided = self.admission.admit(waiting, running, self.chunked_req, mixed)
        if decided is None:
            return None
        if decided.failed:
            dropped = set(id(r) for r, _ in decided.failed)
            self.waiting_queue = [r for r in self.waiting_queue if id(r) not in dropped]
            for req, exc in decided.failed:
                req.finished_reason = fail_reason(req, "scheduling the request", exc)
                self.finish_failed(req)
        if not decided.can_run:
            return None
        admitted = set(id(r) for r in decided.can_run)
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        self.chunked_req = decided.new_chunked_req
        batch = ScheduleBatch(decided.can_run, ForwardMode.EXTEND)
        in_flight = {id(r) for r in running + decided.can_run}
        self.peak_running_reqs = max(self.peak_running_reqs, len(in_flight))
        batch.prepare_for_extend(self.memory)
        if mixed:
            batch.mix_with_running(running)
            self.admission.on_decode_step()
        return batch

    def get_decode_batch(self, num_steps: int = 1) -> Optional[ScheduleBatch]:
        """The running batch, with a KV slot per request (`num_steps` K > 1: the slots of up to K positions), less
        the requests whose tokens in flight finish them by length (overlap); when pages run out, the step in flight
        is applied first (its finished requests free theirs), then requests are retracted."""
        if self.running_batch.is_empty():
            return None
        self.admission.on_decode_step()
        if self.config.test_retract and self._decode_steps - self._last_forced_retract >= TEST_RETRACT_INTERVAL:
            self._last_forced_retract = self._decode_steps
            self.retract(max(1, len(self.running_batch.reqs) // 2))
        while True:
            batch = self.running_batch
            ahead = [r for r in batch.reqs if not r.done_by_length_ahead()]
            if len(ahead) < len(batch.reqs):
                batch = batch.subset(ahead)
            if batch.is_empty():
                return None
            if batch.prepare_for_decode(self.memory, num_steps):  # (drafts need the step in flight's tokens)
                if self.speculator is None or self.hooks.step_in_flight():
                    return batch
                return self.speculator.verify_batch(batch, self.memory)
            if self.hooks.drain():
                continue
            self.retract(1)
            self.admission.on_retract(self.running_batch.reqs)

    def retract(self, n: int) -> None:
        """Release the KV of the latest `n` admitted running requests and requeue them (at the front,
        oldest first); they resume from prompt + generated tokens. The step in flight is applied first."""
        self.hooks.drain()
        victims = self.running_batch.reqs[-n:]
        del self.running_batch.reqs[-n:]
        for req in victims:
            self.memory.release(req, is_insert=False)
            req.reset_for_retract()
        self.waiting_queue[:0] = victims
        self.num_retracted_reqs += len(victims)
        logger.info("%sRetracted %d requests (KV %d tokens free); %d running", self.tag, len(victims),
                    self.memory.free_tokens(), len(self.running_batch.reqs))

    # ------------------------------------------------------------ after a step
    def apply_step(self, batch: ScheduleBatch, out) -> None:
        """Apply this rank's part of a step (`batch`: the step's own copy, `ScheduleBatch.launched`; `out`: its
        StepOutput, None when every request of the batch failed before running), then stream progress and release
        the finished."""
        batch = batch.drop_finished_rows()
        self.last_mode = batch.forward_mode
        self.last_mixed = batch.forward_mode == ForwardMode.EXTEND and batch.num_decode_rows > 0
        self.num_mixed_steps += self.last_mixed
        self.idle_checked = False
        generated = sum(len(r.output_ids) for r in batch.reqs)
        if out is not None:
            starts = [r.kv_committed_len for r in batch.reqs]  # positions this step computed start here
            check = lambda req: fault_injection.check("sample", (req.rid,))  # noqa: E731
            if batch.forward_mode == ForwardMode.TARGET_VERIFY:
                self.speculator.apply_verify(batch, out, self.memory, self.hooks.decode_tail,
                                             on_error=self.fail_after_step, check=check)
            else:
                process_batch_result(batch, out, self.memory, self.hooks.full_logprobs, self.hooks.decode_tail,
                                     on_error=self.fail_after_step, check=check)
            if batch.forward_mode == ForwardMode.EXTEND and any(r.score is not None for r in batch.reqs):
                self.collect_scores(batch, out, starts)
        generated = sum(len(r.output_ids) for r in batch.reqs) - generated
        if self.speculator is not None:
            self.speculator.after_step(batch)
        if batch.reqs:
            self.log_batch(batch, generated)
        self.stream_and_release(batch)
        self.memory.after_step(batch.reqs)
        if self.config.check_invariants:
            self.check_kv_invariants()

    def kv_holders(self) -> list:
        """Everything that holds a request slot and KV on this rank: running and chunk-prefilled requests, live
        scoring-cache handles, streaming sessions between turns."""
        holders = list(self.running_batch.reqs) + ([self.chunked_req] if self.chunked_req is not None else [])
        holders += [h.req for h in self.scoring.handles.values()]
        return holders + [s.kv.holder for s in self.sessions() if s.holds_kv()]

    def check_kv_invariants(self) -> None:
        """The exact page-ownership check (`KVMemory.check_invariants`); a violation counts as a memory error
        and is logged."""
        problems = self.memory.check_invariants(self.kv_holders())
        if problems:
            self.memory_errors += 1
            logger.error("%sKV invariants violated: %s", self.tag, "; ".join(problems))

    def collect_scores(self, batch: ScheduleBatch, out, starts: List[int]) -> None:
        """Label logprobs of the step's score positions; a request whose scores fail alone is failed."""
        offsets = [o + out.token_offset for o in batch.row_token_starts]
        before = [len(r.score.label_logprobs) if r.score is not None else 0 for r in batch.reqs]
        try:
            self.scoring.collect(batch.reqs, out.hidden, offsets, starts, self.hooks.label_logprobs)
            return
        except Exception as exc:
            if self.hooks.kv_cache_lost():
                raise
            first_exc = exc
        failed = 0
        for i, (req, n) in enumerate(zip(batch.reqs, before)):  # one at a time, to find the ones that fail
            if req.score is None:
                continue
            del req.score.label_logprobs[n:]  # undo what the failed attempt appended
            try:
                self.scoring.collect([req], out.hidden, [offsets[i]], [starts[i]], self.hooks.label_logprobs)
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
                self.memory.release(req)
            return
        self.hooks.send([token_out(req, self.stream_interval)])
        self.memory.release(req)

    def log_batch(self, batch: ScheduleBatch, generated: int) -> None:
        """One line per prefill batch, and one per DECODE_LOG_INTERVAL decode steps (with throughput; with
        speculative decoding, the tokens per step). `generated`: output tokens the step appended."""
        def used() -> float:  # (the accounting only for a line logged)
            acc = self.kv_accounting()
            return 100.0 * acc["kv_tokens_in_use"] / max(acc["kv_tokens_total"], 1)

        if batch.forward_mode == ForwardMode.EXTEND:
            n_dec = batch.num_decode_rows
            prefill = [r for r in batch.reqs if not batch.is_decode_row(r)]
            limit = ""
            budget = self.admission.step_budget
            if budget is not None and budget.last_limit is not None:
                limit = f", chunk limit {budget.last_limit} (step budget {budget.budget_ms:g} ms)"
            logger.info("%sPrefill batch: %d new seqs, %d new tokens, %d running%s, %d waiting, KV %.1f%% used%s",
                        self.tag, len(prefill), sum(r.extend_input_len for r in prefill),
                        len(self.running_batch.reqs), f" ({n_dec} decoding in this step)" if n_dec else "",
                        len(self.waiting_queue), used(), limit)
            self.num_generated_tokens += n_dec
            return
        self._decode_steps += 1
        self.num_generated_tokens += generated
        if self._decode_steps % DECODE_LOG_INTERVAL == 0:
            t0, n0 = self._decode_log_start
            now = time.time()
            spec = ""
            if self.speculator is not None:
                spec = f", {(self.num_generated_tokens - n0) / DECODE_LOG_INTERVAL:.2f} tokens per step"
            logger.info("%sDecode batch: %d running, %d waiting, KV %.1f%% used, gen throughput %.1f token/s%s",
                        self.tag, len(batch.reqs), len(self.waiting_queue), used(),
                        (self.num_generated_tokens - n0) / max(now - t0, 1e-9), spec)
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
        self.hooks.send(outs)
        for req in batch.reqs:
            if req.finished():
                if req is self.chunked_req:
                    self.chunked_req = None
                if req.score is not None and not self.scoring.on_finished(req):
                    continue  # a query prefill that became a scoring-cache handle keeps its KV
                self.memory.release(req)
        if batch.forward_mode == ForwardMode.EXTEND:
            if batch.num_decode_rows:  # (the mixed-in running requests)
                self.running_batch.filter_finished()
            done = [r for r in batch.reqs if not r.finished() and not r.is_chunked and not batch.is_decode_row(r)]
            self.running_batch.merge(ScheduleBatch(done, ForwardMode.DECODE))
        else:
            self.running_batch.filter_finished()

    # ------------------------------------------------------------ state
    def kv_accounting(self) -> dict:
        """KV tokens by owner (`KVMemory.accounting`: free, cached, held by streaming sessions, in use; per pool)."""
        return self.memory.accounting([s.kv for s in self.sessions() if s.kv is not None])

    def internal_state(self) -> dict:
        """This rank's queues, KV accounting and counters (the per-rank entries of /get_server_info)."""
        state = self.kv_accounting()
        state.update({
            "dp_rank": self.rank,
            "num_running_reqs": len(self.running_batch.reqs),
            "num_waiting_reqs": len(self.waiting_queue),
            "req_slots_free": self.memory.free_req_slots(),
            "memory_errors": self.memory_errors,
            "num_retracted_reqs": self.num_retracted_reqs,
            "num_assigned_reqs": self.num_assigned_reqs,
            "peak_running_reqs": self.peak_running_reqs,
            "num_mixed_steps": self.num_mixed_steps,
            "num_bucket_cuts": self.admission.num_bucket_cuts,
            "new_token_ratio": self.admission.new_token_ratio,
            "num_score_handles": len(self.scoring.handles),
            "num_expired_score_handles": self.scoring.num_expired_handles,
            "num_score_groups": len(self.scoring.groups),
            "num_sessions": len(self.sessions()),
            "num_streaming_sessions": sum(s.streaming for s in self.sessions()),
            "req_slots_session_held": sum(s.holds_kv() for s in self.sessions()),
            "sessions": [session_state(s, self.memory.page_size) for s in self.sessions()],
        })
        if self.speculator is not None:
            state.update(self.speculator.stats())
        return state

    def holds_work(self) -> bool:
        """Anything that legitimately holds KV or a request slot: queued, running, chunking, live handles."""
        return self.is_busy() or bool(self.scoring.handles)

    def on_idle(self) -> None:
        """When this rank runs nothing: the exact ownership check with only the streaming sessions holding KV,
        free + cached + session-held == total, no prefix locked but by sessions, every request slot free but
        theirs (`KVMemory.idle_problems`; checked once per idle period)."""
        if self.idle_checked or self.holds_work():
            return  # (live scoring-cache handles hold KV and request slots by design)
        self.idle_checked = True
        self._decode_log_start = (time.time(), self.num_generated_tokens)
        problems = self.memory.idle_problems([s.kv for s in self.sessions() if s.kv is not None])
        if problems:
            self.memory_errors += 1
            logger.error("%sKV accounting mismatch while idle: %s", self.tag, "; ".join(problems))
