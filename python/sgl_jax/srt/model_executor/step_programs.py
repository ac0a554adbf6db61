"""The traced step programs of the model runner: forward, sampling, the fused step and the slot decode loop.

One step is one compiled program (`step`: the forward writing this step's K/V in place -- the cache is a donated
argument -- then the sampling: penalties, grammar masks, the draw, the future-token write). Its host inputs come in
one int32 buffer (model_executor/packed_inputs.py) and its sampled ids with their logprobs leave in one int32 array
(step_output.pack_tokens). A decode step of `DecodeRows` (`decode`) reads its page tables, sampling parameters and
input tokens from the device (model_executor/slot_state.py) and may run K steps in one ``lax.while_loop``, each
sampling on the device and stopping rows at their stop tokens, ending early once every row has stopped. The
overlap scheduler's grammar steps are split in two (`forward_only`, then `sample_only` with masks the host filled
while the forward ran), as are the draft runners' programs.

Every function here is traced under ``jax.jit`` by the model runner with a `StepSpec` bound (static: what the
program closes over); the mutable device state -- KV buffers, penalty state, future tokens, slot state -- is passed
in and returned, donated.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Tuple

import jax
import jax.numpy as jnp
from flax import nnx

from sgl_jax.srt.forward_batch import ForwardBatch
from sgl_jax.srt.layers.moe import expert_token_counts
from sgl_jax.srt.layers.sampler import sample
from sgl_jax.srt.model_executor.future_tokens import resolve_placeholders, write_future
from sgl_jax.srt.model_executor.packed_inputs import unpack
from sgl_jax.srt.model_executor.slot_state import decode_inputs, stops, write_rows
from sgl_jax.srt.model_executor.step_output import pack_tokens
from sgl_jax.srt.models.llama import sown_aux_hidden_states


# XLA options of the K-step decode program (--num-continuous-decode-steps K > 1) on a CPU device. XLA:CPU's default
# concurrency-optimized schedule hands the loop body's independent ops to its worker threads (~4.5 thread wake-ups
# per launch against ~1.3 without it, counted from /proc per thread at batch 1); on a machine with 2 cores those
# threads take the core the host needs to build the next launch, and the overlapped loop ran 0.57-0.68 ms a launch
# in 2 of 4 runs against 0.40 ms device time (4 of 4 at 0.33-0.46 ms without it). The one-step program keeps it: its
# device time was 15-20% longer at batch 16 and 64 without it. (reports/hot-loop-cpu-2026-12-07d.notes.md)
CPU_MULTI_STEP_XLA_OPTIONS = {"xla_cpu_enable_concurrency_optimized_scheduler": False}


def multi_step_xla_options(xla: dict, platform: str) -> dict:
    """The compiler options (XLA DebugOptions fields, jax.jit's ``compiler_options``) of the K-step decode program:
    --xla-compiler-options (`xla`) over CPU_MULTI_STEP_XLA_OPTIONS on a CPU device (`platform`, JAX's name), `xla`
    alone elsewhere."""
    return {**CPU_MULTI_STEP_XLA_OPTIONS, **xla} if platform == "cpu" else dict(xla)


@dataclasses.dataclass(frozen=True, eq=False)
class StepSpec:
    """What the step programs close over. graphdef / param_treedef: the model's (params come in as flat leaves);
    attention_backend: "native" or "pallas"; generates: an LM head and sampling (else an embedding server's zeros);
    aux_layers: layers whose outputs are returned (EAGLE-3); moe_experts: experts per MoE layer (0: dense);
    routed: return each sampled row's experts; rank_rows / replicated: shardings; page_size: tokens per KV page;
    with_lora: the model takes per-token adapter slots; eos_token_ids: int32[E] (device); num_layers: the MoE counts'
    rows a multi-step decode carries."""

    graphdef: Any
    param_treedef: Any
    attention_backend: str
    generates: bool
    aux_layers: Tuple[int, ...]
    moe_experts: int
    routed: bool
    rank_rows: Any
    replicated: Any
    page_size: int
    with_lora: bool
    eos_token_ids: Any
    num_layers: int = 0


def _model(spec: StepSpec, param_leaves):
    return nnx.merge(spec.graphdef, jax.tree.unflatten(spec.param_treedef, param_leaves))


def forward(spec: StepSpec, param_leaves, kv_caches, future, fb: ForwardBatch):
    """The model over one step's ForwardBatch: (kv_caches, logits float32[S, V] gathered at each sequence's last
    token (an embedding server's: zeros [S, 1]), hidden [T, hidden], the MoE outputs (`_moe_outputs`), the aux
    hidden states [T, n * hidden] of `aux_layers` (else None: no output)). Placeholders of tokens the previous step
    sampled are read from `future`."""
    model = _model(spec, param_leaves)
    fb = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, spec.rank_rows), fb)  # (rows by rank)
    fb = dataclasses.replace(fb, attention_backend=spec.attention_backend,
                             input_ids=resolve_placeholders(fb.input_ids, future))
    if spec.aux_layers:
        model.model.capture_layers = spec.aux_layers
    hidden, kv_caches = model(fb, kv_caches)
    if spec.generates:
        logits = jax.lax.with_sharding_constraint(model.compute_logits(hidden[fb.logits_indices]), spec.replicated)
    else:  # an embedding server reads hidden states only: no LM head, no sampling
        logits = jnp.zeros((fb.logits_indices.shape[0], 1), jnp.float32)
    aux = sown_aux_hidden_states(model.model) if spec.aux_layers else None
    return kv_caches, logits, hidden, _moe_outputs(spec, model, fb), aux


def _moe_outputs(spec: StepSpec, model, fb: ForwardBatch):
    """(expert token counts int32[L, E] of the step's real tokens, the expert ids int32[S, L, k] of the rows whose
    logits were sampled when `routed`, else None); None for a dense model (no output costs a buffer then)."""
    if not spec.moe_experts:
        return None
    routed = model.routed_experts()  # [L, T, k]
    counts = expert_token_counts(routed, fb.real_tokens(), spec.moe_experts)
    rows = jnp.transpose(routed[:, fb.logits_indices], (1, 0, 2)) if spec.routed else None
    return counts, rows


def sample_rows(spec: StepSpec, logits, penalty_state, future, sampling, filtering: bool = True):
    """Sample every row (layers/sampler.sample; `filtering`: its argument) and write the sampled tokens to the future
    buffer: (penalty_state, future, next_ids int32[S], next_lp float32[S] (the raw logits' log-softmax at the token),
    lse float32[S]). An embedding server samples nothing: zeros."""
    if not spec.generates:
        z = jnp.zeros((logits.shape[0],), jnp.float32)
        return penalty_state, future, z.astype(jnp.int32), z, z
    sampling = dataclasses.replace(sampling, last_token=resolve_placeholders(sampling.last_token, future))
    next_ids, lse, penalty_state = sample(logits, sampling, spec.eos_token_ids, penalty_state, filtering)
    future = write_future(future, sampling.slots, sampling.writes_future, next_ids)
    next_lp = jnp.take_along_axis(logits, next_ids[:, None], axis=-1)[:, 0] - lse
    return penalty_state, future, next_ids, next_lp, lse


def step(spec: StepSpec, param_leaves, kv_caches, state, packed, vocab_mask, layout):
    """One step of a host-built batch, forward and sampling in one program. state: (penalty_state, future,
    slot_state or None); packed / layout: (SamplingBatch without its mask, ForwardBatch) (`step_layouts`);
    vocab_mask int32[S, words]. Returns (kv_caches, state, (tokens int32[2, S], logits, lse, hidden, moe, aux))."""
    penalty_state, future, slots = state
    sampling, fb = unpack(packed, layout)
    if slots is not None:
        slots = write_rows(slots, fb, sampling)
    kv_caches, logits, hidden, moe, aux = forward(spec, param_leaves, kv_caches, future, fb)
    sampling = dataclasses.replace(sampling, vocab_mask=vocab_mask)
    penalty_state, future, next_ids, next_lp, lse = sample_rows(spec, logits, penalty_state, future, sampling)
    return kv_caches, (penalty_state, future, slots), (pack_tokens(next_ids, next_lp), logits, lse, hidden, moe, aux)


def forward_only(spec: StepSpec, param_leaves, kv_caches, slots, future, packed, layout):
    """The forward half of a split step (packed as for `step`): (kv_caches, slots, logits, hidden, moe, aux, the
    packed SamplingBatch: the buffer's first words, which `sample_only` reads; its layout depends on S only, so one
    sampling program serves every step shape of S rows)."""
    sampling, fb = unpack(packed, layout)
    if slots is not None:
        slots = write_rows(slots, fb, sampling)
    kv_caches, logits, hidden, moe, aux = forward(spec, param_leaves, kv_caches, future, fb)
    return kv_caches, slots, logits, hidden, moe, aux, packed[:sampling_words(layout)]


def sampling_words(layout) -> int:
    """int32 words of the SamplingBatch at the head of a step's packed buffer (`step_layouts`)."""
    _, specs = layout
    dtype, shape, offset = specs[sampling_leaves(layout) - 1]
    return offset + math.prod(shape)


def sampling_leaves(layout) -> int:
    """Leaves of the SamplingBatch of a step's (SamplingBatch, ForwardBatch) layout."""
    treedef, _ = layout
    return treedef.children()[0].num_leaves


def sample_only(spec: StepSpec, logits, penalty_state, future, packed, vocab_mask, layout):
    """The sampling half of a split step, on the packed SamplingBatch `forward_only` returned (`layout`: its own,
    `ModelRunner._sampling_layout`): (penalty_state, future, tokens int32[2, S], lse)."""
    sampling = unpack(packed, layout)
    sampling = dataclasses.replace(sampling, vocab_mask=vocab_mask)
    penalty_state, future, next_ids, next_lp, lse = sample_rows(spec, logits, penalty_state, future, sampling)
    return penalty_state, future, pack_tokens(next_ids, next_lp), lse


def _decode_one(spec: StepSpec, param_leaves, kv_caches, penalty_state, future, slots, rows, vocab_mask, k, live):
    """Step k of a slot decode over its live rows: (kv_caches, penalty_state, future, slots, next_ids, next_lp,
    logits, lse, hidden, moe, stopped bool[n])."""
    # step 0 reads the rows' input tokens (placeholders from the buffer); a later step the tokens the step before
    # sampled, which it wrote to the buffer
    later = future[jnp.clip(rows.slots, 0, future.shape[0] - 1)]
    input_ids = later if isinstance(k, int) and k > 0 else resolve_placeholders(rows.input_ids, future)
    if not isinstance(k, int):
        input_ids = jnp.where(k == 0, input_ids, later)
    fb, sampling, slots = decode_inputs(slots, rows, input_ids, k, live, spec.page_size, spec.with_lora)
    kv_caches, logits, hidden, moe, _ = forward(spec, param_leaves, kv_caches, future, fb)
    sampling = dataclasses.replace(sampling, vocab_mask=vocab_mask)
    penalty_state, future, next_ids, next_lp, lse = sample_rows(spec, logits, penalty_state, future, sampling,
                                                                rows.filtering)
    stopped = live & stops(sampling, next_ids, spec.eos_token_ids)
    return kv_caches, penalty_state, future, slots, next_ids, next_lp, logits, lse, hidden, moe, stopped


def decode(spec: StepSpec, param_leaves, kv_caches, state, packed, vocab_mask, layout):
    """K decode steps of `DecodeRows` (K = its kv_slots' first dimension; see the module docstring), sampling with
    top-k / top-p / min-p / typical-p filters when the rows' static ``filtering`` says so (a program of its own
    without them: smaller, and cheaper to launch). Returns
    (kv_caches, state, (tokens int32[2, S] (K = 1) or [2, K, S], logits and lse (None when K > 1), None (a decode
    step's hidden states serve nothing), moe, None)); the tokens of a row after it stopped, or past its KV slots, are
    garbage the host drops."""
    penalty_state, future, slots = state
    rows = unpack(packed, layout)
    n, K = rows.slots.shape[0], rows.kv_slots.shape[0]
    D = rows.num_seqs.shape[0]
    real = jnp.arange(n) % (n // D) < rows.num_seqs[jnp.arange(n) // (n // D)]
    if K == 1:
        kv_caches, penalty_state, future, slots, ids, lp, logits, lse, hidden, moe, _ = _decode_one(
            spec, param_leaves, kv_caches, penalty_state, future, slots, rows, vocab_mask, 0,
            real & (rows.kv_slots[0] != 0))
        return kv_caches, (penalty_state, future, slots), (pack_tokens(ids, lp), logits, lse, None, moe, None)

    def body(carry):
        k, kv, pen, fut, sl, active, ids, lps, counts = carry
        live = active & (rows.kv_slots[k] != 0)
        kv, pen, fut, sl, tok, lp, _, _, _, moe, stopped = _decode_one(spec, param_leaves, kv, pen, fut, sl, rows,
                                                                     vocab_mask, k, live)
        if spec.moe_experts:
            counts = counts + moe[0]
        return k + 1, kv, pen, fut, sl, live & ~stopped, ids.at[k].set(tok), lps.at[k].set(lp), counts

    def cond(carry):
        k, active = carry[0], carry[5]
        nxt = jnp.minimum(k, K - 1)
        return (k < K) & jnp.any(active & (rows.kv_slots[nxt] != 0))

    counts0 = jnp.zeros((spec.num_layers, spec.moe_experts) if spec.moe_experts else (0,), jnp.int32)
    carry = (jnp.int32(0), kv_caches, penalty_state, future, slots, real, jnp.zeros((K, n), jnp.int32),
             jnp.zeros((K, n), jnp.float32), counts0)
    _, kv_caches, penalty_state, future, slots, _, ids, lps, counts = jax.lax.while_loop(cond, body, carry)
    moe = (counts, None) if spec.moe_experts else None
    return kv_caches, (penalty_state, future, slots), (pack_tokens(ids, lps), None, None, None, moe, None)

