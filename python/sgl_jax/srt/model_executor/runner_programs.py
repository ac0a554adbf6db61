"""The programs a `ModelRunner` compiles at warm-up, as thunks of its padded serving inputs.

Each thunk builds one program's call on a shape's all-padding inputs (serving's exact shardings, so that the program
compiled is the one jit finds when serving) and returns a `program_cache.ProgramCall`; `warmup.compile_programs`
traces, compiles or loads them. The draft runners (scheduler/speculative/draft_runners.py) build theirs from the
same thunks. Functions of the runner, not methods, so that model_runner.py keeps to running steps.
"""

from __future__ import annotations

from typing import List, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.srt.forward_batch import DecodeRows, ForwardMode
from sgl_jax.srt.model_executor import step_programs
from sgl_jax.srt.model_executor.packed_inputs import pack
from sgl_jax.srt.model_executor.program_cache import ProgramCall
from sgl_jax.srt.model_executor.step_output import StepTimes
from sgl_jax.srt.model_loader.loader import JNP_DTYPES

LOGPROB_CHUNK_ROWS = 128  # rows per call when computing full-vocabulary input-token logprobs
SCORE_ROW_PADDINGS = (16, 128)  # rows per call when computing label logprobs for scoring
SCORE_LABEL_CHUNK = 16  # label ids per call


def serving_programs(runner) -> List[Tuple[str, object]]:
    """(name, thunk returning a `ProgramCall` of a `CachedProgram`, or a lowered program) of every program serving
    runs on `runner` (a `ModelRunner`): each extend bucket's forward and the sampling of each of their row counts
    (split: `ModelRunner.launch_ranks`), each decode bucket's step (the slot decode program, with
    --num-continuous-decode-steps K > 1 also its K-step loop; each with the sampler's filters and, where
    `DecodeRows.has_unfiltered_program`, without; a host-built fused step without slot state), each
    verify bucket's step, the K/V moves per verify shape, the LoRA slot writes, the host tier's KV copies, the
    logprob, label-logprob and penalty-row programs (an embedding server: its extends and classify programs)."""
    shapes = runner.buckets.all_shapes()
    if not runner.generates:  # (an embedding server's steps are all extends)
        shapes = [(mode, t, s) for mode, t, s in shapes if mode == ForwardMode.EXTEND]
    programs, sampled = [], {}  # sampled: rows -> a shape whose sampling program has those rows
    for mode, t, s in shapes:
        if mode == ForwardMode.DECODE and runner.grammar_split:
            sampled.setdefault(s, (mode, t, s))
        if mode == ForwardMode.DECODE and runner.slot_decode:
            for k in sorted({1, runner.decode_steps}):
                programs.append((f"decode S={s} K={k}", lower_decode(runner, s, k, True)))
                if DecodeRows.has_unfiltered_program(s):
                    programs.append((f"decode S={s} K={k} unfiltered", lower_decode(runner, s, k, False)))
        elif mode == ForwardMode.EXTEND:
            programs.append((f"extend T={t} S={s}", lower_forward(runner, mode, t, s)))
            sampled.setdefault(s, (mode, t, s))
        else:
            programs.append((f"{mode.name.lower()} T={t} S={s}", lower_step(runner, mode, t, s)))
    programs += [(f"sampling S={rows}", lower_sample(runner, *shape)) for rows, shape in sorted(sampled.items())]
    programs += [(f"KV move M={t}", lower_move(runner, t)) for mode, t, _ in shapes
                 if mode == ForwardMode.TARGET_VERIFY]
    programs += runner.lora_writer.warmup_programs() if runner.lora_writer is not None else []
    if runner.host_kv_copies is not None:
        programs += runner.host_kv_copies.warmup_programs(lambda: runner.kv_caches)
    return programs + _head_programs(runner)


def _head_programs(runner) -> List[Tuple[str, object]]:
    """The programs on the final hidden rows: classify per row padding (an embedding server with labels), else the
    input logprobs, the penalty row and the label logprobs per row padding."""
    hidden_dim = runner.model_config.hidden_size
    dtype = np.dtype(JNP_DTYPES[runner.model_config.dtype])
    put = runner._put
    if not runner.generates:
        return [(f"classify R={r}", lambda r=r: ProgramCall(runner._classify, (
            runner.params, put(np.zeros((r, hidden_dim), dtype))))) for r in SCORE_ROW_PADDINGS if runner.num_labels]
    programs = [(f"input logprobs R={LOGPROB_CHUNK_ROWS}", lambda: ProgramCall(runner._logprobs, (
        runner.params, put(np.zeros((LOGPROB_CHUNK_ROWS, hidden_dim), dtype)))))]
    programs.append(("penalty row", lambda: ProgramCall(runner._init_penalty_row, (runner.penalty_state, *put((
        np.int32(0), np.zeros(runner.max_context_len, np.int32), np.int32(0), np.int32(0),
        np.zeros(runner.model_config.vocab_size, np.float32)))))))
    for r in SCORE_ROW_PADDINGS:
        programs.append((f"label logprobs R={r}", lambda r=r: ProgramCall(runner._label_logprobs, (
            runner.params, *put((np.zeros((r, hidden_dim), dtype), np.zeros(SCORE_LABEL_CHUNK, np.int32)))))))
    return programs


def padding_inputs(runner, mode: ForwardMode, t_pad: int, s_pad: int) -> tuple:
    """(packed inputs on device, layout, vocab mask) of an all-padding step of every rank of `runner`: serving's exact
    inputs (shardings included), so the compiled program is the one jit finds when serving."""
    stacked = runner._step_batch([runner.dummy_batch(mode, t_pad, s_pad)] * runner.dp_size)
    packed, layout = runner._step_inputs(stacked, StepTimes())
    return packed, layout, runner._all_allowed_mask(stacked.forward_batch.logits_indices.shape[0])


def lower_step(runner, mode: ForwardMode, t_pad: int, s_pad: int):
    """A thunk lowering the fused step program of one padded shape."""
    def lower():
        packed, layout, mask = padding_inputs(runner, mode, t_pad, s_pad)
        return ProgramCall(runner._step, (runner._param_leaves, runner._kv_args, runner._state, packed, mask, layout))
    return lower


def lower_decode(runner, s_pad: int, num_steps: int, filtering: bool):
    """A thunk lowering the slot decode program of `s_pad` rows per rank and `num_steps` steps, its sampling with
    top-k / top-p / min-p / typical-p filters or without (`filtering`: DecodeRows.filtering)."""
    def lower():
        buf, layout = pack(DecodeRows.stack([DecodeRows.padding(s_pad, num_steps, filtering)] * runner.dp_size,
                                            runner.num_request_slots))
        mask = runner._all_allowed_mask(s_pad * runner.dp_size)
        return ProgramCall(runner._decode(num_steps), (runner._param_leaves, runner._kv_args, runner._state,
                                                       runner._put(buf), mask, layout))
    return lower


def lower_forward(runner, mode: ForwardMode, t_pad: int, s_pad: int):
    """A thunk lowering the split forward program of one padded shape."""
    def lower():
        packed, layout, _ = padding_inputs(runner, mode, t_pad, s_pad)
        return ProgramCall(runner._forward, (runner._param_leaves, runner._kv_args, runner.slot_state,
                                             runner.future_tokens, packed, layout))
    return lower


def lower_move(runner, m: int):
    """A thunk lowering the KV move program of `m` slots per rank (`ModelRunner.move_kv`)."""
    def lower():
        z = runner._put(np.zeros(runner.dp_size * m, np.int32))
        return ProgramCall(runner._move_kv, (runner._kv_args, z, z))
    return lower


def lower_sample(runner, mode: ForwardMode, t_pad: int, s_pad: int):
    """A thunk lowering the split sampling program of one padded shape (its rows: S_pad, T_pad in a verify step)."""
    def lower():
        _, layout, mask = padding_inputs(runner, mode, t_pad, s_pad)
        rows = runner.dp_size * (t_pad if mode == ForwardMode.TARGET_VERIFY else s_pad)
        width = runner.logits_vocab if runner.generates else 1
        logits = jax.ShapeDtypeStruct((rows, width), jnp.float32, sharding=runner._replicated)
        head = jax.ShapeDtypeStruct((step_programs.sampling_words(layout),), jnp.int32, sharding=runner._replicated)
        return ProgramCall(runner._sample, (logits, runner.penalty_state, runner.future_tokens, head, mask,
                                            runner._sampling_layout(layout)))
    return lower
