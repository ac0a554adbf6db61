"""What RL frameworks and operators ask of a running scheduler (SGLang's names and semantics):

- ``update_weights_from_disk`` / ``update_weights_from_tensor``: new weights of the same architecture and shapes,
  placed into the served parameters' shardings (model_executor/weight_update.py; no compile). Requests in flight:
  ``abort_all_requests`` aborts them; otherwise the update waits until the running ones finish while new ones
  wait in the queue; while generation is paused the update happens at once (``in_place``: the paused requests
  keep their KV, computed with the old weights, and continue with the new ones). Every cached prefix is retired
  (`KVMemory.retire_cache`): nothing computed with the old weights is matched again, and what paused requests
  still lock is freed once they finish. ``weight_version`` is the caller's label of the weights.
- ``get_weights_by_name``: the first rows of a parameter.
- ``release_memory_occupation`` / ``resume_memory_occupation`` (tags ``kv_cache``, ``weights``): the KV buffers
  (the prefix cache is flushed) and the weights leave the devices and come back; no step runs meanwhile.
- ``pause_generation`` (``abort``: every request aborted; ``retract``: running requests go back to the queue
  with their KV freed; ``in_place``: they keep it) and ``continue_generation``. New requests queue while paused.
- ``start_profile`` / ``stop_profile``: a jax.profiler trace (TensorBoard's xplane and Perfetto's JSON) under
  --profile-dir, stopped after a number of steps or seconds.

A request that changes the weights or the memory is refused (409) while streaming sessions or scoring-cache
handles hold KV (close them first), and (400) with a speculative draft model (it would keep the old weights).
"""

from __future__ import annotations

import copy
import logging
import os
import time
import traceback
from typing import List, Optional

import jax

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.io_struct import (
    CONTROL_REPLIES,
    AbortReq,
    ControlOutput,
    GetWeightsByNameReqInput,
    GetWeightsOutput,
    MemoryOccupationOutput,
    MemoryOccupationReqInput,
    PauseGenerationOutput,
    PauseGenerationReqInput,
    ProfileOutput,
    ProfileReqInput,
    UpdateWeightsFromDiskReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightsOutput,
)
from sgl_jax.srt.mem_cache.base_prefix_cache import is_retired, retired_namespace
from sgl_jax.srt.model_executor.weight_update import (
    MemoryOccupation,
    checkpoint_values,
    config_mismatch,
    device_bytes_in_use,
    swap_values,
    tensor_values,
    weight_rows,
)

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("kv_cache", "weights")
IGNORED_TAGS = ("cuda_graph",)  # SGLang's tag for CUDA graphs' memory: compiled XLA programs stay, as documented
PROFILE_DEFAULT_S = 30.0  # a trace started with neither num_steps nor duration_s stops after this long
PROFILE_MAX_S = 600.0


class EngineControl:
    """The scheduler's weights, memory, pause and profiler state.

    Args:
        sched: the `Scheduler` (its ranks, model runner, grammar queue, sessions; `send_to_tokenizer`).
    """

    def __init__(self, sched):
        self.sched = sched
        sa = sched.server_args
        self.weight_version: str = sa.weight_version
        self.profile_dir = sa.profile_dir
        self.epoch = 0  # weight updates so far (names the retired cache namespaces)
        self.paused: Optional[str] = None  # the pause mode while generation is paused
        self.waiting_ops: list = []  # updates and abort pauses waiting for the running requests to finish
        self.memory = MemoryOccupation(sched.model_runner)
        self.retired: List[tuple] = []  # (rank, namespace key) retired and not yet freed
        self.trace: Optional[dict] = None  # the profile being taken: dir, steps left, deadline
        self.last_update_s: Optional[float] = None

    # ------------------------------------------------------------ scheduler hooks
    def holds_steps(self) -> bool:
        """No step may run: generation paused, or KV buffers or weights off the devices."""
        return self.paused is not None or self.memory.kv_released or self.memory.weights_released

    def holds_admission(self) -> bool:
        """New requests wait in the queue: an update or an abort pause waits for the running ones."""
        return bool(self.waiting_ops)

    def tick(self) -> None:
        """Once per loop iteration: apply what waited for the running requests, free retired prefixes nobody
        locks any more, stop a profile past its deadline."""
        if self.waiting_ops and (self.paused is not None or self._nothing_running()):
            ops, self.waiting_ops = self.waiting_ops, []
            for msg in ops:
                out = self._apply_guarded(msg)
                out.request_id = msg.request_id
                self._reply(out)
        if self.retired:
            for rank, key in self.retired:
                rank.memory.drop_namespace(key)
            self.retired = [(r, k) for r, k in self.retired if r.memory.has_namespace(k)]
        if self.trace is not None and time.monotonic() >= self.trace["deadline"]:
            self._stop_trace("its duration passed")

    def on_step(self) -> None:
        """After each step: count it against a profile's num_steps."""
        if self.trace is not None and self.trace["steps_left"] is not None:
            self.trace["steps_left"] -= 1
            if self.trace["steps_left"] <= 0:
                self._stop_trace("its steps ran")

    def handle(self, msg) -> Optional[ControlOutput]:
        """A control request's answer, or None when it waits (answered later by `tick`)."""
        if isinstance(msg, (UpdateWeightsFromDiskReqInput, UpdateWeightsFromTensorReqInput)):
            return self._request_update(msg)
        if isinstance(msg, PauseGenerationReqInput):
            return self._pause(msg)
        if isinstance(msg, MemoryOccupationReqInput):
            return self._memory(msg)
        if isinstance(msg, ProfileReqInput):
            return self._profile(msg)
        if isinstance(msg, GetWeightsByNameReqInput):
            return self._get_weights(msg)
        raise TypeError(type(msg).__name__)

    def state(self) -> dict:
        """Internal-state entries."""
        return {"weight_version": self.weight_version, "num_weight_updates": self.epoch,
                "last_weight_update_s": self.last_update_s, "generation_paused": self.paused,
                "memory_released": {"kv_cache": self.memory.kv_released, "weights": self.memory.weights_released},
                "retired_cache_namespaces": len(self.retired),
                "profiling": None if self.trace is None else self.trace["dir"]}

    # ------------------------------------------------------------ helpers
    def _reply(self, out: ControlOutput) -> None:
        self.sched.send_to_tokenizer.send_pyobj(out)

    def _nothing_running(self) -> bool:
        return self.sched.inflight is None and all(
            not rank.running_batch.reqs and rank.chunked_req is None for rank in self.sched.ranks)

    def _kv_blocker(self) -> Optional[str]:
        """Why KV may not be dropped or retired now (None: it may)."""
        sched = self.sched
        if any(rank.scoring.handles for rank in sched.ranks):
            return "scoring-cache handles hold KV; release them first"
        if any(s.holds_kv() or s.streaming and s.busy() for s in sched.sessions.sessions.values()):
            return "streaming sessions hold KV (or run a turn); close them first"
        if any(r.score is not None and r.score.is_handle_prefill for r in sched.live_reqs()):
            return "scoring-cache handles are being prefilled; release them first"
        return None

    def _abort_everything(self, message: str) -> None:
        """Abort every queued and running request (and scoring group): running ones finish at their next step."""
        sched = self.sched
        for rank in sched.ranks:
            rids = list(rank.scoring.groups) + [r.rid for r in rank.waiting_queue + rank.running_batch.reqs]
            if rank.chunked_req is not None:
                rids.append(rank.chunked_req.rid)
            for rid in rids:
                rank.abort(AbortReq(rid, message))
            if self.paused is not None:  # (no step will run to finish them: they finish here)
                sched.drain()
                self._finish_running_now(rank)
        for req in list(sched.grammar_queue.reqs):
            sched.handle_abort(AbortReq(req.rid, message))

    @staticmethod
    def _finish_running_now(rank) -> None:
        """Finish `rank`'s running and chunk-prefilled requests that are marked to abort: answered, KV released."""
        reqs = rank.running_batch.reqs + ([rank.chunked_req] if rank.chunked_req is not None else [])
        for req in reqs:
            if req.to_abort is not None and not req.finished():
                req.finished_reason = req.to_abort
                rank.finish_failed(req)
        if rank.chunked_req is not None and rank.chunked_req.finished():
            rank.chunked_req = None
        rank.running_batch.filter_finished()

    # ------------------------------------------------------------ weights
    def _request_update(self, msg) -> Optional[UpdateWeightsOutput]:
        problem = self._update_problem()
        if problem is not None:
            return UpdateWeightsOutput(False, problem[1], problem[0])
        if msg.abort_all_requests:
            self._abort_everything("The weights are being updated (abort_all_requests)")
        if self.paused is not None or self._nothing_running() and not self.waiting_ops:
            return self._apply(msg)
        self.waiting_ops.append(msg)  # (answered by tick once the running requests finish)
        logger.info("Weight update waiting for %d running requests to finish; new requests wait",
                    sum(len(r.running_batch.reqs) + (r.chunked_req is not None) for r in self.sched.ranks))
        return None

    def _update_problem(self) -> Optional[tuple]:
        """(status, message) when no weight update may happen now."""
        sched = self.sched
        if sched.server_args.speculative_algorithm is not None:
            return 400, "weight updates with --speculative-algorithm are not supported (the draft keeps its weights)"
        if sched.link is not None:
            return 400, "weight updates are not supported across hosts (--nnodes > 1) yet"
        blocker = self._kv_blocker()
        return None if blocker is None else (409, f"cannot update the weights: {blocker}")

    def _apply_guarded(self, msg) -> ControlOutput:
        """`_apply` for an operation that waited: checked again (what blocks it may have started meanwhile), and a
        failure answered (500) rather than raised into the loop."""
        reply = CONTROL_REPLIES[type(msg)]
        problem = None if isinstance(msg, PauseGenerationReqInput) else self._update_problem()
        if problem is not None:
            return reply(False, problem[1], problem[0])
        try:
            return self._apply(msg)
        except Exception as e:
            logger.error("Failed to apply %s:\n%s", type(msg).__name__, traceback.format_exc())
            return reply(False, f"internal error: {type(e).__name__}: {e}", 500)

    def _apply(self, msg) -> ControlOutput:
        if isinstance(msg, PauseGenerationReqInput):  # (an abort pause whose aborted requests have left)
            self.paused = msg.mode
            logger.info("Generation paused (abort)")
            return PauseGenerationOutput(True, "Generation paused.")
        return self._update(msg)

    def _update(self, msg) -> UpdateWeightsOutput:
        sched, runner = self.sched, self.sched.model_runner
        held = [r for rank in sched.ranks for r in rank.running_batch.reqs + [rank.chunked_req] if r is not None]
        memory = sched.ranks[0].memory
        if held and not memory.keeps_namespaces:
            return UpdateWeightsOutput(False, f"cannot update the weights while paused requests hold KV in the "
                                       f"{memory.cache_kind} prefix cache (it keeps no retired prefixes): pause "
                                       "with mode retract or abort", 409)
        t0 = time.perf_counter()
        try:
            if isinstance(msg, UpdateWeightsFromDiskReqInput):
                values = checkpoint_values(runner, self._new_config(msg), self._load_format(msg))
            else:
                if self.memory.weights_released:
                    raise ValueError("the weights are released from the devices: resume them first (a tensor update "
                                     "replaces only the named parameters)")
                values = tensor_values(runner, msg.named_tensors)
            swap_values(runner, values)
        except Exception as e:  # an unfit or unreadable checkpoint: the served weights are untouched
            logger.warning("Weight update refused: %s", e)
            return UpdateWeightsOutput(False, f"Failed to update the weights: {e}", 400)
        if isinstance(msg, UpdateWeightsFromDiskReqInput):
            self.memory.weights_replaced()
        self.epoch += 1
        for rank in sched.ranks:  # nothing cached under the old weights is matched again
            self.retired += [(rank, key) for key in rank.memory.retire_cache(self.epoch)]
            for req in rank.running_batch.reqs + [rank.chunked_req]:  # (their inserts go to retired prefixes)
                if req is not None and not is_retired(req.cache_namespace):
                    req.cache_namespace = retired_namespace(self.epoch, req.cache_namespace)
                if req is not None and (rank, req.cache_namespace) not in self.retired:
                    self.retired.append((rank, req.cache_namespace))
        if msg.weight_version is not None:
            self.weight_version = msg.weight_version
        seconds = time.perf_counter() - t0
        self.last_update_s = round(seconds, 3)
        what = msg.model_path if isinstance(msg, UpdateWeightsFromDiskReqInput) else f"{len(values)} tensors"
        logger.info("Weights updated from %s in %.2f s (version %s; %d requests kept their KV)", what, seconds,
                    self.weight_version, len(held))
        return UpdateWeightsOutput(True, "Succeeded to update model weights.", 200, {
            "weight_version": self.weight_version, "seconds": seconds, "num_paused_requests": len(held),
            "kv_cache_released": self.memory.kv_released, "weights_released": self.memory.weights_released})

    def _new_config(self, msg: UpdateWeightsFromDiskReqInput) -> ModelConfig:
        """The new checkpoint's ModelConfig. Raises ValueError naming the first field that differs."""
        sa = copy.copy(self.sched.server_args)
        sa.model_path, sa.revision = msg.model_path, msg.revision
        new = ModelConfig.from_server_args(sa, jax.default_backend())
        mismatch = config_mismatch(self.sched.model_config, new)
        if mismatch is not None:
            raise ValueError(f"the checkpoint at {msg.model_path} does not match the served model: {mismatch}")
        return new

    def _load_format(self, msg: UpdateWeightsFromDiskReqInput) -> str:
        fmt = msg.load_format or self.sched.server_args.load_format
        return "auto" if fmt == "dummy" else fmt

    def _get_weights(self, msg: GetWeightsByNameReqInput) -> GetWeightsOutput:
        if self.memory.weights_released:
            return GetWeightsOutput(False, "the weights are released from the devices", 409)
        if self.sched.link is not None:
            return GetWeightsOutput(False, "get_weights_by_name is not supported across hosts (--nnodes > 1)", 400)
        try:
            rows = weight_rows(self.sched.model_runner, msg.name, msg.truncate_size)
        except KeyError:
            return GetWeightsOutput(False, f"name: the model has no parameter {msg.name!r}", 400)
        except ValueError as e:
            return GetWeightsOutput(False, str(e), 400)
        return GetWeightsOutput(True, "", 200, {"parameter": rows})

    # ------------------------------------------------------------ pause
    def _pause(self, msg: PauseGenerationReqInput) -> Optional[PauseGenerationOutput]:
        sched = self.sched
        if msg.resume:
            was, self.paused = self.paused, None
            logger.info("Generation continues%s", "" if was else " (it was not paused)")
            return PauseGenerationOutput(True, "Generation continued.")
        if msg.mode not in PAUSE_MODES:
            return PauseGenerationOutput(False, f"mode must be one of {', '.join(PAUSE_MODES)}, got {msg.mode!r}", 400)
        if msg.mode == "abort":
            self._abort_everything("Generation paused (pause_generation mode abort)")
            if not self._nothing_running():
                self.waiting_ops.append(msg)  # (answered once the aborted requests have left)
                return None
            return self._apply(msg)
        sched.drain()
        if msg.mode == "retract":
            for rank in sched.ranks:
                self._retract_all(rank)
        self.paused = msg.mode
        held = sum(len(r.running_batch.reqs) + (r.chunked_req is not None) for r in sched.ranks)
        logger.info("Generation paused (%s; %d requests keep their KV)", msg.mode, held)
        return PauseGenerationOutput(True, "Generation paused.")

    @staticmethod
    def _retract_all(rank) -> None:
        """Every running and chunk-prefilled request of `rank` back to the front of its queue, KV freed."""
        if rank.running_batch.reqs:
            rank.retract(len(rank.running_batch.reqs))
        req = rank.chunked_req
        if req is not None:
            rank.chunked_req = None
            rank.memory.release(req, is_insert=False)
            req.reset_for_retract()
            rank.waiting_queue.insert(0, req)

    # ------------------------------------------------------------ memory
    def _memory(self, msg: MemoryOccupationReqInput) -> MemoryOccupationOutput:
        tags = list(MEMORY_TAGS) if msg.tags is None else [t for t in msg.tags if t not in IGNORED_TAGS]
        bad = [t for t in tags if t not in MEMORY_TAGS]
        if bad or not tags and not msg.tags:
            return MemoryOccupationOutput(False, f"tags must be a non-empty list of {list(MEMORY_TAGS)}, got "
                                         f"{msg.tags!r}", 400)
        kv, weights = "kv_cache" in tags, "weights" in tags
        sched = self.sched
        if sched.server_args.speculative_algorithm is not None or sched.link is not None:
            return MemoryOccupationOutput(False, "memory release is not supported with --speculative-algorithm or "
                                         "across hosts", 400)
        sched.drain()
        before = device_bytes_in_use()
        if msg.release:
            if not self._nothing_running():
                return MemoryOccupationOutput(False, "requests are running: pause generation (mode abort or "
                                             "retract) or let them finish first", 409)
            blocker = self._kv_blocker() if kv else None
            if blocker is not None:
                return MemoryOccupationOutput(False, f"cannot release the KV cache: {blocker}", 409)
            if kv and not self.memory.kv_released:
                for rank in sched.ranks:
                    rank.memory.flush()
            seconds, freed = self.memory.release(kv, weights)
        else:
            seconds, freed = self.memory.resume(kv, weights), 0
        after = device_bytes_in_use()
        logger.info("Memory %s (%s) in %.2f s: %.1f MiB -> %.1f MiB on the devices",
                    "released" if msg.release else "resumed", ", ".join(tags), seconds, before / 2**20, after / 2**20)
        return MemoryOccupationOutput(True, "", 200, {
            "seconds": seconds, "device_bytes_before": before, "device_bytes_after": after, "bytes_released": freed,
            "kv_cache_released": self.memory.kv_released, "weights_released": self.memory.weights_released})

    # ------------------------------------------------------------ profiling
    def _profile(self, msg: ProfileReqInput) -> ProfileOutput:
        if not msg.start:
            if self.trace is None:
                return ProfileOutput(False, "no profile is running", 400)
            return ProfileOutput(True, "Profile stopped.", 200, self._stop_trace("stop_profile"))
        if self.trace is not None:
            return ProfileOutput(False, f"a profile is already running (into {self.trace['dir']})", 400)
        root = os.path.realpath(self.profile_dir)
        sub = msg.output_dir or time.strftime("profile-%Y%m%d-%H%M%S")
        out_dir = os.path.realpath(os.path.join(root, sub))
        if os.path.commonpath([root, out_dir]) != root:
            return ProfileOutput(False, f"output_dir must be inside --profile-dir ({self.profile_dir}), got "
                                 f"{msg.output_dir!r}", 400)
        if msg.num_steps is not None and msg.num_steps < 1 or msg.duration_s is not None and not (
                0 < msg.duration_s <= PROFILE_MAX_S):
            return ProfileOutput(False, f"num_steps must be >= 1 and duration_s in (0, {PROFILE_MAX_S:g}]", 400)
        duration = msg.duration_s or (PROFILE_MAX_S if msg.num_steps else PROFILE_DEFAULT_S)
        try:
            os.makedirs(out_dir, exist_ok=True)
        except OSError as e:
            return ProfileOutput(False, f"output_dir: cannot create {out_dir}: {e}", 400)
        jax.profiler.start_trace(out_dir, create_perfetto_trace=True)
        self.trace = {"dir": out_dir, "steps_left": msg.num_steps, "deadline": time.monotonic() + duration,
                      "started": time.monotonic()}
        logger.info("Profiling into %s (up to %s steps, %.0f s)", out_dir, msg.num_steps, duration)
        return ProfileOutput(True, "Start profiling.", 200, {"output_dir": out_dir, "duration_s": duration,
                                                             "num_steps": msg.num_steps})

    def _stop_trace(self, why: str) -> dict:
        trace, self.trace = self.trace, None
        jax.profiler.stop_trace()
        files = sorted(os.path.relpath(os.path.join(d, f), trace["dir"])
                       for d, _, fs in os.walk(trace["dir"]) for f in fs)
        logger.info("Profile written to %s (%s): %d files", trace["dir"], why, len(files))
        return {"output_dir": trace["dir"], "files": files,
                "seconds": round(time.monotonic() - trace["started"], 3)}
