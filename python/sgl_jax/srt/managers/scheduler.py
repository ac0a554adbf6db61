"""Scheduler process: owns the model runner and the memory pools, and runs continuous batching.

Loop: receive requests -> pick the next batch (a prefill of newly admitted requests if any fit,
otherwise one decode step of every running request) -> run it -> append tokens, finish and release
requests, send progress to the detokenizer. New requests join between decode steps; finished ones leave.

Fault isolation: an exception while scheduling, building, running or post-processing a batch that comes
from one request's data fails that request only (HTTP 500 with a one-line reason), frees its KV through
`release_kv_cache`, logs one line, and the loop goes on. A batch that fails is re-run without the requests
that fail on their own. Only a fault that is not one request's (or that lost the KV cache, e.g. a device
error after the cache was donated) ends the process, which then exits non-zero.

Chunked prefill: a prompt longer than --chunked-prefill-size is prefilled a chunk per step, with a decode
step of the running batch between chunks, so a long prompt does not stall every stream. Retract: when a
decode step cannot get KV pages even after evicting cached prefixes, the latest admitted requests are
retracted (KV released, requeued) and resume later from prompt + generated tokens.
"""

from __future__ import annotations

import logging
import os
import random
import sys
import time
import traceback
from typing import List, Optional

import zmq

from sgl_jax.srt.configs.model_config import ModelConfig, load_tokenizer
from sgl_jax.srt.constrained.grammar_backend import GrammarBackend
from sgl_jax.srt.managers import fault_injection
from sgl_jax.srt.managers.grammar_queue import GrammarQueue
from sgl_jax.srt.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    DecodeConfig,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    ScorePrefillReq,
    ScoreReleaseReq,
    TokenizedGenerateReqInput,
    TokenizedScoreReqInput,
    TokenOut,
)
from sgl_jax.srt.managers.schedule_batch import FinishReason, Req, ScheduleBatch, finish_abort
from sgl_jax.srt.managers.schedule_policy import (
    INIT_NEW_TOKEN_RATIO,
    MIN_NEW_TOKEN_RATIO,
    NEW_TOKEN_RATIO_DECAY,
    PrefillAdder,
    ratio_after_retract,
)
from sgl_jax.srt.managers.scheduler_output import extend_offsets, process_batch_result, token_out
from sgl_jax.srt.managers.scheduler_scoring import SchedulerScoring
from sgl_jax.srt.mem_cache import create_prefix_cache
from sgl_jax.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.common import release_kv_cache
from sgl_jax.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sgl_jax.srt.model_executor.buckets import ShapeBuckets, default_bs_paddings, default_token_paddings
from sgl_jax.srt.model_executor.forward_batch_info import ForwardMode
from sgl_jax.srt.model_executor.model_runner import ModelRunner, compute_max_total_tokens, setup_jax
from sgl_jax.srt.utils import configure_logging, prepare_child_process

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000
GRAMMAR_POLL_MS = 2  # while only grammars compile: how long the loop waits for input before checking them
DECODE_LOG_INTERVAL = 40  # decode steps between "Decode batch" log lines (SGLang's default)
# Test hook: raise inside the scheduler loop at this forward step (checks crash reporting end to end).
CRASH_AT_STEP_ENV = "SGL_JAX_TEST_CRASH_AT_STEP"
# Test hook: when "1", retract the latest half of the running requests every few decode steps
# (SGLang's SGLANG_TEST_RETRACT is accepted too).
TEST_RETRACT_ENV = "SGL_JAX_TEST_RETRACT"
TEST_RETRACT_INTERVAL = 5


def derive_limits(server_args, model_config, platform: str):
    """(max_running_requests, ShapeBuckets, max_prefill_tokens, chunk_size) from the flags and the model.

    Default token paddings reach the chunk size (or the context length without chunking).
    Raises:
        ValueError: --max-running-requests exceeds the largest --precompile-bs-paddings, or
            --chunked-prefill-size exceeds the largest --precompile-token-paddings.
    """
    bs = server_args.precompile_bs_paddings
    max_running = server_args.max_running_requests
    if max_running is None:
        max_running = bs[-1] if bs else (64 if platform == "cpu" else 256)
    if bs is None:
        bs = default_bs_paddings(max_running)
    elif max_running > bs[-1]:
        raise ValueError(f"--max-running-requests ({max_running}) exceeds the largest "
                         f"--precompile-bs-paddings ({bs[-1]})")
    chunk = server_args.chunked_prefill_size if server_args.chunked_prefill_size > 0 else None
    if chunk is not None:
        chunk = min(chunk, model_config.context_len)
    tokens = server_args.precompile_token_paddings or default_token_paddings(chunk or model_config.context_len)
    if chunk is not None and chunk > tokens[-1]:
        raise ValueError(f"--chunked-prefill-size ({chunk}) exceeds the largest --precompile-token-paddings "
                         f"({tokens[-1]})")
    buckets = ShapeBuckets(tuple(tokens), tuple(bs))
    return max_running, buckets, min(server_args.max_prefill_tokens, buckets.max_tokens), chunk


class Scheduler:
    """Continuous-batching scheduler. See the module docstring for the loop.

    Args:
        server_args: `ServerArgs`.
        port_args: `PortArgs` (ZMQ endpoints).
    """

    def __init__(self, server_args, port_args):
        self.server_args = server_args
        platform = setup_jax(server_args)
        self.model_config = ModelConfig.from_server_args(server_args, platform)
        mc = self.model_config
        self.tokenizer = load_tokenizer(server_args)
        self.max_running_requests, self.buckets, self.max_prefill_tokens, self.chunk_size = derive_limits(
            server_args, mc, platform)
        self.context_len = mc.context_len
        # the largest prompt: any within the context when chunking, else what one extend bucket holds
        self.max_req_input_len = self.context_len - 1 if self.chunk_size else min(self.context_len - 1,
                                                                                   self.buckets.max_tokens)
        logger.info("Model %s (%s, %s) on %s; context %d tokens", mc.model_path, mc.architecture, mc.dtype,
                    platform, self.context_len)
        self.model_runner = ModelRunner(
            server_args, mc, buckets=self.buckets, max_context_len=self.context_len,
            max_total_tokens_fn=lambda weight_bytes: compute_max_total_tokens(server_args, mc, weight_bytes,
                                                                              platform),
            num_request_slots=self.max_running_requests,
        )
        self.page_size = server_args.page_size
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests, self.context_len)
        self.allocator = PagedTokenToKVPoolAllocator(self.model_runner.max_total_tokens, self.page_size)
        self.tree_cache = create_prefix_cache(server_args, self.req_to_token_pool, self.allocator)
        self.waiting_queue: List[Req] = []
        self.running_batch = ScheduleBatch([], ForwardMode.DECODE)
        self.chunked_req: Optional[Req] = None  # a request whose prompt is being prefilled in chunks
        self.last_mode: Optional[ForwardMode] = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.num_retracted_reqs = 0
        self.test_retract = "1" in (os.environ.get(TEST_RETRACT_ENV), os.environ.get("SGLANG_TEST_RETRACT"))
        self._last_forced_retract = 0
        self.rng = random.Random(server_args.random_seed)
        self.memory_errors = 0
        self._idle_checked = False
        self._decode_steps = 0
        self._decode_log_start = (time.time(), 0)  # (time, tokens generated) at the last decode log line
        self.num_generated_tokens = 0

        ctx = zmq.Context(2)
        self.recv_from_tokenizer = ctx.socket(zmq.PULL)
        self.recv_from_tokenizer.bind(port_args.scheduler_input_ipc_name)
        self.send_to_detokenizer = ctx.socket(zmq.PUSH)
        self.send_to_detokenizer.connect(port_args.detokenizer_ipc_name)
        self.send_to_tokenizer = ctx.socket(zmq.PUSH)
        self.send_to_tokenizer.connect(port_args.tokenizer_ipc_name)
        self.scoring = SchedulerScoring(self.tree_cache, self.req_to_token_pool, self.page_size,
                                        server_args.multi_item_prefill_extend_cache_timeout,
                                        self.send_to_tokenizer.send_pyobj, mc.eos_token_ids)

        self.grammar_queue = GrammarQueue(None if server_args.grammar_backend == "none"
                                          else GrammarBackend(self.tokenizer, mc.vocab_size))
        if not server_args.disable_precompile:
            self.model_runner.warmup()
        if self.grammar_queue.backend is not None:
            self.grammar_queue.backend.warmup()

    def init_info(self) -> dict:
        """Facts the TokenizerManager needs (validation limits, pool sizes)."""
        return {
            "max_total_tokens": self.allocator.size,
            "max_running_requests": self.max_running_requests,
            "max_prefill_tokens": self.max_prefill_tokens,
            "max_req_input_len": self.max_req_input_len,
            "context_len": self.context_len,
            "chunked_prefill_size": self.chunk_size or -1,
            "radix_cache": type(self.tree_cache).__name__ == "RadixCache",
            "vocab_size": self.model_config.vocab_size,
            "architecture": self.model_config.architecture,
            "token_paddings": list(self.buckets.token_paddings),
            "bs_paddings": list(self.buckets.bs_paddings),
        }

    # ------------------------------------------------------------ loop
    def event_loop(self) -> None:
        crash_at = int(os.environ.get(CRASH_AT_STEP_ENV, "0"))
        step = 0
        while True:
            self.process_input_requests(self.recv_requests())
            if self.grammar_queue:
                self.admit_grammar_ready()
            if self.scoring.handles:
                self.scoring.expire_handles()
            batch = self.get_next_batch_to_run()
            if batch is None:
                self.on_idle()
                continue
            step += 1
            if step == crash_at:
                raise RuntimeError(f"injected crash at step {step} ({CRASH_AT_STEP_ENV})")
            self._idle_checked = False
            self.last_mode = batch.forward_mode
            self.run_batch(batch)

    def run_batch(self, batch: ScheduleBatch) -> None:
        """Run one step and apply its results; requests that fail on their own are failed and dropped."""
        out = self.forward_isolating_faults(batch)
        if out is not None:
            starts = [r.kv_committed_len for r in batch.reqs]  # positions this step computed start here
            process_batch_result(batch, out, self.tree_cache, self.model_runner.full_logprobs, self.decode_tail,
                                 on_error=self._fail_after_step,
                                 check=lambda req: fault_injection.check("sample", (req.rid,)))
            if batch.forward_mode == ForwardMode.EXTEND and any(r.score is not None for r in batch.reqs):
                self.collect_scores(batch, out, starts)
        if batch.reqs:
            self.log_batch(batch)
        self.stream_and_release(batch)

    # ------------------------------------------------------------ fault isolation
    def _step(self, batch: ScheduleBatch):
        fault_injection.check("forward", [r.rid for r in batch.reqs])
        for req in batch.reqs:  # penalty history of a request new to its slot (admission, after a retract)
            if req.penalty_slot != req.req_pool_idx and req.sampling_params.uses_penalties():
                self.model_runner.init_penalty_row(req.req_pool_idx, req.fill_ids, len(req.origin_input_ids),
                                                   req.sampling_params.logit_bias)
                req.penalty_slot = req.req_pool_idx
        return self.model_runner.forward(
            batch.build_model_worker_batch(self.buckets, self.req_to_token_pool, self.page_size))

    def forward_isolating_faults(self, batch: ScheduleBatch):
        """`batch`'s step output; when the step fails, the requests that fail alone are failed and removed
        and the rest re-run (None if none is left).

        Raises:
            The step's exception when no single request explains it, or when the KV cache was lost.
        """
        while True:
            try:
                return self._step(batch)
            except Exception as exc:
                if self.model_runner.kv_cache_lost():
                    raise
                if len(batch.reqs) == 1:
                    culprits = list(batch.reqs)
                else:
                    culprits = [r for r in batch.reqs if self._fails_alone(r, batch.forward_mode)]
                if not culprits:
                    raise
                for req in culprits:
                    self._fail_in_batch(batch, req, exc)
                if batch.is_empty():
                    return None

    def _fails_alone(self, req: Req, mode: ForwardMode) -> bool:
        """Run `req`'s part of the step alone (it rewrites only its own KV slots, with the same values)."""
        try:
            self._step(ScheduleBatch([req], mode))
            return False
        except Exception:
            if self.model_runner.kv_cache_lost():
                raise
            return True

    @staticmethod
    def _fail_reason(req: Req, what: str, exc: BaseException) -> FinishReason:
        """A 500 abort whose message is one line: what failed and why (also logged, once)."""
        text = " ".join(str(exc).split())[:300]
        message = f"internal error while {what}: {type(exc).__name__}: {text}"
        logger.error("Request %s failed, aborted (the others go on): %s", req.rid, message)
        return finish_abort(message, 500)

    def _fail_in_batch(self, batch: ScheduleBatch, req: Req, exc: BaseException) -> None:
        """Fail a request of a batch that has not run: drop it, answer 500, free its KV."""
        batch.reqs.remove(req)
        if req is self.chunked_req:
            self.chunked_req = None
        req.finished_reason = self._fail_reason(req, "running the request's step", exc)
        self._finish_failed(req)

    def _fail_after_step(self, req: Req, exc: BaseException, what: str = "processing the request's sampled token"
                         ) -> None:
        """Fail a request whose step ran: it finishes now with a 500 (stream_and_release frees its KV)."""
        req.finished_reason = self._fail_reason(req, what, exc)

    def _finish_failed(self, req: Req) -> None:
        """Answer and release a failed request that is in no batch (nor the waiting queue)."""
        if req.score is not None:
            if self.scoring.on_finished(req):
                release_kv_cache(req, self.tree_cache)
            return
        self._send([token_out(req, self.server_args.stream_interval)])
        release_kv_cache(req, self.tree_cache)

    def collect_scores(self, batch: ScheduleBatch, out, starts: List[int]) -> None:
        """Label logprobs of the step's score positions; a request whose scores fail alone is failed."""
        offsets = extend_offsets(batch)
        before = [len(r.score.label_logprobs) if r.score is not None else 0 for r in batch.reqs]
        try:
            self.scoring.collect(batch.reqs, out.hidden, offsets, starts, self.model_runner.label_logprobs)
            return
        except Exception as exc:
            if self.model_runner.kv_cache_lost():
                raise
            first_exc = exc
        failed = 0
        for i, (req, n) in enumerate(zip(batch.reqs, before)):  # one at a time, to find the ones that fail
            if req.score is None:
                continue
            del req.score.label_logprobs[n:]  # undo what the failed attempt appended
            try:
                self.scoring.collect([req], out.hidden, [offsets[i]], [starts[i]], self.model_runner.label_logprobs)
            except Exception as exc:
                self._fail_after_step(req, exc, "computing the request's scores")
                failed += 1
        if failed == 0:
            raise first_exc

    def recv_requests(self) -> list:
        busy = self.waiting_queue or not self.running_batch.is_empty() or self.chunked_req is not None
        if not busy and not self.recv_from_tokenizer.poll(GRAMMAR_POLL_MS if self.grammar_queue else IDLE_POLL_MS):
            return []
        msgs = []
        while True:
            try:
                msgs.append(self.recv_from_tokenizer.recv_pyobj(zmq.NOBLOCK))
            except zmq.Again:
                return msgs

    def process_input_requests(self, msgs: list) -> None:
        for msg in msgs:
            try:
                if isinstance(msg, TokenizedGenerateReqInput):
                    self.handle_generate_request(msg)
                elif isinstance(msg, TokenizedScoreReqInput):
                    self.handle_score_request(msg)
                elif isinstance(msg, ScorePrefillReq):
                    self.handle_score_prefill(msg)
                elif isinstance(msg, ScoreReleaseReq):
                    self.scoring.release_request(msg)
                elif isinstance(msg, AbortReq):
                    self.handle_abort(msg)
                elif isinstance(msg, FlushCacheReq):
                    self.send_to_tokenizer.send_pyobj(self.flush_cache())
                elif isinstance(msg, GetInternalStateReq):
                    self.send_to_tokenizer.send_pyobj(GetInternalStateReqOutput(self.internal_state()))
                else:
                    logger.error("Unknown message type %s", type(msg).__name__)
            except Exception:  # a bad request must not take the scheduler down
                logger.error("Failed to handle %s:\n%s", type(msg).__name__, traceback.format_exc())
                rid = getattr(msg, "rid", None)
                if rid is not None:
                    self._send_abort(rid, "internal error while handling the request", 500)

    # ------------------------------------------------------------ requests
    def handle_generate_request(self, msg: TokenizedGenerateReqInput) -> None:
        """Queue a request (the TokenizerManager has validated it; limits are re-checked here)."""
        n = len(msg.input_ids)
        if n == 0 or n > self.max_req_input_len:
            self._send_abort(msg.rid, f"input of {n} tokens is outside [1, {self.max_req_input_len}]", 400)
            return
        if n + 1 > self.allocator.size:
            self._send_abort(msg.rid, f"input of {n} tokens does not fit the KV cache "
                                      f"({self.allocator.size} tokens)", 413)
            return
        sp = msg.sampling_params
        # SGLang's rule: generation stops at the context length (and here also at the KV pool size)
        room = min(self.context_len, self.allocator.size) - n
        sp.max_new_tokens = room if sp.max_new_tokens is None else min(sp.max_new_tokens, room)
        seed = sp.sampling_seed if sp.sampling_seed is not None else self.rng.randrange(2**31)
        req = Req(
            msg.rid, msg.input_ids, sp, eos_token_ids=self.model_config.eos_token_ids, seed=seed,
            return_logprob=msg.return_logprob, logprob_start_len=msg.logprob_start_len,
            top_logprobs_num=msg.top_logprobs_num, token_ids_logprob=msg.token_ids_logprob, stream=msg.stream,
        )
        try:
            if self.grammar_queue.needs_grammar(req):
                return
        except ValueError as e:
            self._send_abort(msg.rid, str(e), 400)
            return
        self.waiting_queue.append(req)

    def admit_grammar_ready(self) -> None:
        """Move requests whose grammar compiled to the waiting queue; answer 400 for those that failed."""
        ready, failed = self.grammar_queue.pop_ready()
        self.waiting_queue.extend(ready)
        for req, message in failed:
            self._send_abort(req.rid, message, 400)

    def handle_score_request(self, msg: TokenizedScoreReqInput) -> None:
        """Queue the sequences of a score request (see scheduler_scoring)."""
        self.waiting_queue.extend(self.scoring.handle_score_request(msg, self.max_req_input_len,
                                                                    self.allocator.size))

    def handle_score_prefill(self, msg: ScorePrefillReq) -> None:
        n = len(msg.input_ids)
        if n == 0 or n > self.max_req_input_len or n + 1 > self.allocator.size:
            self.scoring.fail(msg.rid, f"query of {n} tokens is outside [1, {self.max_req_input_len}] or does "
                                        f"not fit the KV cache", 400)
            return
        self.waiting_queue.append(self.scoring.handle_prefill_request(msg))

    def handle_abort(self, msg: AbortReq) -> None:
        if msg.rid in self.scoring.handles:  # a live scoring-cache handle: release it
            self.scoring.release_request(ScoreReleaseReq(msg.rid))
            return
        group_reqs = self.scoring.abort_group(msg.rid, msg.message)
        if group_reqs:
            self._drop_waiting(group_reqs)
            return
        req = self.grammar_queue.remove(msg.rid)
        if req is not None:
            req.finished_reason = finish_abort(msg.message)
            self._send([token_out(req, self.server_args.stream_interval)])
            return
        for i, req in enumerate(self.waiting_queue):
            if req.rid == msg.rid:
                del self.waiting_queue[i]
                req.finished_reason = finish_abort(msg.message)
                if req.score is not None:
                    self.scoring.on_finished(req)
                else:
                    self._send([token_out(req, self.server_args.stream_interval)])
                return
        running = self.running_batch.reqs + ([self.chunked_req] if self.chunked_req is not None else [])
        for req in running:
            if req.rid == msg.rid:
                req.to_abort = finish_abort(msg.message)
                return

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

    def _send_abort(self, rid: str, message: str, status_code: Optional[int] = None) -> None:
        out = TokenOut(rid=rid, new_token_ids=[], finished_reason=finish_abort(message, status_code).to_json(),
                       prompt_tokens=0, completion_tokens=0, cached_tokens=0, decode=DecodeConfig())
        self._send([out])

    def _send(self, outs) -> None:
        outs = [o for o in outs if o is not None]
        if outs:
            self.send_to_detokenizer.send_pyobj(BatchTokenIDOut(outs))

    # ------------------------------------------------------------ batching
    def get_next_batch_to_run(self) -> Optional[ScheduleBatch]:
        """Prefill first, but one decode step of the running batch after every prefill step (between two
        chunks of a long prompt too), so a flood of prefill work -- long prompts, scoring requests --
        delays each running stream by at most one prefill step per token."""
        after_prefill = self.last_mode == ForwardMode.EXTEND
        if not (after_prefill and not self.running_batch.is_empty()):
            batch = self.get_new_batch_prefill()
            if batch is not None:
                return batch
        return self.get_decode_batch()

    def get_new_batch_prefill(self) -> Optional[ScheduleBatch]:
        """The next extend batch: the chunked request first, then waiting requests in admission order
        (items of live scoring-cache handles first, then first come first served; see
        SchedulerScoring.admission_order), stopping at the first that does not fit. A new handle's query
        is skipped, not waited for, while the handle reserve is used up."""
        if not self.waiting_queue and self.chunked_req is None:
            return None
        running = self.running_batch.reqs
        in_flight = len(running) + (1 if self.chunked_req is not None else 0)
        slots = min(self.req_to_token_pool.available_size(), self.max_running_requests - in_flight)
        adder = PrefillAdder(self.buckets, self.allocator, self.tree_cache, running,
                             max_prefill_tokens=self.max_prefill_tokens, chunk_size=self.chunk_size,
                             free_req_slots=slots, new_token_ratio=self.new_token_ratio)
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
                req.finished_reason = self._fail_reason(req, "scheduling the request", exc)
                self._finish_failed(req)
        if not adder.can_run:
            return None
        admitted = set(id(r) for r in adder.can_run)
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        self.chunked_req = adder.new_chunked_req
        batch = ScheduleBatch(adder.can_run, ForwardMode.EXTEND)
        batch.prepare_for_extend(self.req_to_token_pool, self.allocator, self.tree_cache)
        return batch

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
        logger.info("Retracted %d requests (KV %d tokens free); %d running", len(victims),
                    self.allocator.available_size(), len(self.running_batch.reqs))

    def log_batch(self, batch: ScheduleBatch) -> None:
        """One line per prefill batch, and one per DECODE_LOG_INTERVAL decode steps (with throughput)."""
        acc = self.kv_accounting()
        used = 100.0 * acc["kv_tokens_in_use"] / max(acc["kv_tokens_total"], 1)
        if batch.forward_mode == ForwardMode.EXTEND:
            logger.info("Prefill batch: %d new seqs, %d new tokens, %d running, %d waiting, KV %.1f%% used",
                        len(batch.reqs), sum(r.extend_input_len for r in batch.reqs), len(self.running_batch.reqs),
                        len(self.waiting_queue), used)
            return
        self._decode_steps += 1
        self.num_generated_tokens += len(batch.reqs)
        if self._decode_steps % DECODE_LOG_INTERVAL == 0:
            t0, n0 = self._decode_log_start
            now = time.time()
            logger.info("Decode batch: %d running, %d waiting, KV %.1f%% used, gen throughput %.1f token/s",
                        len(batch.reqs), len(self.waiting_queue), used,
                        (self.num_generated_tokens - n0) / max(now - t0, 1e-9))
            self._decode_log_start = (now, self.num_generated_tokens)

    def decode_tail(self, req: Req, ids: List[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=req.sampling_params.skip_special_tokens)

    def stream_and_release(self, batch: ScheduleBatch) -> None:
        """Send progress, release finished requests, and move fully prefilled ones into the running batch.

        A request between prefill chunks stays out of the running batch (it keeps its pool row and KV).
        """
        outs = []
        for req in batch.reqs:
            if req.score is None:
                try:
                    outs.append(token_out(req, self.server_args.stream_interval))
                except Exception as exc:  # one request's output failed: fail that request only
                    self._fail_after_step(req, exc, "sending the request's output")
                    outs.append(token_out(req, self.server_args.stream_interval, with_logprobs=False))
        self._send(outs)
        for req in batch.reqs:
            if req.finished():
                if req is self.chunked_req:
                    self.chunked_req = None
                if req.score is not None and not self.scoring.on_finished(req):
                    continue  # a query prefill that became a scoring-cache handle keeps its KV
                release_kv_cache(req, self.tree_cache)
        if batch.forward_mode == ForwardMode.EXTEND:
            done = [r for r in batch.reqs if not r.finished() and not r.is_chunked]
            self.running_batch.merge(ScheduleBatch(done, ForwardMode.DECODE))
        else:
            self.running_batch.filter_finished()

    # ------------------------------------------------------------ state
    def kv_accounting(self) -> dict:
        total = self.allocator.size
        free = self.allocator.available_size()
        cached = self.tree_cache.evictable_size()
        protected = self.tree_cache.protected_size()
        return {
            "kv_tokens_total": total,
            "kv_tokens_free": free,
            "kv_tokens_cached": cached + protected,
            "kv_tokens_in_use": total - free - cached - protected,
        }

    def internal_state(self) -> dict:
        state = self.kv_accounting()
        state.update({
            "num_running_reqs": len(self.running_batch.reqs),
            "num_waiting_reqs": len(self.waiting_queue),
            "req_slots_free": self.req_to_token_pool.available_size(),
            "memory_errors": self.memory_errors,
            "kv_tokens_evictable": self.tree_cache.evictable_size(),
            "kv_tokens_protected": self.tree_cache.protected_size(),
            "num_retracted_reqs": self.num_retracted_reqs,
            "new_token_ratio": self.new_token_ratio,
            "num_compiles_after_warmup": self.model_runner.num_compiles_after_warmup,
            "page_size": self.page_size,
            "num_score_handles": len(self.scoring.handles),
            "num_expired_score_handles": self.scoring.num_expired_handles,
            "num_score_groups": len(self.scoring.groups),
            **self.init_info(),
        })
        return state

    def on_idle(self) -> None:
        """When nothing runs: free + evictable + protected == total, no prefix locked, every slot free."""
        if self._idle_checked or self.waiting_queue or self.chunked_req is not None \
                or not self.running_batch.is_empty() or self.scoring.handles or self.grammar_queue:
            return  # (live scoring-cache handles hold KV and request slots by design)
        self._idle_checked = True
        self._decode_log_start = (time.time(), self.num_generated_tokens)
        acc = self.kv_accounting()
        free, evictable = self.allocator.available_size(), self.tree_cache.evictable_size()
        protected = self.tree_cache.protected_size()
        slots_ok = self.req_to_token_pool.available_size() == self.req_to_token_pool.size
        if free + evictable + protected != acc["kv_tokens_total"] or protected != 0 or not slots_ok:
            self.memory_errors += 1
            logger.error("KV accounting mismatch while idle: free %d + evictable %d + protected %d != total %d "
                         "(or a prefix is still locked), free request slots %d of %d", free, evictable,
                         protected, acc["kv_tokens_total"], self.req_to_token_pool.available_size(),
                         self.req_to_token_pool.size)

    def flush_cache(self) -> FlushCacheReqOutput:
        """Empty the prefix cache; refused while any request is running, chunking or waiting."""
        if self.waiting_queue or not self.running_batch.is_empty() or self.chunked_req is not None \
                or self.scoring.handles or self.grammar_queue:
            return FlushCacheReqOutput(False, "Cannot flush the cache while requests are running or waiting "
                                              "or scoring-cache handles are held")
        self.tree_cache.reset()
        return FlushCacheReqOutput(True, "Cache flushed.")


def run_scheduler_process(server_args, port_args, pipe_writer, parent_pid: int) -> None:
    """Entry point of the scheduler process: build, report readiness over `pipe_writer`, serve forever."""
    configure_logging(server_args.log_level, "Scheduler")
    prepare_child_process(parent_pid)
    try:
        scheduler = Scheduler(server_args, port_args)
        pipe_writer.send({"status": "ready", **scheduler.init_info()})
        scheduler.event_loop()
    except Exception:
        tb = traceback.format_exc()
        logger.error("Scheduler process failed:\n%s", tb)
        try:
            pipe_writer.send({"status": "error", "error": tb})
        except Exception:
            pass
        sys.exit(1)
