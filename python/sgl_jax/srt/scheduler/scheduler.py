"""Scheduler process: owns the model runner and the data-parallel ranks' memory pools, and runs continuous
batching.

Loop: receive requests (each new one is given a DP rank by --load-balance-method) -> ask every rank for its
next batch (a prefill of newly admitted requests if any fit, otherwise one decode step of its running
requests; scheduler/rank.py) -> run all ranks' batches as one step of one compiled program (idle
ranks run padding) -> each rank appends tokens, finishes and releases requests, and sends progress to the
detokenizer. New requests join between decode steps; finished ones leave. ``--dp-size 1``: one rank.

Fault isolation: an exception while scheduling, building, running or post-processing a batch that comes
from one request's data fails that request only (HTTP 500 with a one-line reason), frees its KV through
`release_kv_cache`, logs one line, and the loop goes on. A batch that fails is re-run without the requests
that fail on their own. Only a fault that is not one request's (or that lost the KV cache, e.g. a device
error after the cache was donated) ends the process, which then exits non-zero.

Chunked prefill: a prompt longer than --chunked-prefill-size is prefilled a chunk per step, with a decode
step of the running batch between chunks (or, with --enable-mixed-chunk, the running requests' decode rows
inside each chunk's step), so a long prompt does not stall every stream; --max-prefill-step-ms cuts the
chunks while requests decode (scheduler/step_budget.py, fitted to the wall time of every step run here).
Retract: when a decode step cannot get KV pages even after evicting cached prefixes, the latest admitted
requests are retracted (KV released, requeued) and resume later from prompt + generated tokens.

Overlap (the default; --disable-overlap-schedule turns it off): a decode step is launched before the previous
decode step's result is applied, so the host's work between steps runs while the device computes; outputs are
the same either way (scheduler/overlap.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
import traceback
from typing import List, Optional

import zmq

from sgl_jax.srt.configs.model_config import ModelConfig, load_tokenizer
from sgl_jax.srt.constrained.grammar_backend import GrammarBackend
from sgl_jax.srt.errors import RequestError
from sgl_jax.srt.fault_injection import (CHECK_KV_INVARIANTS_ENV, CRASH_AT_STEP_ENV, HANG_AT_STEP_ENV, STEP_DELAY_ENV,
                                         TEST_RETRACT_ENV, TRANSFER_GUARD_ENV)
from sgl_jax.srt.startup_phases import StartupPhases
from sgl_jax.srt.forward_batch import ForwardMode
from sgl_jax.srt.io_struct import (
    AbortReq,
    CONTROL_REPLIES,
    BatchTokenIDOut,
    CloseSessionReqInput,
    CloseSessionReqOutput,
    DecodeConfig,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    LoadLoRAAdapterReqInput,
    OpenSessionReqInput,
    OpenSessionReqOutput,
    SchedulerInfo,
    ScorePrefillReq,
    ScoreReleaseReq,
    TokenizedGenerateReqInput,
    TokenizedScoreReqInput,
    TokenOut,
    UnloadLoRAAdapterReqInput,
)
from sgl_jax.srt.mem_cache.kv_memory import KVMemory, kv_spec_for
from sgl_jax.srt.mem_cache.req_state import reserve_bytes
from sgl_jax.srt.model_executor.buckets import derive_limits
from sgl_jax.srt.model_executor.cpu_threads import yield_to_launcher
from sgl_jax.srt.model_executor.memory_budget import compute_max_total_tokens
from sgl_jax.srt.model_executor.host_copy import transfer_guard
from sgl_jax.srt.model_executor.model_runner import ModelRunner, setup_jax
from sgl_jax.srt.model_executor.program_cache import pool_tokens_before, remember_pool_tokens
from sgl_jax.srt.model_executor.step_output import LaunchedForward
from sgl_jax.srt.preflight import KVLimits, check_fits
from sgl_jax.srt.sampling.sampling_params import clip_max_new_tokens
from sgl_jax.srt.scheduler.lora_control import SchedulerLora, lora_uid, update_lora
from sgl_jax.srt.scheduler.admission import AdmissionPolicy
from sgl_jax.srt.scheduler.engine_control import EngineControl
from sgl_jax.srt.scheduler.grammar_queue import GrammarQueue
from sgl_jax.srt.scheduler.host_tier import new_host_tier
from sgl_jax.srt.scheduler.load_balance import choose_rank
from sgl_jax.srt.scheduler.node_link import DiscardSocket, NodeLink, SchedulerTick
from sgl_jax.srt.scheduler.output import token_out
from sgl_jax.srt.scheduler.overlap import LaunchedStep, may_choose_ahead
from sgl_jax.srt.scheduler.rank import RankConfig, RankScheduler
from sgl_jax.srt.scheduler.schedule_batch import Req, ScheduleBatch, finish_abort
from sgl_jax.srt.scheduler.scoring import SchedulerScoring
from sgl_jax.srt.scheduler.server_state import merge_rank_states
from sgl_jax.srt.scheduler.sessions import Session, SessionController, SessionError, check_turn
from sgl_jax.srt.scheduler.speculative.draft_model import draft_reserve
from sgl_jax.srt.scheduler.speculative.drafters import draft_model_config, new_drafter
from sgl_jax.srt.scheduler.speculative.spec_costs import batch_rule_on, measure_step_costs
from sgl_jax.srt.scheduler.speculative.speculation import SpecCounts, move_accepted_kv, new_speculators, unify_step
from sgl_jax.srt.scheduler.step_budget import PrefillStepBudget, StepTimeModel, step_cost_features
from sgl_jax.srt.scheduler.step_launch import StepLauncher
from sgl_jax.srt.scheduler.step_stats import StepStats
from sgl_jax.srt.scheduler.watchdog import StepWatchdog

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000
GRAMMAR_POLL_MS = 2  # while only grammars compile: how long the loop waits for input before checking them


class Scheduler:
    """Continuous-batching scheduler over ``--dp-size`` data-parallel attention ranks (see the module
    docstring for the loop and scheduler/rank.py for one rank's policy).

    Args:
        server_args: `ServerArgs`.
        port_args: `PortArgs` (ZMQ endpoints).
        spawned_at: when the parent started this process (``time.time()``); the start-up phases
            (`startup_phases.StartupPhases`, sent in `info`) count from it. None: from this call.
    """

    def __init__(self, server_args, port_args, spawned_at: Optional[float] = None):
        self.server_args = server_args
        self.startup = phases = StartupPhases(spawned_at or time.time())
        if spawned_at is not None:
            phases.since_start("process start and imports")
        self.is_leader = server_args.node_rank == 0  # node 0 (or the only node) talks to the other processes
        self.link = (NodeLink(server_args.nnodes, server_args.node_rank, server_args.dist_init_addr)
                     if server_args.nnodes > 1 else None)
        with phases.phase("JAX set-up"):
            platform = setup_jax(server_args)
        self._load_model(platform)
        self.page_size = server_args.page_size
        self.dp_size = server_args.dp_size
        self.load_balance_method = server_args.load_balance_method
        self.rng = random.Random(server_args.random_seed)
        self.tick_now = time.time()  # the clock of the loop iteration (node 0's on every node)
        self._open_sockets(port_args)
        self.step_time_model = StepTimeModel()
        budget_ms = server_args.max_prefill_step_ms
        self.step_budget = (PrefillStepBudget(budget_ms, self.buckets, server_args.page_size, self.step_time_model)
                            if budget_ms > 0 and self.chunk_size else None)
        self._init_ranks()
        self.grammar_queue = GrammarQueue(None if server_args.grammar_backend == "none"
                                          else GrammarBackend(self.tokenizer, self.model_config.vocab_size))
        self.launcher = StepLauncher(self.model_runner, self.ranks, self.buckets, self.max_running_requests,
                                     self.draft_model)
        self._init_loop_state()
        phases.since_start("scheduler set-up")
        self._prepare_to_serve()
        phases.since_start("other")
        self.startup_report = phases.to_json()  # (at ready: `info` sends it)

    def _load_model(self, platform: str) -> None:
        """The model config and tokenizer, the serving limits and buckets (`derive_limits`), the model runner (its
        KV pool sized from what the weights leave), the draft model and the LoRA adapters' manager."""
        server_args, phases = self.server_args, self.startup
        with phases.phase("model config and tokenizer"):
            self.model_config = ModelConfig.from_server_args(server_args, platform)
            self.tokenizer = load_tokenizer(server_args)
        mc = self.model_config
        self.max_running_requests, self.buckets, self.max_prefill_tokens, self.chunk_size = derive_limits(
            server_args, mc, platform)
        if mc.is_encoder and self.chunk_size:
            logger.info("%s is an encoder: no chunked prefill (each sequence is computed whole in one step)",
                        mc.architecture)
            self.chunk_size = None
        self.context_len = mc.context_len
        # the largest prompt: any within the context when chunking, else what one extend bucket holds
        self.max_req_input_len = self.context_len - 1 if self.chunk_size else min(self.context_len - 1,
                                                                                   self.buckets.max_tokens)
        logger.info("Model %s (%s, %s) on %s; context %d tokens", mc.model_path, mc.architecture, mc.dtype,
                    platform, self.context_len)
        draft_mc, aux_layers = draft_model_config(server_args, mc, self.context_len, platform)
        reserve = (0, 0) if draft_mc is None else draft_reserve(server_args, draft_mc)
        # per-request state beyond KV (slots, rows), set aside before the KV pool is sized
        reserve = (reserve[0] + reserve_bytes(mc.req_states, mc.req_rows, self.max_running_requests), reserve[1])
        self.model_runner = ModelRunner(
            server_args, mc, buckets=self.buckets, max_context_len=self.context_len,
            kv_spec_fn=lambda weight_bytes: kv_spec_for(server_args, mc, remember_pool_tokens(compute_max_total_tokens(
                server_args, mc, weight_bytes, platform, reserve, previous=pool_tokens_before()))),
            num_request_slots=self.max_running_requests, aux_layers=aux_layers, phases=phases,
        )
        with phases.phase("draft model") if draft_mc is not None else contextlib.nullcontext():
            self.draft_model = (None if draft_mc is None else
                                new_drafter(server_args, self.model_runner, self.buckets, draft_mc))
        self.lora = None if mc.lora is None else SchedulerLora(
            mc.lora, server_args.max_loaded_loras, self.model_runner.lora_writer, self.live_reqs, self.running_reqs,
            server_args.download_dir, lambda uid: sum(rank.memory.drop_namespace(uid) for rank in self.ranks))

    def _init_ranks(self) -> None:
        """The data-parallel ranks (`_new_rank`: each with its speculator), the KV limits, the streaming sessions."""
        server_args, mc = self.server_args, self.model_config
        self.speculating = server_args.speculative_algorithm is not None
        self.num_spec_unified_steps = 0  # steps whose DP ranks' batches changed mode to share one (unify_step)
        speculators = new_speculators(server_args, self.context_len, self.dp_size,
                                      sliding_window=mc.sliding_window is not None)
        self.ranks: List[RankScheduler] = [self._new_rank(r, speculators[r]) for r in range(self.dp_size)]
        memory = self.ranks[0].memory
        if self.lora is not None and not memory.keeps_namespaces:
            raise ValueError(f"--enable-lora: the {memory.cache_kind} prefix cache keeps no adapter namespaces "
                             "(pass --disable-hybrid-swa-memory)")
        self.kv_size = self.ranks[0].memory.size  # tokens of KV per rank
        self.kv_limits = KVLimits(self.context_len, self.max_req_input_len, self.kv_size, self.page_size)
        if self.dp_size > 1:
            logger.info("%d data-parallel attention ranks (--load-balance-method %s), %d KV tokens and %d request "
                        "slots each", self.dp_size, self.load_balance_method, self.kv_size,
                        self.max_running_requests)
        self.sessions = SessionController(self.dp_size, max(0, self.max_running_requests - 1),
                                          [rank.memory.new_session_kv for rank in self.ranks],
                                          server_args.enable_streaming_session)
        # a leading BOS of a session turn's new ids is dropped only when the tokenizer adds one itself
        bos = getattr(self.tokenizer, "bos_token_id", None)
        self.session_bos_id = bos if bos is not None and self.tokenizer.encode("a")[:1] == [bos] else None

    def _init_loop_state(self) -> None:
        """The event loop's state: overlap (off with --disable-overlap-schedule or a draft model's speculation:
        overlap.py), the step in flight, the step statistics."""
        server_args = self.server_args
        self.overlap = not server_args.disable_overlap_schedule and self.draft_model is None
        self.inflight: Optional[LaunchedStep] = None  # the launched step whose result is not applied yet
        self.last_applied_at = 0.0  # time.perf_counter() when the last step's result was applied
        self.num_overlapped_steps = 0  # steps launched while the step before was still running
        self.step_stats = StepStats()  # host / device-wait time per step, step rate (Prometheus histograms)
        why = "--disable-overlap-schedule" if server_args.disable_overlap_schedule else \
            f"--speculative-algorithm {server_args.speculative_algorithm}: its draft model runs every step"
        logger.info("Overlap scheduler: %s", "on" if self.overlap else f"off ({why})")
        if self.speculating:
            logger.info("Speculative decoding: %s, up to %d draft-tree slots per request",
                        server_args.speculative_algorithm, server_args.speculative_num_draft_tokens)

    def _prepare_to_serve(self) -> None:
        """Warm-up (every program compiled or loaded, the grammar backend's warm-up beside it), the initial LoRA
        adapters, the engine controls; each in its start-up phase."""
        server_args, phases = self.server_args, self.startup
        grammar = self.grammar_queue.backend if self.model_runner.generates else None  # (embedding servers: none)
        grammar_ready = grammar.warmup() if grammar is not None else None  # (built while the model warms up)
        if not server_args.disable_precompile:
            self._warmup()
        if grammar_ready is not None:
            with phases.phase("grammar warm-up"):  # (what is left of it after the model's warm-up)
                grammar_ready.result()
        if self.lora is not None:
            with phases.phase("LoRA adapters"):
                self.lora.load_initial(server_args.lora_paths)
        self.control = EngineControl(self)  # weight updates, memory release, pause, profiling

    def _warmup(self) -> None:
        """Compile every program serving runs (the draft model's first), then measure speculation's step costs
        when the batch rule is on; each in its start-up phases (tracing, compiling). Then, XLA's threads existing,
        the other threads of the process yield to this one on a CPU device (`cpu_threads.yield_to_launcher`)."""
        if self.draft_model is not None:
            self.draft_model.runner.warmup(self.startup, "draft ")
        self.model_runner.warmup(self.startup)
        if self.speculating and batch_rule_on():  # the batch rule's step costs
            with self.startup.phase("speculation step costs"):
                mirror = None if self.draft_model is None else self.draft_model.mirror_runner
                costs = measure_step_costs(self.model_runner, self.buckets, mirror)
            for rank in self.ranks:
                rank.speculator.costs = costs
        if self.draft_model is not None:
            self.draft_model.runner.restart_compile_count()
        yield_to_launcher(self.model_runner.platform, self.server_args.num_continuous_decode_steps)

    def _open_sockets(self, port_args) -> None:
        """The ZMQ sockets: requests in from the TokenizerManager, tokens out to the DetokenizerManager, control
        replies and scores straight back to the TokenizerManager. A multi-host follower has none: its inputs come
        from node 0 (NodeLink) and its outputs are node 0's to send."""
        if self.is_leader:
            ctx = zmq.Context(2)
            self.recv_from_tokenizer = ctx.socket(zmq.PULL)
            self.recv_from_tokenizer.bind(port_args.scheduler_input_ipc_name)
            self.send_to_detokenizer = ctx.socket(zmq.PUSH)
            self.send_to_detokenizer.connect(port_args.detokenizer_ipc_name)
            self.send_to_tokenizer = ctx.socket(zmq.PUSH)
            self.send_to_tokenizer.connect(port_args.tokenizer_ipc_name)
        else:
            self.recv_from_tokenizer = None
            self.send_to_detokenizer = self.send_to_tokenizer = DiscardSocket()

    def _new_rank(self, rank: int, speculator=None) -> RankScheduler:
        """Rank `rank`: its KV memory (its own block of the KV buffers, request slots and prefix cache), its
        scoring state, its admission policy and its scheduling state."""
        sa, mc = self.server_args, self.model_config
        memory = KVMemory.create(self.model_runner.kv_spec, num_request_slots=self.max_running_requests,
                                 context_len=self.context_len, server_args=sa,
                                 host_tier=new_host_tier(sa, self.model_runner, rank))
        scoring = SchedulerScoring(memory, sa.multi_item_prefill_extend_cache_timeout,
                                   self.send_to_tokenizer.send_pyobj, mc.eos_token_ids, clock=lambda: self.tick_now,
                                   classify=self.model_runner.classify if self.model_runner.num_labels else None,
                                   lora_uid=self.lora_uid)
        admission = AdmissionPolicy(buckets=self.buckets, max_running_requests=self.max_running_requests,
                                    max_prefill_tokens=self.max_prefill_tokens, chunk_size=self.chunk_size,
                                    memory=memory, scoring=scoring, step_budget=self.step_budget,
                                    schedule_policy=sa.schedule_policy, lora=self.lora)
        config = RankConfig(
            rank=rank, dp_size=self.dp_size, buckets=self.buckets, max_running_requests=self.max_running_requests,
            max_prefill_tokens=self.max_prefill_tokens, chunk_size=self.chunk_size,
            stream_interval=sa.stream_interval, enable_mixed_chunk=sa.enable_mixed_chunk,
            test_retract="1" in (os.environ.get(TEST_RETRACT_ENV), os.environ.get("SGLANG_TEST_RETRACT")),
            check_invariants=os.environ.get(CHECK_KV_INVARIANTS_ENV) == "1")
        return RankScheduler(config, memory, scoring, admission, hooks=self, speculator=speculator)

    def info(self) -> SchedulerInfo:
        """Facts the TokenizerManager needs (validation limits, pool sizes: per rank)."""
        return SchedulerInfo(
            max_total_tokens=self.kv_size,
            max_running_requests=self.max_running_requests,
            max_prefill_tokens=self.max_prefill_tokens,
            max_req_input_len=self.max_req_input_len,
            context_len=self.context_len,
            page_size=self.page_size,
            kv_cache_dtype=self.model_runner.kv_cache_dtype.name,
            chunked_prefill_size=self.chunk_size or -1,
            prefix_cache=self.ranks[0].memory.cache_kind,
            vocab_size=self.model_config.vocab_size,
            architecture=self.model_config.architecture,
            model_role=self.model_config.role,
            is_encoder=self.model_config.is_encoder,
            token_paddings=list(self.buckets.token_paddings),
            bs_paddings=list(self.buckets.bs_paddings),
            dp_size=self.dp_size,
            tp_size=self.model_runner.tp_size,
            load_balance_method=self.load_balance_method,
            enable_mixed_chunk=bool(self.server_args.enable_mixed_chunk and self.chunk_size),
            max_prefill_step_ms=self.step_budget.budget_ms if self.step_budget is not None else 0,
            return_routed_experts=self.model_runner.return_routed_experts,
            weight_bytes_per_device=self.model_runner.weight_bytes,
            quantization=self.model_config.quantization,
            lora_adapters=None if self.lora is None else self.lora.registry.paths(),
            lora_slot_bytes=0 if self.lora is None else self.model_runner.lora_writer.slot_bytes,
            startup_phases={"scheduler": self.startup_report},
        )

    # ------------------------------------------------------------ RankHooks
    def full_logprobs(self, hidden_rows):
        return self.model_runner.full_logprobs(hidden_rows)

    def label_logprobs(self, hidden_rows, label_ids):
        return self.model_runner.label_logprobs(hidden_rows, label_ids)

    def kv_cache_lost(self) -> bool:
        return self.model_runner.kv_cache_lost()

    def sessions_on_rank(self, rank: int) -> list:
        return self.sessions.on_rank(rank)

    def step_in_flight(self) -> bool:
        return self.inflight is not None

    def drain(self) -> bool:
        """Wait for the step in flight and apply its result (every rank's part); returns whether there was one.
        The overlap scheduler's one sync point: before choosing a step that is not a decode continuation, before a
        retract, and before re-running a step that failed."""
        rec, self.inflight = self.inflight, None
        if rec is None:
            return False
        self.apply_launched(rec)
        return True

    def apply_launched(self, rec: LaunchedStep) -> None:
        """Hand each rank its part of a launched step's result. The step's time (from its launch, or from the end
        of the step before when it was launched earlier: the device ran them back to back) feeds the
        --max-prefill-step-ms model."""
        outs = rec.pending.resolve()
        self.step_stats.waited(rec.pending.times.wait_s + rec.pending.times.d2h_s)
        for rank, batch, out in zip(self.ranks, rec.batches, outs):
            if batch is not None:
                rank.apply_step(batch, out)
        if self.draft_model is not None:
            self.draft_model.after_step(rec.batches, outs)
        self.move_accepted_kv()
        now = time.perf_counter()
        if rec.cost_features is not None:
            self.step_time_model.observe(rec.cost_features, (now - max(rec.launched_at, self.last_applied_at)) * 1e3)
        self.last_applied_at = now

    # ------------------------------------------------------------ loop
    def event_loop(self) -> None:
        """Serve forever: take inputs, schedule, run one step per iteration. Each step runs under the
        watchdog (scheduler/watchdog.py, --watchdog-timeout)."""
        crash_at = int(os.environ.get(CRASH_AT_STEP_ENV, "0"))
        hang_at = int(os.environ.get(HANG_AT_STEP_ENV, "0"))
        step_delay_s = float(os.environ.get(STEP_DELAY_ENV, "0"))
        guarded = os.environ.get(TRANSFER_GUARD_ENV) == "1"
        watchdog = StepWatchdog(self.server_args.watchdog_timeout)
        step = 0
        try:
            while True:
                self.step_stats.iteration_started()
                tick = self.next_tick()
                if tick.shutdown:
                    logger.info("Node 0 stopped; stopping")
                    return
                batches = self.apply_tick(tick)
                if batches is None:
                    if self.inflight is not None:  # nothing new to launch: apply the step in flight
                        watchdog.step_started(step, "waiting for the last step's result")
                        with transfer_guard(guarded):
                            self.drain()
                        watchdog.step_finished()
                    continue
                step += 1
                if step == crash_at:
                    raise RuntimeError(f"injected crash at step {step} ({CRASH_AT_STEP_ENV})")
                watchdog.step_started(step, lambda b=batches: ", ".join(
                    f"rank {r}: {x.forward_mode.name.lower()} of {len(x.reqs)}" for r, x in enumerate(b)
                    if x is not None))
                if step == hang_at:
                    logger.warning("Injected hang at step %d (%s)", step, HANG_AT_STEP_ENV)
                    time.sleep(3600)
                if step_delay_s:
                    time.sleep(step_delay_s)
                with transfer_guard(guarded):
                    self.run_step(batches)
                self.control.on_step()
                watchdog.step_finished()
                self.step_stats.iteration_ended()
        finally:
            if self.link is not None:
                self.link.close()

    def next_tick(self) -> SchedulerTick:
        """This iteration's inputs: received here (node 0, also sent to the other nodes) or from node 0."""
        if not self.is_leader:
            return self.link.receive()
        msgs = self.recv_requests()
        ready, failed = self.grammar_queue.finished() if self.grammar_queue else ([], [])
        tick = SchedulerTick(msgs, ready, failed, time.time())
        if self.link is not None:
            self.link.broadcast(tick)
        return tick

    def apply_tick(self, tick: SchedulerTick) -> Optional[List[Optional[ScheduleBatch]]]:
        """Take in the iteration's inputs and ask every rank for its next batch; None when all ranks idle."""
        self.tick_now = tick.now
        self.process_input_requests(tick.msgs)
        if tick.grammar_ready or tick.grammar_failed:
            self.admit_grammar_ready(tick.grammar_ready, tick.grammar_failed)
        for rank in self.ranks:
            if rank.scoring.handles:
                rank.scoring.expire_handles(tick.now)
        if self.sessions.sessions:
            self.sessions.reap(tick.now, self.release_session)
        self.control.tick()
        if self.control.holds_steps():  # (paused, or memory released: requests wait in their queues)
            self.drain()
            return None
        for rank in self.ranks:
            rank.admit_new = not self.control.holds_admission()
        if not may_choose_ahead(self.inflight, self.ranks, self.model_runner.grammar_split):
            self.drain()
        choosing_ahead = self.inflight is not None
        num_steps = self.launcher.decode_steps_for()
        batches = [rank.get_next_batch_to_run(num_steps) for rank in self.ranks]
        if choosing_ahead and self.inflight is None:  # (a rank drained while choosing: drop what finished since)
            for batch in batches:
                if batch is not None and batch.forward_mode == ForwardMode.DECODE:
                    batch.filter_finished()
            batches = [b if b is not None and b.reqs else None for b in batches]
        if self.draft_model is not None:
            batches = self.draft_model.draft(batches, self.ranks)
        if self.speculating:
            batches, changed = unify_step(batches, [rank.memory for rank in self.ranks])
            self.num_spec_unified_steps += changed
        for rank, batch in zip(self.ranks, batches):
            if batch is None:
                rank.on_idle()
        return None if all(b is None for b in batches) else batches

    def run_step(self, batches: List[Optional[ScheduleBatch]]) -> None:
        """Launch one step of every rank's batch (None: the rank idles), then apply the step launched before it,
        and this one too unless it is a decode step and overlap is on (it is then applied after the next step is
        launched, or before anything else runs: `drain`). When launching fails, the step in flight is applied
        first and the step is run at once, the requests that fail on their own failed and dropped
        (`forward_isolating_faults`)."""
        t0 = time.perf_counter()
        x = step_cost_features(batches, self.buckets) if self.step_budget is not None else None
        try:
            pending = self.launcher.launch(batches)
        except Exception:
            if self.model_runner.kv_cache_lost():
                raise
            if self.drain():
                for batch in batches:
                    if batch is not None:
                        batch.reqs = [r for r in batch.reqs if not r.finished()]
            outs = self.forward_isolating_faults(batches)
            launched = [None if b is None else b.launched() for b in batches]
            for rank, batch, out in zip(self.ranks, launched, outs):
                if batch is not None:
                    rank.apply_step(batch, out)
            if self.draft_model is not None:
                self.draft_model.after_step(launched, outs)
            self.move_accepted_kv()
            self.last_applied_at = time.perf_counter()
            return
        launched = [None if b is None else b.launched() for b in batches]
        self.num_overlapped_steps += self.inflight is not None
        self.drain()
        if isinstance(pending, LaunchedForward):  # grammar rows: their masks need the step before applied
            pending = self.launcher.sample(pending, launched)
        rec = LaunchedStep(launched, pending, t0, x)
        self.step_stats.launched()
        if self.overlap and rec.is_decode:  # (inputs taken in while it runs see every other step applied)
            self.inflight = rec
        else:
            self.apply_launched(rec)

    # ------------------------------------------------------------ fault isolation
    def move_accepted_kv(self) -> None:
        if self.speculating:
            move_accepted_kv([rank.speculator for rank in self.ranks], self.model_runner, self.draft_model)

    def forward_isolating_faults(self, batches: List[Optional[ScheduleBatch]]) -> list:
        """Each rank's step output (None for idle ranks and emptied batches); when the step fails, the requests
        that fail alone are failed and removed and the rest re-run.

        Raises:
            The step's exception when no single request explains it, or when the KV cache was lost.
        """
        while True:
            try:
                return self.launcher.run(batches)
            except Exception as exc:
                if self.model_runner.kv_cache_lost():
                    raise
                live = [(r, req) for r, b in enumerate(batches) if b is not None for req in b.reqs]
                if len(live) == 1:
                    culprits = live
                else:
                    culprits = [(r, req) for r, req in live if self._fails_alone(r, req, batches)]
                if not culprits:
                    raise
                for r, req in culprits:
                    self.ranks[r].fail_in_batch(batches[r], req, exc)
                if all(b is None or b.is_empty() for b in batches):
                    return [None] * self.dp_size

    def _fails_alone(self, rank: int, req: Req, batches: List[Optional[ScheduleBatch]]) -> bool:
        """Run `req`'s part of the step alone on its rank (it rewrites only its own KV slots, with the same
        values)."""
        alone = [None] * self.dp_size
        alone[rank] = batches[rank].subset([req])
        try:
            self.launcher.run(alone)
            return False
        except Exception:
            if self.model_runner.kv_cache_lost():
                raise
            return True

    # ------------------------------------------------------------ input
    def recv_requests(self) -> list:
        busy = not self.control.holds_steps() and (self.inflight is not None or
                                                   any(rank.is_busy() for rank in self.ranks))
        if not busy and not self.recv_from_tokenizer.poll(GRAMMAR_POLL_MS if self.grammar_queue else IDLE_POLL_MS):
            return []
        msgs, sock = [], self.recv_from_tokenizer
        # (asking the socket for its events costs no zmq.Again exception on the busy loop's empty polls)
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            msg = sock.recv_pyobj(zmq.NOBLOCK)
            msgs.extend(msg if isinstance(msg, list) else [msg])  # a list: requests sent to be admitted together
        return msgs

    def process_input_requests(self, msgs: list) -> None:
        for msg in msgs:
            try:
                if isinstance(msg, TokenizedGenerateReqInput):
                    self.handle_generate_request(msg)
                elif isinstance(msg, TokenizedScoreReqInput):
                    rank = (self.rank_of_handle(msg.handle) if msg.handle is not None
                            else self.assign_rank(msg.seqs[0].input_ids if msg.seqs else []))
                    rank.handle_score_request(msg, self.kv_limits)
                elif isinstance(msg, ScorePrefillReq):
                    self.assign_rank(msg.input_ids).handle_score_prefill(msg, self.kv_limits)
                elif isinstance(msg, ScoreReleaseReq):
                    self.rank_of_handle(msg.handle).scoring.release_request(msg)
                elif isinstance(msg, AbortReq):
                    self.handle_abort(msg)
                elif isinstance(msg, FlushCacheReq):
                    self.answer(msg, self.flush_cache())
                elif isinstance(msg, OpenSessionReqInput):
                    self.answer(msg, self.open_session(msg))
                elif isinstance(msg, CloseSessionReqInput):
                    self.answer(msg, self.close_session(msg))
                elif isinstance(msg, (LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput)):
                    self.answer(msg, update_lora(self.lora, msg))
                elif type(msg) in CONTROL_REPLIES:
                    self.handle_control(msg)
                elif isinstance(msg, GetInternalStateReq):
                    self.answer(msg, GetInternalStateReqOutput(self.internal_state()))
                else:
                    logger.error("Unknown message type %s", type(msg).__name__)
            except Exception:  # a bad request must not take the scheduler down
                logger.error("Failed to handle %s:\n%s", type(msg).__name__, traceback.format_exc())
                rid = getattr(msg, "rid", None)
                if rid is not None:
                    self._send_abort(rid, "internal error while handling the request", 500)

    def handle_control(self, msg) -> None:
        """A weights, memory, pause or profile request (scheduler/engine_control.py): its answer now, later (an
        update waiting for the running requests), or a 500 naming the failure."""
        try:
            out = self.control.handle(msg)
        except Exception as e:
            logger.error("Failed to handle %s:\n%s", type(msg).__name__, traceback.format_exc())
            out = CONTROL_REPLIES[type(msg)](False, f"internal error: {type(e).__name__}: {e}", 500)
        if out is not None:
            self.answer(msg, out)

    def answer(self, msg, out) -> None:
        """Send `out` (one of io_struct.ANSWERS) to the TokenizerManager as the answer to request `msg` (its
        request_id copied: TokenizerManager.control matches answers by it)."""
        out.request_id = msg.request_id
        self.send_to_tokenizer.send_pyobj(out)

    def assign_rank(self, token_ids, namespace=None) -> RankScheduler:
        """The rank a new request (or scoring group) goes to, by --load-balance-method (load_balance.py);
        `namespace`: its prefix-cache namespace (a LoRA adapter's uid)."""
        r = 0
        if self.dp_size > 1:
            loads = [rank.num_reqs() for rank in self.ranks]
            matches = None
            if self.load_balance_method == "cache_aware":
                matches = [rank.memory.prefix_match_len(token_ids, namespace) for rank in self.ranks]
            turn = sum(rank.num_assigned_reqs for rank in self.ranks)  # requests given a rank so far
            r = choose_rank(self.load_balance_method, loads, matches, turn, len(token_ids))
        self.ranks[r].num_assigned_reqs += 1
        return self.ranks[r]

    def rank_of_handle(self, handle: str) -> RankScheduler:
        """The rank holding scoring-cache handle `handle` (rank 0 when none does: it answers "missing")."""
        return next((rank for rank in self.ranks if handle in rank.scoring.handles), self.ranks[0])

    def handle_generate_request(self, msg: TokenizedGenerateReqInput) -> None:
        """Queue a request (the TokenizerManager has validated it; limits are re-checked here, on the whole
        prompt of a session's turn, which is built here: scheduler/sessions.py)."""
        input_ids, session, parent = msg.input_ids, None, None
        if msg.session_params is not None:
            try:
                session = self.sessions.get(msg.session_params.id)
                input_ids, parent = session.build_input(msg.session_params, msg.input_ids, self.session_bos_id)
                check_turn(msg, session, input_ids, self.context_len, self.server_args.allow_auto_truncate)
            except SessionError as e:
                self._send_abort(msg.rid, e.message, e.status_code)
                return
        n = len(input_ids)
        if n == 0:
            self._send_abort(msg.rid, "The prompt is empty", 400)
            return
        sp = msg.sampling_params
        try:  # (a session's turn: its whole prompt, history included)
            check_fits(self.kv_limits, n, min_output=max(1, sp.min_new_tokens))
        except RequestError as e:
            self._send_abort(msg.rid, e.message, e.status_code)
            return
        # SGLang's rule: generation stops at the context length (and here also at the KV pool size)
        limit = min(self.context_len, self.kv_size)
        clipped = clip_max_new_tokens(n, sp.max_new_tokens, limit, truncate=True)
        sp.max_new_tokens = limit - n if clipped is None else clipped
        seed = sp.sampling_seed if sp.sampling_seed is not None else self.rng.randrange(2**31)
        req = Req(
            msg.rid, input_ids, sp, eos_token_ids=self.model_config.eos_token_ids, seed=seed,
            return_logprob=msg.return_logprob, logprob_start_len=msg.logprob_start_len,
            top_logprobs_num=msg.top_logprobs_num, token_ids_logprob=msg.token_ids_logprob, stream=msg.stream,
            return_routed_experts=msg.return_routed_experts,
        )
        if self.speculating:
            req.spec = SpecCounts()
        try:
            if msg.lora_path is not None:
                req.lora_name, req.cache_namespace = msg.lora_path, self.lora_uid(msg.lora_path)
            waits_for_grammar = self.grammar_queue.needs_grammar(req)
        except (ValueError, RequestError) as e:
            self._send_abort(msg.rid, getattr(e, "message", str(e)), 400)
            return
        if session is not None:  # (last: a refused request leaves its session as it was)
            req.dp_rank = session.rank
            session.lora_name = msg.lora_path
            session.register(req, parent, msg.session_params, self.abort_rid, self.tick_now)
        if not waits_for_grammar:
            self.rank_for(req).enqueue(req)

    def lora_uid(self, name: str) -> int:
        """The uid of loaded LoRA adapter `name` (`lora_control.lora_uid`)."""
        return lora_uid(self.lora, name)

    def live_reqs(self):
        """Every request queued (grammar queue included) or holding KV (running, chunk-prefilled, a scoring-cache
        handle, a streaming session between turns), on every rank."""
        for rank in self.ranks:
            yield from rank.waiting_queue
            yield from rank.kv_holders()
        yield from self.grammar_queue.reqs

    def running_reqs(self):
        """The requests every rank's next step reads (running and chunk-prefilled)."""
        for rank in self.ranks:
            yield from rank.running_batch.reqs
            if rank.chunked_req is not None:
                yield rank.chunked_req

    def rank_for(self, req: Req) -> RankScheduler:
        """A new request's rank: its session's, else by --load-balance-method."""
        if req.dp_rank is not None:
            return self.ranks[req.dp_rank]
        return self.assign_rank(req.origin_input_ids, req.cache_namespace)

    def abort_rid(self, rid: str, message: str) -> None:
        """Abort request `rid` wherever it is (a classic session's replaced turn)."""
        self.handle_abort(AbortReq(rid, message))

    def admit_grammar_ready(self, ready_rids: List[str], failed_rids: List[tuple]) -> None:
        """Queue requests whose grammar compiled (on their rank); answer 400 for those that failed."""
        ready, failed = self.grammar_queue.take(ready_rids, failed_rids)
        for req in ready:
            self.rank_for(req).enqueue(req)
        for req, message in failed:
            req.finished_reason = finish_abort(message, 400)  # (a session's turn is over)
            self._send_abort(req.rid, message, 400)

    def handle_abort(self, msg: AbortReq) -> None:
        for rank in self.ranks:
            if rank.abort(msg):
                return
        req = self.grammar_queue.remove(msg.rid)
        if req is not None:
            req.finished_reason = finish_abort(msg.message)
            self.send([token_out(req, self.server_args.stream_interval)])

    # ------------------------------------------------------------ output
    def _send_abort(self, rid: str, message: str, status_code: Optional[int] = None) -> None:
        out = TokenOut(rid=rid, new_token_ids=[], finished_reason=finish_abort(message, status_code).to_json(),
                       prompt_tokens=0, completion_tokens=0, cached_tokens=0, decode=DecodeConfig())
        self.send([out])

    def send(self, outs) -> None:
        outs = [o for o in outs if o is not None]
        if outs:
            self.send_to_detokenizer.send_pyobj(BatchTokenIDOut(outs))

    def decode_tail(self, req: Req, ids: List[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=req.sampling_params.skip_special_tokens)

    # ------------------------------------------------------------ state
    def internal_state(self) -> dict:
        """The server's state: per-rank counters and KV accounting summed over the ranks, plus ``dp_ranks``, one
        full entry per rank (its own queues and KV accounting; /get_server_info's ``internal_states``).
        ``num_compiles_after_warmup`` is None when compiles are not counted (--disable-precompile). An idle rank runs
        its idle check first (once per idle period), so the state never predates it."""
        for rank in self.ranks:
            rank.on_idle()
        shared = {"num_compiles_after_warmup": self.model_runner.num_compiles_after_warmup,
                  "overlap_schedule": self.overlap, "num_overlapped_steps": self.num_overlapped_steps,
                  "num_multi_step_decodes": self.launcher.num_multi_steps,
                  "num_grammar_split_steps": self.launcher.num_grammar_split_steps,
                  "step_stats": self.step_stats.state(),
                  "warmup": self.model_runner.warmup_stats,
                  "prefill_step_budget": None if self.step_budget is None else self.step_budget.state(),
                  "moe": None if self.model_runner.moe_stats is None else self.model_runner.moe_stats.state(),
                  **({} if self.lora is None else self.lora.state()), **self.control.state(),
                  **({"spec_unified_steps": self.num_spec_unified_steps} if self.speculating else {}),
                  **({"spec_draft_model_steps": self.draft_model.num_draft_steps,
                      "spec_draft_model_failed": self.draft_model.failed} if self.draft_model else {}),
                  **self.info().to_json()}
        per_rank = [{**rank.internal_state(), **shared} for rank in self.ranks]
        return merge_rank_states(per_rank, tuple(self.ranks[0].kv_accounting()))

    def flush_cache(self) -> FlushCacheReqOutput:
        """Empty every rank's prefix cache; refused while any request is running, chunking or waiting, or a
        streaming session holds KV."""
        if any(rank.holds_work() for rank in self.ranks) or self.grammar_queue:
            return FlushCacheReqOutput(False, "Cannot flush the cache while requests are running or waiting "
                                              "or scoring-cache handles are held")
        if any(s.holds_kv() for s in self.sessions.sessions.values()):
            return FlushCacheReqOutput(False, "Cannot flush the cache while streaming sessions hold KV; close "
                                              "them first")
        for rank in self.ranks:
            rank.memory.flush()
        return FlushCacheReqOutput(True, "Cache flushed.")

    # ------------------------------------------------------------ sessions
    def open_session(self, msg: OpenSessionReqInput) -> OpenSessionReqOutput:
        try:
            session = self.sessions.open(msg, self.tick_now)
        except SessionError as e:
            return OpenSessionReqOutput(None, False, e.message)
        return OpenSessionReqOutput(session.session_id, True)

    def close_session(self, msg: CloseSessionReqInput) -> CloseSessionReqOutput:
        try:
            self.sessions.request_close(msg.session_id, self.release_session)
        except SessionError as e:
            return CloseSessionReqOutput(msg.session_id, False, e.message)
        return CloseSessionReqOutput(msg.session_id, True)

    def release_session(self, session: Session) -> None:
        """Free what a closed session holds (a streaming session's slot and KV, via release_kv_cache)."""
        if session.kv is not None:
            self.ranks[session.rank].memory.release_session(session.kv)
