"""ModelRunner: weights and KV buffers on device, the jitted step, warm-up compilation of every bucket.

One step = two compiled programs dispatched back to back: the forward (writing this step's K/V in place: the cache
is a donated argument; next-token logits at each sequence's last token), one per padded shape, and the sampling
(penalties, grammar masks, the draw, the future-token write), one per padded number of sequences. The overlap
scheduler may fill a step's grammar masks between the two: after its forward is launched and the step before it
has been applied (SGLang's overlap worker waits for the masks before sampling the same way).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import math
import os
import time
from typing import Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from sgl_jax.srt.kernels.ragged_paged_attention.backend import describe as describe_attention
from sgl_jax.srt.distributed.mesh import create_mesh, tp_size_of
from sgl_jax.srt.distributed.multihost import init_distributed
from sgl_jax.srt.distributed.sharding import KV_CACHE, RANK_ROWS, REPLICATED, check_tp, padded_kv_heads

from sgl_jax.srt.layers.attention import move_kv_slots
from sgl_jax.srt.layers.encoder_attention import with_encoder_inputs
from sgl_jax.srt.layers.moe import expert_token_counts
from sgl_jax.srt.layers.sampler import init_penalty_row, new_penalty_state, sample
from sgl_jax.srt.model_executor.buckets import ShapeBuckets
from sgl_jax.srt.model_executor.compile_stats import compile_counts, describe
from sgl_jax.srt.model_executor.host_kv import HostKVCopies
from sgl_jax.srt.model_executor.lora_weights import LoraSlotWriter
from sgl_jax.srt.model_executor.memory_budget import FP8_KV_DTYPES, kv_cache_dtype
from sgl_jax.srt.model_executor.future_tokens import new_future_tokens, resolve_placeholders, write_future
from sgl_jax.srt.model_executor.packed_inputs import pack, unpack
from sgl_jax.srt.model_executor.moe_stats import MoeStats
from sgl_jax.srt.fault_injection import PlantedFaults
from sgl_jax.srt.forward_batch import ForwardBatch, ForwardMode, ModelWorkerBatch, stack_ranks
from sgl_jax.srt.sampling.sampling_batch import SamplingBatch, all_allowed_mask, vocab_mask_words
from sgl_jax.srt.model_loader.loader import JNP_DTYPES, load_model
from sgl_jax.srt.models.llama import sown_aux_hidden_states
from sgl_jax.srt.server_args import resolve_attention_backend

logger = logging.getLogger(__name__)

LOGPROB_CHUNK_ROWS = 128  # rows per call when computing full-vocabulary input-token logprobs
SCORE_ROW_PADDINGS = (16, 128)  # rows per call when computing label logprobs for scoring
SCORE_LABEL_CHUNK = 16  # label ids per call


@dataclasses.dataclass
class StepOutput:
    """One rank's result of one step. next_token_ids / next_token_logprobs are host arrays over the rank's
    real sequences; ``logits`` (float32[dp * S_pad, V], raw; an embedding server's: zeros [dp * S_pad, 1]), their
    log-sum-exp ``lse`` (float32[dp * S_pad]) and ``hidden`` (float32[dp * T_pad, hidden]) are the whole step's, on
    device until asked: this rank's rows start at ``seq_offset`` and ``token_offset``."""

    next_token_ids: np.ndarray
    next_token_logprobs: np.ndarray
    logits: jax.Array
    lse: jax.Array
    hidden: jax.Array
    seq_offset: int = 0
    token_offset: int = 0
    routed_experts: Optional[np.ndarray] = None  # int32[n, L, k]: each sampled token's experts (-1: dense layer)
    aux: Optional[jax.Array] = None  # EAGLE-3: the captured layers' outputs [dp * T_pad, n * hidden] (on device)

    def logprob_rows(self) -> np.ndarray:
        """float32[dp * S_pad, V] on the host: the log-softmax of the raw logits of every row of the step (copies the
        whole step's logits; for top-logprobs and token-id logprobs)."""
        return np.asarray(self.logits) - np.asarray(self.lse)[:, None]


class PendingStep:
    """A launched step whose results are still on the device (`ModelRunner.launch_ranks`): its sampled ids and their
    logprobs are being copied to the host; `resolve` waits for them and splits them per rank.

    Args:
        arrays: the step's outputs (next_ids int32[dp * S_pad], next_lp float32[dp * S_pad], (logits, lse) (see
            StepOutput), hidden, expert counts, routed experts, aux hidden states or None).
        num_seqs: real sampling rows per rank (None: the rank idled: sequences, or tokens in a verify step); s_pad:
            sampling rows per rank, t_pad: tokens per rank.
        moe_stats: the runner's `MoeStats` (counts are added at resolve), or None; routed: whether routed experts
            are returned.
    """

    def __init__(self, arrays: tuple, num_seqs: List[Optional[int]], s_pad: int, t_pad: int, moe_stats, routed: bool):
        self.arrays, self.num_seqs, self.s_pad, self.t_pad = arrays, num_seqs, s_pad, t_pad
        self.moe_stats, self.routed = moe_stats, routed
        next_ids, next_lp, _, _, counts, rows, _ = arrays
        for x in (next_ids, next_lp) + ((counts,) if moe_stats is not None else ()) + ((rows,) if routed else ()):
            x.copy_to_host_async()

    def resolve(self) -> List[Optional[StepOutput]]:
        """Wait for the step and return one StepOutput per rank (None for idle ranks)."""
        next_ids, next_lp, (logits, lse), hidden, counts, routed, aux = self.arrays
        next_ids, next_lp = np.asarray(next_ids), np.asarray(next_lp)
        if self.moe_stats is not None:
            self.moe_stats.add_step(np.asarray(counts))
        routed = np.asarray(routed) if self.routed else None
        outs = []
        for r, n in enumerate(self.num_seqs):
            if n is None:
                outs.append(None)
                continue
            a = r * self.s_pad
            outs.append(StepOutput(next_ids[a:a + n], next_lp[a:a + n], logits, lse, hidden, seq_offset=a,
                                   token_offset=r * self.t_pad,
                                   routed_experts=None if routed is None else routed[a:a + n], aux=aux))
        return outs


@dataclasses.dataclass
class LaunchedForward:
    """A step whose forward program is dispatched and whose sampling is not (`ModelRunner.launch_forward`).

    logits: float32[dp * S_pad, V] on device (see StepOutput); hidden, moe: the forward's other outputs (see
    StepOutput); sampling: the rank-stacked SamplingBatch (host arrays; its vocab mask None when no row has a
    grammar or the scheduler fills the masks later); num_seqs: real sampling rows per rank (None: idle); s_pad:
    sampling rows per rank (`ModelWorkerBatch.rows_pad`: S_pad, T_pad in a verify step), t_pad: tokens per rank;
    batch: one real rank batch (named when a compile is reported); aux: the captured layers' outputs (EAGLE-3) or
    None.
    """

    logits: jax.Array
    hidden: jax.Array
    moe: tuple
    sampling: SamplingBatch
    num_seqs: List[Optional[int]]
    s_pad: int
    t_pad: int
    batch: ModelWorkerBatch
    aux: Optional[jax.Array] = None


def _pad_rows(rows: np.ndarray, n: int) -> np.ndarray:
    """rows [r, hidden] zero-padded to [n, hidden] (r <= n), so one compiled program serves any r."""
    out = np.zeros((n, rows.shape[1]), rows.dtype)
    out[:len(rows)] = rows
    return out


class ModelRunner:
    """Owns the model on device and runs steps.

    Data-parallel attention ranks (``--dp-size`` D): every rank has its own block of KV pages (page 0 of
    each block is that rank's padding sink; page indices and KV slots are local to the block) and its own
    ``num_request_slots`` penalty-state rows. A step runs all ranks at once: `forward_ranks` takes one batch
    per rank (None: the rank idles and runs padding), all padded to the same shape, and one compiled program
    serves every combination.

    Args:
        server_args: `ServerArgs`.
        model_config: `ModelConfig`.
        buckets: the compiled shapes (per rank).
        max_context_len: tokens per sequence (sizes the page table width).
        kv_spec_fn: weight bytes -> the `KVCacheSpec` of one rank's KV buffers (mem_cache/kv_memory.plan_kv_cache:
            pools, their usable tokens, the pool of each layer; page 0 of every pool is added on top as the
            padding sink). Called once the weights are loaded, so it can size the pools from what is left.
        num_request_slots: ReqToTokenPool rows of one rank.
        aux_layers: layer ids whose outputs every forward also returns (`StepOutput.aux`: an EAGLE-3 head's input,
            `models.llama.run_layers`); empty: none.
    """

    def __init__(self, server_args, model_config, *, buckets: ShapeBuckets, max_context_len: int,
                 kv_spec_fn, num_request_slots: int = 1, aux_layers: Tuple[int, ...] = ()):
        compile_counts()  # start counting compilations (warm-up reports them; serving must not add any)
        self.server_args = server_args
        self.aux_layers = tuple(sorted(aux_layers))
        self.model_config = model_config
        self.buckets = buckets
        self.page_size = server_args.page_size
        self.attention_backend = resolve_attention_backend(server_args.attention_backend, jax.default_backend())
        logger.info("Attention backend: %s (--attention-backend %s on %s)",
                    describe_attention(self.attention_backend), server_args.attention_backend, jax.default_backend())
        hf = model_config.hf_config
        check_tp(model_config.num_attention_heads, model_config.num_key_value_heads, model_config.vocab_size,
                 int(getattr(hf, "intermediate_size", server_args.tp_size)), server_args.tp_size)
        self.mesh = create_mesh(server_args.tp_size, server_args.dp_size, server_args.device_indexes)
        self.tp_size = tp_size_of(self.mesh)
        self.dp_size = int(self.mesh.shape["data"])
        self.num_request_slots = num_request_slots
        self._replicated = NamedSharding(self.mesh, REPLICATED)
        self._kv_sharding = NamedSharding(self.mesh, KV_CACHE)
        self._rank_rows = NamedSharding(self.mesh, RANK_ROWS)
        if self.tp_size > 1 or self.dp_size > 1:
            logger.info("Mesh: %d data-parallel ranks x %d tensor-parallel devices %s", self.dp_size, self.tp_size,
                        [d.id for d in self.mesh.devices.flat])
        self.graphdef, self.params = load_model(model_config, server_args.load_format, server_args.random_seed,
                                                mesh=self.mesh)
        # bytes of weights on one device, as stored (int8/fp8 plus scales when quantized): sizes the KV pool
        self.weight_bytes = weight_bytes = sum(x.addressable_shards[0].data.nbytes
                                               for x in jax.tree.leaves(self.params))
        model = nnx.merge(self.graphdef, self.params)
        routing = getattr(model, "moe_routing", lambda: None)()
        # an encoder reads token types and a rows plan in every step, on one rank; a cross-encoder classifies
        self.is_encoder = bool(getattr(model, "is_encoder", False))
        if self.is_encoder and self.dp_size > 1:  # (ModelConfig refuses it first)
            raise ValueError("an encoder runs on one data-parallel rank (--dp-size 1)")
        self.num_labels = int(getattr(model, "num_labels", 0))
        # an embedding server (--is-embedding, or a model with no LM head) never decodes: no decode programs
        self.generates = not server_args.is_embedding and bool(getattr(model, "has_lm_head", True))
        self.moe_stats = None if routing is None else MoeStats(
            model_config.num_hidden_layers, routing[0], routing[2], ep_size=getattr(model_config, "ep_size", 1))
        self.return_routed_experts = routing is not None and bool(server_args.enable_return_routed_experts)
        self.lora_writer = None  # LoRA adapter slots (model_executor/lora_weights.py), with --enable-lora
        if model_config.lora is not None:
            if routing is not None or self.is_encoder or not self.generates:
                raise ValueError(f"--enable-lora serves dense decoder language models; {model_config.architecture} "
                                 "is not one")
            self.lora_writer = LoraSlotWriter(self, model_config.num_key_value_heads,
                                              padded_kv_heads(model_config.num_key_value_heads, self.tp_size))
            logger.info("LoRA: %d adapter slots of rank %d for %s, %.1f MiB per device (in the weights' budget)",
                        model_config.lora.slots, model_config.lora.rank, ", ".join(model_config.lora.targets),
                        self.lora_writer.slot_bytes * model_config.lora.slots / 2**20)
        self.kv_spec = spec = kv_spec_fn(weight_bytes)
        if spec.page_size != self.page_size or len(spec.layer_pool) != model_config.num_hidden_layers:
            raise ValueError(f"the KV spec ({spec}) does not match --page-size {self.page_size} and "
                             f"{model_config.num_hidden_layers} layers")
        self.max_total_tokens = spec.pool_tokens[0]  # tokens of a rank's first (full-attention) pool
        self.pages_per_seq = math.ceil(max_context_len / self.page_size)
        dtype = kv_cache_dtype(model_config, server_args.kv_cache_dtype)
        self.kv_cache_dtype = jnp.dtype(dtype)
        if (self.attention_backend == "pallas" and self.kv_cache_dtype != jnp.dtype(JNP_DTYPES[model_config.dtype])
                and server_args.kv_cache_dtype not in FP8_KV_DTYPES):  # (fp8 pages are widened in the kernels)
            raise ValueError(f"--kv-cache-dtype {server_args.kv_cache_dtype} differs from the model's dtype "
                             f"({model_config.dtype}); the pallas attention kernels need them equal (or an fp8 "
                             f"cache): pass --attention-backend native or --dtype {self.kv_cache_dtype.name}")
        self._kv_layout = (spec, padded_kv_heads(model_config.num_key_value_heads, self.tp_size),
                           model_config.head_dim, dtype)
        self._kv_alloc_programs = {}  # pages -> its jitted allocation (compiled here, reused by allocate_kv)
        self.kv_caches = self.allocate_kv()
        kv_bytes = sum(k.nbytes + v.nbytes for k, v in self.kv_caches) / self.tp_size / self.dp_size
        logger.info("KV cache: %s, %s, per rank (%.2f GiB per device)", spec.describe(), self.kv_cache_dtype.name,
                    kv_bytes / 2**30)
        # the host tier's copy programs (--enable-hierarchical-cache; model_executor/host_kv.py)
        self.host_kv_copies = HostKVCopies(self.mesh, self._kv_sharding, self.dp_size, len(spec.layer_pool),
                                           *self._kv_layout[1:]) if server_args.enable_hierarchical_cache else None
        eos = model_config.eos_token_ids or [model_config.vocab_size]  # out of range -> no-op mask
        self.eos_token_ids = jnp.asarray(eos, jnp.int32)
        self.max_context_len = max_context_len
        self.vocab_mask_width = vocab_mask_words(model_config.vocab_size)
        self.penalty_state = jax.jit(lambda: new_penalty_state(self.dp_size * num_request_slots,
                                                               model_config.vocab_size),
                                     out_shardings=self._replicated)()
        # the overlap scheduler's sampled tokens, one per stacked request slot (model_executor/future_tokens.py)
        self.future_tokens = jax.jit(lambda: new_future_tokens(self.dp_size * num_request_slots),
                                     out_shardings=self._replicated)()
        self._all_allowed = {}  # S_pad -> device int32[S_pad, vocab_mask_width] of -1 (no grammar in the batch)
        self._zero_samples = {}  # rows -> an embedding step's (token ids, logprobs, lse): zeros
        # outputs fed back into the next call keep exactly the shardings they were created with, so a
        # program compiled at warm-up is the one serving uses (a new input sharding would compile again)
        r = self._replicated
        # hidden states stay with their rank, unless ranks span hosts (then every host reads them all)
        hidden = NamedSharding(self.mesh, P("data", None)) if jax.process_count() == 1 else r
        self._hidden_sharding = hidden
        self._forward = jax.jit(self._forward_impl, donate_argnums=(1,), static_argnums=(4,),
                                out_shardings=(self._kv_sharding, r, hidden, (r, r), hidden if self.aux_layers else r))
        self._sample = jax.jit(self._sample_impl, donate_argnums=(1, 2), static_argnums=(5,),
                               out_shardings=(r, r, r, r, r))
        self._init_penalty_row = jax.jit(init_penalty_row, donate_argnums=(0,), out_shardings=r)
        # the K/V move program's sizes: one per verify shape's T_pad (move_kv), sorted
        self._move_sizes = sorted(t for mode, t, _ in buckets.all_shapes() if mode == ForwardMode.TARGET_VERIFY)
        self._move_kv = jax.jit(functools.partial(move_kv_slots, mesh=self.mesh), donate_argnums=(0,),
                                out_shardings=self._kv_sharding)
        self._logprobs = jax.jit(self._logprobs_impl)
        self._label_logprobs = jax.jit(self._label_logprobs_impl)
        self._classify = jax.jit(self._classify_impl)
        self._compiled_after_warmup: Optional[int] = None
        self._num_compiles_after_warmup = 0
        self.faults = PlantedFaults.from_env()  # test hooks (fault_injection.py); none outside tests
        self.warmup_stats: Dict[str, float] = {}  # what warm-up compiled and loaded (see warmup)

    @functools.cached_property
    def logits_vocab(self) -> int:
        """Logits columns (the LM head's rows), from the abstract logprob program."""
        return jax.eval_shape(self._logprobs_impl, self.params, jax.ShapeDtypeStruct(
            (1, self.model_config.hidden_size), JNP_DTYPES[self.model_config.dtype])).shape[-1]

    # ---- compiled functions
    def allocate_kv(self) -> list:
        """Zeroed (K, V) device buffers per layer, [dp * (pages + 1), page_size, kv_heads, head_dim] each, of the
        pool the KV spec gives the layer (every rank's block holds its padding page 0), sharded by KV_CACHE. One
        compiled allocation per buffer shape, kept: a later call (resume_memory_occupation) compiles nothing."""
        spec, kv_heads, head_dim, dtype = self._kv_layout
        programs = self._kv_alloc_programs

        def zeros(pages):
            if pages not in programs:
                shape = (self.dp_size * (pages + 1), self.page_size, kv_heads, head_dim)
                programs[pages] = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=self._kv_sharding)
            return programs[pages]()

        pages = [spec.pool_pages(pool) for pool in spec.layer_pool]
        return [(zeros(n), zeros(n)) for n in pages]

    @property
    def params(self):
        """The model's parameters (an nnx State on device)."""
        return self._params

    @params.setter
    def params(self, value) -> None:
        # the step takes the flat list of leaves: flattening an nnx State in Python cost ~0.4 ms a call
        self._params = value
        self._param_leaves, self._param_treedef = jax.tree.flatten(value)

    def _forward_impl(self, param_leaves, kv_caches, future, packed, layout):
        """The forward program (see the module docstring). param_leaves: `params` flattened; future: the
        future-token buffer (read: placeholders of tokens the step before is sampling); packed / layout: the step's
        ForwardBatch as one int32 buffer (model_executor/packed_inputs.py). Returns (kv_caches, logits float32[S, V]
        gathered (an embedding server's: zeros [S, 1]), hidden, MoE outputs, the aux hidden states [T, n * hidden]
        of `aux_layers` (else an empty array))."""
        params = jax.tree.unflatten(self._param_treedef, param_leaves)
        fb = unpack(packed, layout)
        fb = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, self._rank_rows), fb)  # (rows by rank)
        model = nnx.merge(self.graphdef, params)
        # trace-time backend; placeholders of tokens the previous step sampled read from the future buffer
        fb = dataclasses.replace(fb, attention_backend=self.attention_backend,
                                 input_ids=resolve_placeholders(fb.input_ids, future))
        if self.aux_layers:
            model.model.capture_layers = self.aux_layers
        hidden, kv_caches = model(fb, kv_caches)
        if self.generates:
            logits = self._gathered(model.compute_logits(hidden[fb.logits_indices]))
        else:  # an embedding server reads hidden states only: no LM head, no sampling (`launch_sample`)
            logits = jnp.zeros((fb.logits_indices.shape[0], 1), jnp.float32)
        aux = sown_aux_hidden_states(model.model) if self.aux_layers else jnp.zeros((0,), hidden.dtype)
        return kv_caches, logits, hidden, self._moe_outputs(model, fb), aux

    def _sample_impl(self, logits, penalty_state, future, packed, vocab_mask, layout):
        """The sampling program: logits float32[S, V] from the forward; packed / layout: the SamplingBatch
        without its vocab mask; vocab_mask: int32[S, words]. Returns (penalty_state, future, next_ids int32[S],
        next_lp float32[S], lse float32[S])."""
        sampling = dataclasses.replace(unpack(packed, layout), vocab_mask=vocab_mask)
        sampling = dataclasses.replace(sampling, last_token=resolve_placeholders(sampling.last_token, future))
        next_ids, lse, penalty_state = sample(logits, sampling, self.eos_token_ids, penalty_state)
        future = write_future(future, sampling.slots, sampling.writes_future, next_ids)
        next_lp = jnp.take_along_axis(logits, next_ids[:, None], axis=-1)[:, 0] - lse
        return penalty_state, future, next_ids, next_lp, lse

    def _moe_outputs(self, model, fb: ForwardBatch):
        """(expert token counts int32[L, E] of the step's real tokens (`ForwardBatch.real_tokens`), the expert ids
        int32[S, L, k] of the rows whose logits were sampled when --enable-return-routed-experts), empty arrays
        for what is not collected."""
        none = jnp.zeros((0,), jnp.int32)
        if self.moe_stats is None:
            return none, none
        routed = model.routed_experts()  # [L, T, k]
        counts = expert_token_counts(routed, fb.real_tokens(), self.moe_stats.num_experts)
        rows = jnp.transpose(routed[:, fb.logits_indices], (1, 0, 2)) if self.return_routed_experts else none
        return counts, rows

    def _logprobs_impl(self, params, hidden):
        model = nnx.merge(self.graphdef, params)
        return jax.nn.log_softmax(self._gathered(model.compute_logits(hidden)), axis=-1)

    def _label_logprobs_impl(self, params, hidden, label_ids):
        model = nnx.merge(self.graphdef, params)
        logits = self._gathered(model.compute_logits(hidden))
        lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        return jnp.take(logits, label_ids, axis=1) - lse

    def _gathered(self, logits: jax.Array) -> jax.Array:
        """Vocab-parallel logits gathered onto every device (replicated) before sampling."""
        return jax.lax.with_sharding_constraint(logits, self._replicated)

    # ---- running
    def _all_allowed_mask(self, s_pad: int) -> jax.Array:
        """The cached device int32[s_pad, words] of -1 (every token allowed) for `s_pad` sampling rows."""
        if s_pad not in self._all_allowed:
            self._all_allowed[s_pad] = jax.device_put(all_allowed_mask(s_pad, self.vocab_mask_width),
                                                      self._replicated)
        return self._all_allowed[s_pad]

    def _forward_inputs(self, fb: ForwardBatch) -> tuple:
        """(the ForwardBatch packed into one int32 buffer on device, replicated -- the program puts its rows back by
        rank --, its packed layout: the forward program's static argument)."""
        buf, layout = pack(fb)
        return jax.device_put(buf, self._replicated), layout

    def _sample_inputs(self, sampling: SamplingBatch, vocab_mask: Optional[np.ndarray] = None) -> tuple:
        """(the SamplingBatch without its vocab mask packed on device, the vocab mask on device -- `vocab_mask`, else
        the batch's own, else the cached all-allowed mask of its size --, the packed layout)."""
        mask = vocab_mask if vocab_mask is not None else sampling.vocab_mask
        rows = int(np.shape(sampling.slots)[0])
        mask = self._all_allowed_mask(rows) if mask is None else jax.device_put(np.asarray(mask), self._replicated)
        buf, layout = pack(dataclasses.replace(sampling, vocab_mask=None))
        return jax.device_put(buf, self._replicated), mask, layout

    def _step_batch(self, batches: Sequence[Optional[ModelWorkerBatch]]) -> ModelWorkerBatch:
        """The rank-stacked batch of one step (`stack_ranks`): idle ranks (None) run an all-padding batch of the
        real batches' padded shape."""
        mode, t_pad, s_pad = next(b for b in batches if b is not None).padded_shape
        full = [self._model_inputs(b if b is not None else self.dummy_batch(mode, t_pad, s_pad)) for b in batches]
        return stack_ranks(full, self.num_request_slots)

    def _model_inputs(self, batch: ModelWorkerBatch) -> ModelWorkerBatch:
        """`batch` with the optional fields as the model takes them, so that one compiled program serves every step:
        with LoRA slots, each token's slot (-1, none, where the batch has no ``lora_ids``); an encoder's fields
        (layers/encoder_attention.with_encoder_inputs), none for any other model."""
        fb = batch.forward_batch
        if (self.lora_writer is not None) != (fb.lora_ids is not None):
            ids = None if self.lora_writer is None else np.full(np.shape(fb.input_ids), -1, np.int32)
            fb = dataclasses.replace(fb, lora_ids=ids)
            batch = dataclasses.replace(batch, forward_batch=fb)
        if self.is_encoder:
            return dataclasses.replace(batch, forward_batch=with_encoder_inputs(fb))
        if fb.token_type_ids is None:
            return batch
        return dataclasses.replace(batch, forward_batch=dataclasses.replace(fb, token_type_ids=None))

    def forward(self, batch: ModelWorkerBatch) -> StepOutput:
        """Run one step of `batch` on rank 0 (the other ranks idle). The KV cache is updated in place."""
        return self.forward_ranks([batch] + [None] * (self.dp_size - 1))[0]

    def forward_ranks(self, batches: Sequence[Optional[ModelWorkerBatch]]) -> List[Optional[StepOutput]]:
        """Run one step of every rank: ``batches[r]`` is rank r's batch (None: idle), all of one padded shape.

        Returns one StepOutput per rank (None for idle ranks). Raises ValueError when the batches' shapes
        differ or their number is not the dp size.
        """
        return self.launch_ranks(batches).resolve()

    def launch_ranks(self, batches: Sequence[Optional[ModelWorkerBatch]]) -> PendingStep:
        """Dispatch one step of every rank (as `forward_ranks`) without waiting for it: the device runs it after
        the steps launched before (the KV cache, penalty state and future tokens are donated from one step to the
        next), the host goes on. Raises ValueError as `forward_ranks`."""
        return self.launch_sample(self.launch_forward(batches))

    def launch_forward(self, batches: Sequence[Optional[ModelWorkerBatch]]) -> "LaunchedForward":
        """Dispatch the forward program of one step of every rank (see `launch_ranks`); `launch_sample` dispatches
        its sampling, with the batches' vocab masks or masks filled in the meantime. Raises ValueError as
        `forward_ranks`."""
        if len(batches) != self.dp_size:
            raise ValueError(f"{len(batches)} rank batches for --dp-size {self.dp_size}")
        real = [b for b in batches if b is not None]
        if not real:
            raise ValueError("a step needs at least one rank batch")
        _, t_pad, _ = real[0].padded_shape
        stacked = self._step_batch(batches)
        self.kv_caches, logits, hidden, moe, aux = self._forward(
            self._param_leaves, self.kv_caches, self.future_tokens, *self._forward_inputs(stacked.forward_batch))
        self._check_no_new_compile(real[0])
        return LaunchedForward(logits, hidden, moe, stacked.sampling,
                               [None if b is None else b.num_rows for b in batches], real[0].rows_pad, t_pad,
                               real[0], aux if self.aux_layers else None)

    def launch_sample(self, fwd: "LaunchedForward", vocab_mask: Optional[np.ndarray] = None) -> PendingStep:
        """Dispatch the sampling program of a launched forward. vocab_mask: int32[dp * S_pad, words] of the stacked
        rows (`stack_vocab_masks`), or None for the batches' own masks (all allowed when they have none). An
        embedding server's steps sample nothing: their token ids and logprobs are zeros (no program runs)."""
        if self.generates:
            self.penalty_state, self.future_tokens, next_ids, next_lp, lse = self._sample(
                fwd.logits, self.penalty_state, self.future_tokens, *self._sample_inputs(fwd.sampling, vocab_mask))
        else:  # zeros put on the device once per row count
            if (rows := int(fwd.logits.shape[0])) not in self._zero_samples:
                lp = jax.device_put(np.zeros(rows, np.float32), self._replicated)
                self._zero_samples[rows] = (jax.device_put(np.zeros(rows, np.int32), self._replicated), lp, lp)
            next_ids, next_lp, lse = self._zero_samples[rows]
        if self._compiled_after_warmup is not None and self.faults.fire("compile_while_serving"):
            jax.jit(lambda x: x * 3.0 + 1.0)(np.zeros(7, np.float32)).block_until_ready()  # a planted fault
        self._check_no_new_compile(fwd.batch)
        counts, routed = fwd.moe
        return PendingStep((next_ids, next_lp, (fwd.logits, lse), fwd.hidden, counts, routed, fwd.aux),
                           fwd.num_seqs, fwd.s_pad, fwd.t_pad, self.moe_stats, self.return_routed_experts)

    def device_seconds_per_step(self, batch: ModelWorkerBatch, repeats: int, sample: bool = True) -> float:
        """Seconds the device takes per step of `batch` (rank 0), host work excluded: its inputs are put on the device
        once, the step (forward, and sampling unless `sample` is False) is dispatched `repeats` times back to back
        without reading a result, then waited for once. Re-running a step rewrites the same KV slots with the same
        values; its sampled ids are dropped (benchmarks only: the penalty rows of its sequences count its tokens
        again). Compares with a loop's wall time per step to give the host's gap (bench_one_batch); times the
        programs for speculation's batch rule (scheduler/spec_costs.py)."""
        stacked = self._step_batch([batch] + [None] * (self.dp_size - 1))
        fwd_inputs = self._forward_inputs(stacked.forward_batch)
        sample = sample and self.generates
        sample_inputs = self._sample_inputs(stacked.sampling) if sample else None
        jax.block_until_ready(self.kv_caches)
        t0 = time.perf_counter()
        for _ in range(repeats):
            self.kv_caches, out, *_ = self._forward(self._param_leaves, self.kv_caches, self.future_tokens,
                                                    *fwd_inputs)
            if sample:
                self.penalty_state, self.future_tokens, out, *_ = self._sample(
                    out, self.penalty_state, self.future_tokens, *sample_inputs)
        jax.block_until_ready((self.kv_caches, out))
        return (time.perf_counter() - t0) / repeats

    def move_kv(self, moves: Sequence[Tuple[np.ndarray, np.ndarray]]) -> None:
        """Copy K/V between slots of every layer, on device after the steps launched before (speculative
        decoding: the accepted draft slots of a verify step to the positions they end at, `layers.attention.
        move_kv_slots`). moves: per rank (src, dst) int32 arrays of rank-local slots; they are padded with the
        padding slot 0 to the smallest verify step's T_pad that holds them (one compiled program per verify shape).

        Raises:
            ValueError: more moves than a verify step has slots, or no verify shapes (no speculative decoding)."""
        n = max(len(a) for a, _ in moves)
        m = next((t for t in self._move_sizes if t >= n), None)
        if m is None:
            raise ValueError(f"{n} KV moves exceed every verify shape ({self._move_sizes})")
        src = np.zeros((self.dp_size, m), np.int32)
        dst = np.zeros((self.dp_size, m), np.int32)
        for r, (a, b) in enumerate(moves):
            src[r, :len(a)], dst[r, :len(b)] = a, b
        put = lambda x: jax.device_put(x.reshape(-1), self._replicated)  # noqa: E731
        self.kv_caches = self._move_kv(self.kv_caches, put(src), put(dst))
        self._check_no_new_compile(None)

    @property
    def host_kv_bytes_per_token(self) -> int:
        """Bytes of K and V of every layer and head (tensor-parallel padding included) of one token: what a host
        KV slot takes."""
        _, kv_heads, head_dim, dtype = self._kv_layout
        return 2 * len(self.kv_spec.layer_pool) * kv_heads * head_dim * jnp.dtype(dtype).itemsize

    def read_kv_slots(self, rank: int, slots: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """K and V of rank `rank`'s KV slots (int32[n], local to its block) for the host tier: numpy [layers, n,
        kv_heads, head_dim] each, read after the steps launched before (`host_kv.HostKVCopies.read`)."""
        out = self.host_kv_copies.read(self.kv_caches, rank, slots)
        self._check_no_new_compile(None)
        return out

    def write_kv_slots(self, rank: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Set rank `rank`'s KV slots (int32[n]) of every layer to k, v (`read_kv_slots`' layout), on device after
        the steps launched before and before any launched after."""
        self.kv_caches = self.host_kv_copies.write(self.kv_caches, rank, slots, k, v)
        self._check_no_new_compile(None)

    def init_penalty_row(self, slot: int, token_ids: List[int], num_prompt: int,
                         logit_bias: Optional[Dict[int, float]]) -> None:
        """Load a request's history (prompt + output so far, `num_prompt` of them prompt) and logit_bias
        into penalty-state row `slot` (see layers/sampler.PenaltyState; rank r's slot s is row
        ``r * num_request_slots + s``). One compiled program for any
        request: the ids are padded to the context length."""
        ids = np.zeros(self.max_context_len, np.int32)
        n = min(len(token_ids), self.max_context_len)
        ids[:n] = token_ids[:n]
        bias = np.zeros(self.model_config.vocab_size, np.float32)
        for t, v in (logit_bias or {}).items():
            bias[t] = v
        self.penalty_state = self._init_penalty_row(self.penalty_state, np.int32(slot), ids, np.int32(num_prompt),
                                                    np.int32(n), bias)
        self._check_no_new_compile(None)

    def kv_cache_lost(self) -> bool:
        """Whether the KV cache or penalty-state buffers are gone (a step failed after they were donated to
        it): shared state is lost and the scheduler must not go on."""
        state = (self.kv_caches, self.penalty_state, self.future_tokens)
        return any(leaf.is_deleted() for leaf in jax.tree.leaves(state))

    def full_logprobs(self, hidden_rows: np.ndarray) -> np.ndarray:
        """float32[N, V] log-softmax of the logits of N hidden states (input-token logprobs).

        Runs in fixed chunks of LOGPROB_CHUNK_ROWS rows so a single compiled program serves any N.
        """
        out = []
        for i in range(0, len(hidden_rows), LOGPROB_CHUNK_ROWS):
            chunk = hidden_rows[i:i + LOGPROB_CHUNK_ROWS]
            out.append(np.asarray(self._logprobs(self.params, _pad_rows(chunk, LOGPROB_CHUNK_ROWS)))[:len(chunk)])
            self._check_no_new_compile(None)
        if not out:
            return np.zeros((0, self.model_config.vocab_size), np.float32)
        return np.concatenate(out)

    def label_logprobs(self, hidden_rows: np.ndarray, label_ids) -> np.ndarray:
        """float32[N, L]: log-softmax over the full vocabulary of N hidden states' logits, at L label ids.

        Rows go in chunks padded to SCORE_ROW_PADDINGS and labels in chunks of SCORE_LABEL_CHUNK, so two
        compiled programs serve any N and L.
        """
        label_ids = np.asarray(label_ids, np.int32)
        out = np.zeros((len(hidden_rows), len(label_ids)), np.float32)
        big = SCORE_ROW_PADDINGS[-1]
        for i in range(0, len(hidden_rows), big):
            chunk = hidden_rows[i:i + big]
            rows = _pad_rows(chunk, next(r for r in SCORE_ROW_PADDINGS if r >= len(chunk)))
            for j in range(0, len(label_ids), SCORE_LABEL_CHUNK):
                labels = np.zeros(SCORE_LABEL_CHUNK, np.int32)
                part = label_ids[j:j + SCORE_LABEL_CHUNK]
                labels[:len(part)] = part
                res = np.asarray(self._label_logprobs(self.params, rows, labels))
                out[i:i + len(chunk), j:j + len(part)] = res[:len(chunk), :len(part)]
                self._check_no_new_compile(None)
        return out

    def classify(self, first_rows: np.ndarray) -> np.ndarray:
        """float32[N, num_labels]: a sequence-classification model's head (models/bert.py `classify`) on N
        pooled final hidden states [N, hidden], in chunks padded to SCORE_ROW_PADDINGS (compiled at warm-up)."""
        out = []
        big = SCORE_ROW_PADDINGS[-1]
        first_rows = np.asarray(first_rows).astype(JNP_DTYPES[self.model_config.dtype])  # (warm-up's dtype)
        for i in range(0, len(first_rows), big):
            chunk = first_rows[i:i + big]
            rows = _pad_rows(chunk, next(r for r in SCORE_ROW_PADDINGS if r >= len(chunk)))
            out.append(np.asarray(self._classify(self.params, rows))[:len(chunk)])
            self._check_no_new_compile(None)
        return np.concatenate(out) if out else np.zeros((0, self.num_labels), np.float32)

    def _classify_impl(self, params, rows):
        return nnx.merge(self.graphdef, params).classify(rows)

    @property
    def num_compiles_after_warmup(self) -> Optional[int]:
        """Programs compiled (or loaded from the persistent cache) since warm-up ended; None when compiles are
        not counted (no warm-up ran: --disable-precompile)."""
        return None if self._compiled_after_warmup is None else self._num_compiles_after_warmup

    def _check_no_new_compile(self, batch: Optional[ModelWorkerBatch]) -> None:
        """Count (and warn about) any program the process handed to XLA since warm-up ended."""
        if self._compiled_after_warmup is None:
            return
        programs = compile_counts().programs
        if programs > self._compiled_after_warmup:
            self._num_compiles_after_warmup += programs - self._compiled_after_warmup
            self._compiled_after_warmup = programs
            shape = batch.padded_shape if batch is not None else "logprob/penalty program"
            logger.warning("Compiled a new program while serving (%s); add the shape to the precompile "
                           "paddings", shape)

    def restart_compile_count(self) -> None:
        """Count compiles from now on (another runner of the process warmed up after this one)."""
        if self._compiled_after_warmup is not None:
            self._compiled_after_warmup = compile_counts().programs

    # ---- warm-up
    def dummy_batch(self, mode: ForwardMode, t_pad: int, s_pad: int) -> ModelWorkerBatch:
        """An all-padding batch of the given padded shape (num_seqs = 0; writes only the padding page)."""
        fb = ForwardBatch.padding(mode, t_pad, s_pad, self.pages_per_seq, num_pools=self.kv_spec.num_pools)
        rows = t_pad if mode == ForwardMode.TARGET_VERIFY else s_pad  # (a verify step samples every token)
        return ModelWorkerBatch(forward_batch=fb, sampling=SamplingBatch.padding(rows), num_tokens=0, num_seqs=0)

    def warmup_programs(self) -> List[Tuple[str, object]]:
        """(name, thunk returning the lowered program) of every program serving runs: each bucket's step, the
        sampling per row count, the K/V moves per verify shape, the LoRA slot writes, the host tier's KV copies, the
        logprob, label-logprob and penalty-row programs."""
        shapes = self.buckets.all_shapes()
        if not self.generates:  # (an embedding server's steps are all extends)
            shapes = [(mode, t, s) for mode, t, s in shapes if mode == ForwardMode.EXTEND]
        hidden_dim = self.model_config.hidden_size
        dtype = np.dtype(JNP_DTYPES[self.model_config.dtype])
        programs = [(f"{mode.name.lower()} T={t} S={s}", self._lower_step(mode, t, s)) for mode, t, s in shapes]
        rows = sorted({t if mode == ForwardMode.TARGET_VERIFY else s for mode, t, s in shapes})
        programs += [(f"sampling S={s}", self._lower_sample(s)) for s in rows if self.generates]
        programs += [(f"KV move M={t}", self._lower_move(t)) for mode, t, _ in shapes
                     if mode == ForwardMode.TARGET_VERIFY]
        programs += self.lora_writer.warmup_programs() if self.lora_writer is not None else []
        if self.host_kv_copies is not None:
            programs += self.host_kv_copies.warmup_programs(lambda: self.kv_caches)
        if not self.generates:
            return programs + [(f"classify R={r}", lambda r=r: self._classify.lower(
                self.params, np.zeros((r, hidden_dim), dtype))) for r in SCORE_ROW_PADDINGS if self.num_labels]
        programs.append((f"input logprobs R={LOGPROB_CHUNK_ROWS}", lambda: self._logprobs.lower(
            self.params, np.zeros((LOGPROB_CHUNK_ROWS, hidden_dim), dtype))))
        programs.append(("penalty row", lambda: self._init_penalty_row.lower(
            self.penalty_state, np.int32(0), np.zeros(self.max_context_len, np.int32), np.int32(0), np.int32(0),
            np.zeros(self.model_config.vocab_size, np.float32))))
        for r in SCORE_ROW_PADDINGS:
            programs.append((f"label logprobs R={r}", lambda r=r: self._label_logprobs.lower(
                self.params, np.zeros((r, hidden_dim), dtype), np.zeros(SCORE_LABEL_CHUNK, np.int32))))
        return programs

    def warmup(self) -> None:
        """Compile every program of `warmup_programs` ahead of time (``jit(...).lower(...).compile()``: nothing
        runs), with a progress bar and one log line per program saying whether XLA compiled it or it was loaded from
        the persistent compilation cache.

        Serving then finds each program in jit's in-memory cache; any later compile is counted in
        ``num_compiles_after_warmup`` (see compile_stats).
        """
        programs = self.warmup_programs()
        t0, start = time.time(), compile_counts()
        # tracing is Python (one thread); XLA compiles (or loads) off the GIL: trace the next program while the
        # previous ones compile, on as many threads as the host has cores (at least 2)
        workers = max(2, min(8, os.cpu_count() or 2))
        with tqdm(total=len(programs), desc="Compiling buckets", unit="shape") as bar, \
                concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compile") as pool:
            def compile_one(name, lowered, traced_s):
                t1, before = time.time(), compile_counts(this_thread=True)
                lowered.compile()
                logger.info("Bucket %s: %s in %.1f s (traced in %.1f s)", name,
                            describe(compile_counts(this_thread=True) - before), time.time() - t1, traced_s)
                bar.update()
            futures = []
            for name, lower in programs:
                bar.set_postfix_str(name)
                t1 = time.time()
                lowered = lower()
                futures.append(pool.submit(compile_one, name, lowered, time.time() - t1))
            for f in futures:
                f.result()
        done = compile_counts()
        self._compiled_after_warmup = done.programs
        delta = done - start
        self.warmup_stats = {"programs": len(programs), "compiled": delta.compiled,
                             "loaded_from_cache": delta.cache_hits, "seconds": round(time.time() - t0, 2)}
        logger.info("Warm-up: %d programs in %.1f s (%d compiled, %d loaded from the compilation cache)",
                    len(programs), time.time() - t0, delta.compiled, delta.cache_hits)

    def _lower_step(self, mode: ForwardMode, t_pad: int, s_pad: int):
        """A thunk lowering the forward program of one padded shape with serving's exact inputs (shardings
        included), so the compiled program is the one jit finds when serving."""
        def lower():
            stacked = self._step_batch([self.dummy_batch(mode, t_pad, s_pad)] * self.dp_size)
            return self._forward.lower(self._param_leaves, self.kv_caches, self.future_tokens,
                                       *self._forward_inputs(stacked.forward_batch))
        return lower

    def _lower_move(self, m: int):
        """A thunk lowering the KV move program of `m` slots per rank (`move_kv`)."""
        def lower():
            z = jax.device_put(np.zeros(self.dp_size * m, np.int32), self._replicated)
            return self._move_kv.lower(self.kv_caches, z, z)
        return lower

    def _lower_sample(self, s_pad: int):
        """A thunk lowering the sampling program of `s_pad` rows per rank with serving's exact inputs."""
        def lower():
            sampling = SamplingBatch.stack([SamplingBatch.padding(s_pad)] * self.dp_size, s_pad,
                                           self.num_request_slots)
            logits = jax.ShapeDtypeStruct((self.dp_size * s_pad, self.logits_vocab), jnp.float32,
                                          sharding=self._replicated)
            return self._sample.lower(logits, self.penalty_state, self.future_tokens, *self._sample_inputs(sampling))
        return lower


def setup_jax(server_args) -> str:
    """Apply --device, multi-host start-up (--nnodes) and the persistent compilation cache; return the JAX
    platform name."""
    if server_args.device != "auto":
        jax.config.update("jax_platforms", server_args.device)
    init_distributed(server_args.nnodes, server_args.node_rank, server_args.dist_init_addr)
    if server_args.compilation_cache_dir:
        os.makedirs(server_args.compilation_cache_dir, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", server_args.compilation_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return jax.devices()[0].platform
