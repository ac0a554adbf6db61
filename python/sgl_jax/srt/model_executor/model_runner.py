"""ModelRunner: weights and KV buffers on device, the compiled steps, warm-up compilation of every bucket.

A step is one compiled program (model_executor/step_programs.py): the forward, writing this step's K/V in place (the
cache is a donated argument), and the sampling (penalties, grammar masks, the draw, the future-token write), with
one host-to-device copy of its packed inputs and one asynchronous device-to-host copy of its tokens. Decode steps of
a server with one KV pool read their sequences' page tables and sampling parameters from the device
(model_executor/slot_state.py; `launch_decode`), and may run ``--num-continuous-decode-steps`` steps in one program.
An extend step runs as two programs (`launch_forward`, then `launch_sample`: one sampling program per row count
serves every token bucket); the draft runners use the same two.
"""

from __future__ import annotations

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

from sgl_jax.srt.kernels.ragged_paged_attention.backend import describe as describe_attention, register_kernels
from sgl_jax.srt.distributed.mesh import create_mesh, tp_size_of
from sgl_jax.srt.distributed.multihost import init_distributed
from sgl_jax.srt.distributed.sharding import KV_CACHE, RANK_ROWS, REPLICATED, check_tp, padded_kv_heads

from sgl_jax.srt.layers.attention import move_kv_slots
from sgl_jax.srt.layers.encoder_attention import with_encoder_inputs
from sgl_jax.srt.layers.sampler import init_penalty_row, new_penalty_state
from sgl_jax.srt.model_executor import host_copy, step_programs
from sgl_jax.srt.model_executor.buckets import ShapeBuckets
from sgl_jax.srt.model_executor.compile_stats import compile_counts
from sgl_jax.srt.model_executor.host_kv import HostKVCopies
from sgl_jax.srt.model_executor.kv_allocation import KVAllocation
from sgl_jax.srt.model_executor.lora_weights import LoraSlotWriter
from sgl_jax.srt.model_executor.memory_budget import FP8_KV_DTYPES, NeedsWeightBytes, kv_cache_dtype
from sgl_jax.srt.model_executor.future_tokens import new_future_tokens
from sgl_jax.srt.model_executor.packed_inputs import pack
from sgl_jax.srt.model_executor.program_cache import (CachedProgram, end_prefetch, prefetching, program_cache_for,
                                                      start_prefetch)
from sgl_jax.srt.model_executor.runner_programs import (LOGPROB_CHUNK_ROWS, SCORE_LABEL_CHUNK, SCORE_ROW_PADDINGS,
                                                         serving_programs)
from sgl_jax.srt.model_executor.moe_stats import MoeStats
from sgl_jax.srt.model_executor.slot_state import new_slot_state
from sgl_jax.srt.model_executor.step_output import LaunchedForward, PendingStep, StepOutput, StepTimes
from sgl_jax.srt.model_executor.step_programs import StepSpec
from sgl_jax.srt.model_executor.warmup import compile_programs
from sgl_jax.srt.fault_injection import PlantedFaults
from sgl_jax.srt.forward_batch import DecodeRows, ForwardBatch, ForwardMode, ModelWorkerBatch, stack_ranks
from sgl_jax.srt.sampling.sampling_batch import SamplingBatch, all_allowed_mask, stack_vocab_masks, vocab_mask_words
from sgl_jax.srt.sampling.sampling_params import sampling_filters
from sgl_jax.srt.model_loader.loader import JNP_DTYPES, load_model
from sgl_jax.srt.server_args import resolve_attention_backend
from sgl_jax.srt.startup_phases import StartupPhases

logger = logging.getLogger(__name__)



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
            padding sink). Called with None before the weights load: the spec then (its pool zeroed while they
            load) unless it raises memory_budget.NeedsWeightBytes, when it is called again once they are loaded,
            to size the pools from what is left.
        num_request_slots: ReqToTokenPool rows of one rank.
        aux_layers: layer ids whose outputs every forward also returns (`StepOutput.aux`: an EAGLE-3 head's input,
            `models.llama.run_layers`); empty: none.
        phases: the start-up phases to record the weights' load and the KV allocation in (None: not recorded).
    """

    def __init__(self, server_args, model_config, *, buckets: ShapeBuckets, max_context_len: int,
                 kv_spec_fn, num_request_slots: int = 1, aux_layers: Tuple[int, ...] = (),
                 phases: Optional[StartupPhases] = None):
        phases = phases or StartupPhases()
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
        self.platform = self.mesh.devices.flat[0].platform  # JAX's name of the runner's devices ("cpu", "gpu", "tpu")
        # tokens start their host copy at launch, except on CPU (host memory already; the start cost ~15 us a step)
        self._copy_ahead = self.platform != "cpu"
        self._rank_rows = NamedSharding(self.mesh, RANK_ROWS)
        if self.tp_size > 1 or self.dp_size > 1:
            logger.info("Mesh: %d data-parallel ranks x %d tensor-parallel devices %s", self.dp_size, self.tp_size,
                        [d.id for d in self.mesh.devices.flat])
        self._startup_phases, self.max_context_len = phases, max_context_len
        # the last start's executables, loaded while the weights load; the runner that began the loading ends it in
        # its warm-up (a draft model's runner, built second, shares it), or here when it fails to build
        self._ends_prefetch = not server_args.disable_precompile and not prefetching()
        if self._ends_prefetch:
            start_prefetch(server_args, register_kernels)
        try:
            self._load(server_args, model_config, kv_spec_fn, num_request_slots, phases)
            self._build_programs(server_args, model_config, buckets)
        except BaseException:
            if self._ends_prefetch:
                end_prefetch(record=False)
            raise
        self.faults = PlantedFaults.from_env()  # test hooks (fault_injection.py); none outside tests
        self.warmup_stats: Dict[str, float] = {}  # what warm-up compiled and loaded (see warmup)

    def _load(self, server_args, model_config, kv_spec_fn, num_request_slots: int, phases: StartupPhases) -> None:
        """`__init__`'s first half: the weights (the KV pool zeroed beside them where its size does not follow
        theirs), what the model says about itself, the KV pool and the per-slot state."""
        # the KV pool is zeroed while the weights load where its size does not follow theirs (CPU, --max-total-tokens;
        # `kv_spec_fn(None)` raises NeedsWeightBytes elsewhere)
        try:
            early_spec = self._start_kv(kv_spec_fn(None))
        except NeedsWeightBytes:
            early_spec = None
        with phases.phase("weights (read, place and shard)"):
            self.graphdef, self.params = load_model(model_config, server_args.load_format,
                                                    server_args.random_seed, mesh=self.mesh)
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
        self.generates = not server_args.is_embedding and model_config.role == "causal"
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
        spec = early_spec if early_spec is not None else self._start_kv(kv_spec_fn(weight_bytes))
        # the host tier's copy programs (--enable-hierarchical-cache; model_executor/host_kv.py)
        self.host_kv_copies = HostKVCopies(self.mesh, self._kv_sharding, self.dp_size, len(spec.layer_pool),
                                           *self._kv_layout[1:]) if server_args.enable_hierarchical_cache else None
        eos = model_config.eos_token_ids or [model_config.vocab_size]  # out of range -> no-op mask
        self.eos_token_ids = jnp.asarray(eos, jnp.int32)
        self.vocab_mask_width = vocab_mask_words(model_config.vocab_size)
        R = self.dp_size * num_request_slots
        r = self._replicated
        self.penalty_state = jax.jit(lambda: new_penalty_state(R, model_config.vocab_size), out_shardings=r)()
        # the overlap scheduler's sampled tokens, one per stacked request slot (model_executor/future_tokens.py)
        self.future_tokens = jax.jit(lambda: new_future_tokens(R), out_shardings=r)()
        # decode steps read page tables and sampling parameters from the device (model_executor/slot_state.py) on
        # a decoder with one KV pool and no speculative decoding (its verify steps and K/V moves change the tables
        # on the host only)
        self.slot_decode = (self.generates and not self.is_encoder and spec.num_pools == 1
                            and server_args.speculative_algorithm is None and type(self).fused_steps)
        self.slot_state = (jax.jit(lambda: new_slot_state(R, self.pages_per_seq), out_shardings=r)()
                           if self.slot_decode else None)
        self.decode_steps = int(server_args.num_continuous_decode_steps)  # K of the multi-step decode program
        # the overlap scheduler launches a slot decode step with grammar rows unmasked, then samples it again once the
        # step before is applied and the masks are filled: each decode row count's sampling is compiled too
        # (`launch_decode_split`)
        self.grammar_split = (self.slot_decode and server_args.grammar_backend != "none"
                              and not server_args.disable_overlap_schedule
                              and grammar_overlap_on(server_args.grammar_overlap, self.platform))
        self._all_allowed = {}  # S_pad -> device int32[S_pad, vocab_mask_width] of -1 (no grammar in the batch)
        self._row_layouts = {}  # (rows, K, ranks) -> the packed layout of DecodeRows (`_pack_rows`)
        # outputs fed back into the next call keep exactly the shardings they were created with, so a
        # program compiled at warm-up is the one serving uses (a new input sharding would compile again)
        # hidden states stay with their rank, unless ranks span hosts (then every host reads them all)
        self._hidden_sharding = NamedSharding(self.mesh, P("data", None)) if jax.process_count() == 1 else r

    def _build_programs(self, server_args, model_config, buckets: ShapeBuckets) -> None:
        """`__init__`'s second half: the step programs and the small ones, each a `CachedProgram` warm-up compiles
        or loads (nothing is traced here)."""
        r, hidden = self._replicated, self._hidden_sharding
        self.step_spec = StepSpec(
            graphdef=self.graphdef, param_treedef=self._param_treedef, attention_backend=self.attention_backend,
            generates=self.generates, aux_layers=self.aux_layers,
            moe_experts=0 if self.moe_stats is None else self.moe_stats.num_experts,
            routed=self.return_routed_experts, rank_rows=self._rank_rows, replicated=r, page_size=self.page_size,
            with_lora=self.lora_writer is not None, eos_token_ids=self.eos_token_ids,
            num_layers=model_config.num_hidden_layers)
        # absent outputs are None (no buffer): MoE outputs of a dense model, routed ids unless returned, aux
        # without EAGLE-3, a decode step's hidden states
        moe = None if self.moe_stats is None else (r, r if self.return_routed_experts else None)
        aux = hidden if self.aux_layers else None
        outs = (r, r, r, hidden, moe, aux)  # tokens, logits, lse, hidden, moe, aux
        xla = server_args.xla_options() or None  # --xla-compiler-options: the step programs' XLA options
        jit = functools.partial(jax.jit, static_argnums=(5,), compiler_options=xla)
        self._step = jit(functools.partial(step_programs.step, self.step_spec), donate_argnums=(1, 2),
                         out_shardings=(self._kv_sharding, r, outs))
        decode = functools.partial(step_programs.decode, self.step_spec)
        self._decode_one = jit(decode, donate_argnums=(1, 2),
                               out_shardings=(self._kv_sharding, r, (r, r, r, None, moe, None)))
        jit_multi = functools.partial(  # (the K-step program's own XLA options on CPU)
            jit, compiler_options=step_programs.multi_step_xla_options(xla or {}, self.platform) or None)
        self._decode_multi = jit_multi(decode, donate_argnums=(1, 2),  # (K > 1: no logits, expert counts only)
                                       out_shardings=(self._kv_sharding, r, (r, None, None, None, moe and (r, None),
                                                                            None)))
        self._forward = jit(functools.partial(step_programs.forward_only, self.step_spec), donate_argnums=(1, 2),
                            out_shardings=(self._kv_sharding, r, r, hidden, moe, aux, r))
        self._sample = jit(functools.partial(step_programs.sample_only, self.step_spec), donate_argnums=(1, 2),
                           out_shardings=(r, r, r, r))
        # the step programs run the executables warm-up loaded or compiled for their layouts (program_cache.py)
        self._step, self._decode_one, self._decode_multi, self._forward, self._sample = (CachedProgram(f, 5) for f in (
            self._step, self._decode_one, self._decode_multi, self._forward, self._sample))
        self.program_cache = program_cache_for(server_args, model_config, self.step_spec, self.mesh.devices.flat)
        self._init_penalty_row = CachedProgram(jax.jit(init_penalty_row, donate_argnums=(0,), out_shardings=r),
                                               key_of=lambda args: None)  # (one program)
        # the K/V move program's sizes: one per verify shape's T_pad (move_kv), sorted
        self._move_sizes = sorted(t for mode, t, _ in buckets.all_shapes() if mode == ForwardMode.TARGET_VERIFY)
        # the programs below are looked up by the rows of their second argument (the hidden rows, the move's slots)
        self._move_kv = CachedProgram(jax.jit(functools.partial(move_kv_slots, mesh=self.mesh), donate_argnums=(0,),
                                              out_shardings=self._kv_sharding), key_of=_second_arg_rows)
        self._logprobs = CachedProgram(jax.jit(self._logprobs_impl), key_of=_second_arg_rows)
        self._label_logprobs = CachedProgram(jax.jit(self._label_logprobs_impl), key_of=_second_arg_rows)
        self._classify = CachedProgram(jax.jit(self._classify_impl), key_of=_second_arg_rows)
        self._compiled_after_warmup: Optional[int] = None
        self._num_compiles_after_warmup = 0

    def _decode(self, num_steps: int):
        """The slot decode program of `num_steps` steps (`step_programs.decode`; K = 1 keeps its logits)."""
        return self._decode_one if num_steps == 1 else self._decode_multi

    fused_steps = True  # the forward and the sampling of a step in one program (a draft runner's: split)

    @functools.cached_property
    def logits_vocab(self) -> int:
        """Logits columns (the LM head's rows), from the abstract logprob program."""
        return jax.eval_shape(self._logprobs_impl, self.params, jax.ShapeDtypeStruct(
            (1, self.model_config.hidden_size), JNP_DTYPES[self.model_config.dtype])).shape[-1]

    def _start_kv(self, spec):
        """Check the KV spec (`kv_spec_fn`'s) against the flags and the model, set the pool's attributes and begin
        zeroing it on a thread of its own (kv_allocation.py); the first read of `kv_caches` waits for it and records
        the phase "KV cache allocation". Returns `spec`.

        Raises:
            ValueError: the spec's page size or layer count differs from --page-size and the model's, or the pallas
                kernels cannot read the --kv-cache-dtype.
        """
        server_args, model_config = self.server_args, self.model_config
        self.kv_spec = spec
        if spec.page_size != self.page_size or len(spec.layer_pool) != model_config.num_hidden_layers:
            raise ValueError(f"the KV spec ({spec}) does not match --page-size {self.page_size} and "
                             f"{model_config.num_hidden_layers} layers")
        self.max_total_tokens = spec.pool_tokens[0]  # tokens of a rank's first (full-attention) pool
        self.pages_per_seq = math.ceil(self.max_context_len / self.page_size)
        dtype = kv_cache_dtype(model_config, server_args.kv_cache_dtype)
        self.kv_cache_dtype = jnp.dtype(dtype)
        if (self.attention_backend == "pallas" and self.kv_cache_dtype != jnp.dtype(JNP_DTYPES[model_config.dtype])
                and server_args.kv_cache_dtype not in FP8_KV_DTYPES):  # (fp8 pages are widened in the kernels)
            raise ValueError(f"--kv-cache-dtype {server_args.kv_cache_dtype} differs from the model's dtype "
                             f"({model_config.dtype}); the pallas attention kernels need them equal (or an fp8 "
                             f"cache): pass --attention-backend native or --dtype {self.kv_cache_dtype.name}")
        kv_heads, head_dim = padded_kv_heads(model_config.num_key_value_heads, self.tp_size), model_config.head_dim
        self._kv_layout = (spec, kv_heads, head_dim, dtype)
        self._kv_allocation = KVAllocation(
            [(self.dp_size * (spec.pool_pages(pool) + 1), self.page_size, kv_heads, head_dim)
             for pool in spec.layer_pool], dtype, self._kv_sharding)
        self._kv = None
        self._kv_allocation.start()
        logger.info("KV cache: %s, %s, per rank (%.2f GiB per device)", spec.describe(), self.kv_cache_dtype.name,
                    self._kv_allocation.nbytes / self.tp_size / self.dp_size / 2**30)
        return spec

    # ---- compiled functions
    def allocate_kv(self) -> list:
        """Zeroed (K, V) device buffers per layer, [dp * (pages + 1), page_size, kv_heads, head_dim] each, of the
        pool the KV spec gives the layer (every rank's block holds its padding page 0), sharded by KV_CACHE
        (`kv_allocation.KVAllocation`: a later call, resume_memory_occupation's, compiles nothing)."""
        return self._kv_allocation.allocate()

    @property
    def kv_caches(self) -> list:
        """The KV pool's (K, V) device buffers per layer (see `allocate_kv`); None while released. The start-up
        allocation runs on a thread of its own: the first read waits for it."""
        if self._kv_allocation.pending:
            self._kv, waited = self._kv_allocation.result()
            how = ("as fresh zero pages" if self._kv_allocation.fresh_shapes == set(self._kv_allocation.shapes)
                   else "zeroed")
            self._startup_phases.add("KV cache allocation", waited, f"{self._kv_allocation.nbytes / 2**30:.1f} GiB "
                                     f"{how} in {self._kv_allocation.seconds:.1f} s on a thread of its own")
        return self._kv

    @kv_caches.setter
    def kv_caches(self, value) -> None:
        self._kv = value

    @property
    def _kv_args(self) -> list:
        """The KV buffers to lower a program against: their abstract shapes while the start-up allocation runs."""
        return self._kv_allocation.abstract if self._kv_allocation.pending else self._kv

    @property
    def params(self):
        """The model's parameters (an nnx State on device)."""
        return self._params

    @params.setter
    def params(self, value) -> None:
        # the step takes the flat list of leaves: flattening an nnx State in Python cost ~0.4 ms a call
        self._params = value
        self._param_leaves, self._param_treedef = jax.tree.flatten(value)

    @property
    def _state(self) -> tuple:
        """The device state every step takes and gives back (donated): (penalty state, future tokens, slot state
        or None)."""
        return self.penalty_state, self.future_tokens, self.slot_state

    @_state.setter
    def _state(self, value: tuple) -> None:
        self.penalty_state, self.future_tokens, self.slot_state = value

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
    def _put(self, x):
        """A host array (or a tuple of them) on the device, replicated: an explicit host-to-device copy
        (host_copy.put)."""
        if isinstance(x, tuple):
            return tuple(self._put(a) for a in x)
        return host_copy.put(np.asarray(x), self._replicated)

    def _all_allowed_mask(self, s_pad: int) -> jax.Array:
        """The cached device int32[s_pad, words] of -1 (every token allowed) for `s_pad` sampling rows."""
        if s_pad not in self._all_allowed:
            self._all_allowed[s_pad] = self._put(all_allowed_mask(s_pad, self.vocab_mask_width))
        return self._all_allowed[s_pad]

    def _vocab_mask(self, rows: int, mask: Optional[np.ndarray]) -> jax.Array:
        """The device vocab mask of a step of `rows` sampling rows: `mask` (int32[rows, words]) copied, or the cached
        all-allowed one."""
        return self._all_allowed_mask(rows) if mask is None else self._put(np.asarray(mask))

    def _forward_inputs(self, fb: ForwardBatch) -> tuple:
        """(a ForwardBatch packed into one int32 buffer on device, replicated -- the program puts its rows back by
        rank --, its packed layout: the program's static argument). The draft runners' programs take these."""
        buf, layout = pack(fb)
        return self._put(buf), layout

    def _step_inputs(self, stacked: ModelWorkerBatch, times: StepTimes) -> tuple:
        """(a step's SamplingBatch, its vocab mask left out, and ForwardBatch in one int32 buffer on device; the
        packed layout) -- the step's one host-to-device copy. The SamplingBatch comes first, so that a split step's
        sampling program reads the buffer's head (`step_programs.forward_only`)."""
        buf, layout = pack((dataclasses.replace(stacked.sampling, vocab_mask=None), stacked.forward_batch))
        t0 = time.perf_counter()
        packed = self._put(buf)
        times.h2d_s += time.perf_counter() - t0
        return packed, layout

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def _sampling_layout(layout) -> tuple:
        """The layout of the SamplingBatch at the head of a step's packed buffer (its layout is `layout`)."""
        treedef, specs = layout
        return treedef.children()[0], specs[:step_programs.sampling_leaves(layout)]

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

    def _check_ranks(self, batches: Sequence) -> list:
        """The real rank batches of a step (`ModelWorkerBatch` or `DecodeRows` of one rank). Raises ValueError
        without one, for a number of ranks that is not the dp size, or for a request slot outside the runner's
        num_request_slots (its slot-state and penalty rows would be dropped)."""
        if len(batches) != self.dp_size:
            raise ValueError(f"{len(batches)} rank batches for --dp-size {self.dp_size}")
        real = [b for b in batches if b is not None]
        if not real:
            raise ValueError("a step needs at least one rank batch")
        for b in real:
            slots = np.asarray(b.slots if isinstance(b, DecodeRows) else b.sampling.slots)
            if slots.max() >= self.num_request_slots:  # (the method: np.max's Python wrapper is most of its cost)
                raise ValueError(f"request slot {int(slots.max())} outside the runner's {self.num_request_slots}")
        return real

    def launch_ranks(self, batches: Sequence[Optional[ModelWorkerBatch]],
                     vocab_mask: Optional[np.ndarray] = None) -> PendingStep:
        """Dispatch one step of every rank (as `forward_ranks`), forward and sampling in one program, without waiting
        for it: the device runs it after the steps launched before (the KV cache and the device state are donated
        from one step to the next), the host goes on. vocab_mask: int32[dp * S_pad, words] of the stacked rows
        (`stack_vocab_masks`), or None for the batches' own masks (all allowed when they have none). Raises
        ValueError as `forward_ranks`. An extend step runs split (`launch_forward`, `launch_sample`: one sampling
        program per S_pad serves every extend bucket, so warm-up compiles the sampler once per row count, not once
        per token bucket), as does every step of a runner without fused steps; a decode step on a runner with slot
        state runs as `launch_decode` of the same rows (`decode_rows_of`: its requests' earlier steps ran here)."""
        mode = next(b for b in batches if b is not None).forward_batch.forward_mode
        if not self.fused_steps or mode == ForwardMode.EXTEND:
            return self.launch_sample(self.launch_forward(batches), vocab_mask)
        if mode == ForwardMode.DECODE and self.slot_decode:
            return self.launch_decode([None if b is None else decode_rows_of(b) for b in batches],
                                      vocab_mask if vocab_mask is not None else stack_vocab_masks(
                                          [None if b is None else b.sampling.vocab_mask for b in batches],
                                          next(b for b in batches if b is not None).rows_pad))
        real = self._check_ranks(batches)
        _, t_pad, _ = real[0].padded_shape
        stacked, times = self._step_batch(batches), StepTimes()
        packed, layout = self._step_inputs(stacked, times)
        mask = self._vocab_mask(real[0].rows_pad * self.dp_size,
                                vocab_mask if vocab_mask is not None else stacked.sampling.vocab_mask)
        t0 = time.perf_counter()
        self.kv_caches, self._state, outs = self._step(self._param_leaves, self.kv_caches, self._state, packed,
                                                       mask, layout)
        times.dispatch_s += time.perf_counter() - t0
        return self._pending(outs, [None if b is None else b.num_rows for b in batches], real[0], t_pad, times)

    def launch_decode(self, rows: Sequence[Optional[DecodeRows]], vocab_mask: Optional[np.ndarray] = None
                      ) -> PendingStep:
        """Dispatch K decode steps of every rank's `DecodeRows` (None: the rank idles) in one program (K = their
        kv_slots' first dimension: 1, or --num-continuous-decode-steps), reading the rows' page tables and
        sampling parameters from the slot state (model_executor/slot_state.py). vocab_mask: int32[dp * S_pad, words]
        (K = 1 only) or None. Raises ValueError as `forward_ranks`, or when the runner has no slot state."""
        outs, num_seqs, s_pad, times = self._dispatch_decode(rows, vocab_mask)
        return self._pending(outs, num_seqs, None, s_pad, times, s_pad)

    def _dispatch_decode(self, rows: Sequence[Optional[DecodeRows]], vocab_mask: Optional[np.ndarray]) -> tuple:
        """Dispatch the slot decode program of `launch_decode`: (its outputs, real rows per rank, S_pad, times)."""
        if not self.slot_decode:
            raise ValueError("this runner decodes host-built batches only (no slot state)")
        real = self._check_ranks(rows)
        s_pad, k = real[0].rows_pad, real[0].num_steps
        stacked = real[0] if self.dp_size == 1 else DecodeRows.stack(
            [r if r is not None else DecodeRows.padding(s_pad, k) for r in rows], self.num_request_slots)
        times = StepTimes()
        buf, layout = self._pack_rows(stacked)
        t0 = time.perf_counter()
        packed = self._put(buf)
        mask = self._vocab_mask(s_pad * self.dp_size, vocab_mask)
        t1 = time.perf_counter()
        self.kv_caches, self._state, outs = self._decode(k)(self._param_leaves, self.kv_caches, self._state,
                                                            packed, mask, layout)
        t2 = time.perf_counter()
        times.h2d_s, times.dispatch_s = t1 - t0, t2 - t1
        return outs, [None if r is None else int(r.num_seqs[0]) for r in rows], s_pad, times

    def launch_decode_split(self, batches: Sequence[Optional[ModelWorkerBatch]]) -> LaunchedForward:
        """Dispatch a decode step whose grammar masks are not known yet (the overlap scheduler's grammar step,
        scheduler/step_launch.py): the slot decode of the host-built DECODE batches' rows (`launch_decode`, K = 1)
        with every token allowed, returned as a `LaunchedForward` whose `launch_sample` samples every row again
        from the step's logits with the masks (the sampling program of S_pad rows, on the batches' own
        SamplingBatch). The step's first draw is discarded: the second writes the future tokens again and counts
        no penalty token twice (layers/sampler.count_last_tokens counts each once), so its tokens are those the
        slot decode gives with the same masks. Raises ValueError as `launch_decode`."""
        outs, num_seqs, s_pad, times = self._dispatch_decode(
            [None if b is None else decode_rows_of(b) for b in batches], None)
        _, logits, _, hidden, moe, aux = outs
        stacked = self._step_batch(batches)
        t0 = time.perf_counter()
        buf, layout = pack((dataclasses.replace(stacked.sampling, vocab_mask=None), stacked.forward_batch))
        head = self._put(buf[:step_programs.sampling_words(layout)])
        times.h2d_s += time.perf_counter() - t0
        return LaunchedForward(logits, hidden, moe, stacked.sampling, num_seqs, s_pad, s_pad, None, aux, times,
                               (head, self._sampling_layout(layout)))

    def _pack_rows(self, rows: DecodeRows) -> tuple:
        """`packed_inputs.pack` of rank-stacked DecodeRows: `DecodeRows.build`'s buffer, or its fields concatenated
        in the layout's order (the layout, per shape, from `pack` the first time, checked against the buffer then)."""
        key = (np.shape(rows.slots)[0], rows.num_steps, np.shape(rows.num_seqs)[0], rows.filtering)
        buf = getattr(rows, "packed", None)  # (DecodeRows.build's: its fields are views of it)
        if buf is None:
            buf = np.concatenate([np.asarray(rows.slots), np.asarray(rows.input_ids), np.asarray(rows.positions),
                                  np.asarray(rows.kv_slots).reshape(-1), np.asarray(rows.steps),
                                  np.asarray(rows.constrained).astype(np.int32), np.asarray(rows.num_seqs)])
        layout = self._row_layouts.get(key)
        if layout is None:
            ref, layout = pack(rows)
            if not np.array_equal(ref, buf):
                raise AssertionError("DecodeRows' packed layout is not its fields in order")
            self._row_layouts[key] = layout
        return buf, layout

    def _pending(self, outs: tuple, num_seqs: list, batch: Optional[ModelWorkerBatch], t_pad: int, times: StepTimes,
                 s_pad: Optional[int] = None) -> PendingStep:
        """The PendingStep of a dispatched step's outputs (tokens, logits, lse, hidden, moe, aux)."""
        if self._compiled_after_warmup is not None and self.faults.fire("compile_while_serving"):
            jax.jit(lambda x: x * 3.0 + 1.0)(self._put(np.zeros(7, np.float32))).block_until_ready()  # planted
        self._check_no_new_compile(batch)
        tokens, logits, lse, hidden, moe, aux = outs
        counts, routed = moe if moe is not None else (None, None)
        return PendingStep(tokens, logits, lse, hidden, aux, counts, routed, num_seqs,
                           s_pad if s_pad is not None else batch.rows_pad, t_pad, self.moe_stats,
                           self.return_routed_experts, times, copy_ahead=self._copy_ahead)

    def launch_forward(self, batches: Sequence[Optional[ModelWorkerBatch]]) -> LaunchedForward:
        """Dispatch the forward program of one step of every rank (see `launch_ranks`); `launch_sample` dispatches
        its sampling, with the batches' vocab masks or masks filled in the meantime. Raises ValueError as
        `forward_ranks`."""
        real = self._check_ranks(batches)
        _, t_pad, _ = real[0].padded_shape
        stacked, times = self._step_batch(batches), StepTimes()
        packed, layout = self._step_inputs(stacked, times)
        t0 = time.perf_counter()
        self.kv_caches, self.slot_state, logits, hidden, moe, aux, sampling = self._forward(
            self._param_leaves, self.kv_caches, self.slot_state, self.future_tokens, packed, layout)
        times.dispatch_s += time.perf_counter() - t0
        self._check_no_new_compile(real[0])
        return LaunchedForward(logits, hidden, moe, stacked.sampling,
                               [None if b is None else b.num_rows for b in batches], real[0].rows_pad, t_pad,
                               real[0], aux, times,
                               (sampling, self._sampling_layout(layout)))

    def launch_sample(self, fwd: LaunchedForward, vocab_mask: Optional[np.ndarray] = None) -> PendingStep:
        """Dispatch the sampling program of a launched forward, on the forward's packed inputs. vocab_mask:
        int32[dp * S_pad, words] of the stacked rows (`stack_vocab_masks`), or None for the batches' own masks (all
        allowed when they have none). An embedding server's steps sample nothing: their tokens are zeros."""
        packed, layout = fwd.packed
        mask = self._vocab_mask(fwd.s_pad * self.dp_size,
                                vocab_mask if vocab_mask is not None else fwd.sampling.vocab_mask)
        t0 = time.perf_counter()
        self.penalty_state, self.future_tokens, tokens, lse = self._sample(
            fwd.logits, self.penalty_state, self.future_tokens, packed, mask, layout)
        fwd.times.dispatch_s += time.perf_counter() - t0
        return self._pending((tokens, fwd.logits, lse, fwd.hidden, fwd.moe, fwd.aux), fwd.num_seqs, fwd.batch,
                             fwd.t_pad, fwd.times, fwd.s_pad)

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
        self.penalty_state = self._init_penalty_row(self.penalty_state, *self._put(
            (np.int32(slot), ids, np.int32(num_prompt), np.int32(n), bias)))
        self._check_no_new_compile(None)

    def kv_cache_lost(self) -> bool:
        """Whether the KV cache or penalty-state buffers are gone (a step failed after they were donated to
        it): shared state is lost and the scheduler must not go on."""
        state = (self.kv_caches, self._state)
        return any(leaf.is_deleted() for leaf in jax.tree.leaves(state))

    def full_logprobs(self, hidden_rows: np.ndarray) -> np.ndarray:
        """float32[N, V] log-softmax of the logits of N hidden states (input-token logprobs).

        Runs in fixed chunks of LOGPROB_CHUNK_ROWS rows so a single compiled program serves any N.
        """
        out = []
        for i in range(0, len(hidden_rows), LOGPROB_CHUNK_ROWS):
            chunk = hidden_rows[i:i + LOGPROB_CHUNK_ROWS]
            rows = self._put(_pad_rows(chunk, LOGPROB_CHUNK_ROWS))
            out.append(host_copy.get(self._logprobs(self.params, rows))[:len(chunk)])
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
                res = host_copy.get(self._label_logprobs(self.params, *self._put((rows, labels))))
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
            out.append(host_copy.get(self._classify(self.params, self._put(rows)))[:len(chunk)])
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
        """(name, thunk returning a `ProgramCall`, or a lowered program) of every program serving runs
        (`runner_programs.serving_programs`); the draft runners add or replace theirs."""
        return serving_programs(self)

    def warmup(self, phases: Optional[StartupPhases] = None, prefix: str = "") -> None:
        """Compile every program of `warmup_programs` ahead of time (warmup.compile_programs: nothing runs), its
        tracing and compiling recorded in `phases` (names starting with `prefix`) when given.

        Serving then finds each program in jit's in-memory cache; any later compile is counted in
        ``num_compiles_after_warmup`` (see compile_stats). The step programs are lowered against the KV pool's abstract
        buffers while a thread of its own zeroes it (kv_allocation.py); warm-up ends once it is ready.
        """
        done = False
        try:
            self.warmup_stats = compile_programs(self.warmup_programs(), phases, prefix, self.program_cache)
            self.kv_caches  # (waits for the start-up allocation of the pool, which warm-up overlapped)
            done = True
        finally:  # the loading ahead this runner began ends: the keys used noted for the next start unless it failed
            if self._ends_prefetch:
                self._ends_prefetch = False
                end_prefetch(record=done)
        self._compiled_after_warmup = compile_counts().programs

def _second_arg_rows(args: tuple) -> int:
    """The rows of a call's second argument: the table key of the programs compiled per row count."""
    return args[1].shape[0]


def decode_rows_of(batch: ModelWorkerBatch) -> DecodeRows:
    """The `DecodeRows` of a host-built DECODE batch of one rank (its real rows' slots, input tokens, positions, KV
    slots, step counts and grammar flags; K = 1; filtering when a real row's parameters filter)."""
    fb, sp, n = batch.forward_batch, batch.sampling, batch.num_seqs
    params = {name: np.asarray(sp.params[name])[:n] for name in ("temperature", "top_p", "top_k", "min_p", "typical_p")}
    return DecodeRows.build(np.asarray(sp.slots)[:n], np.asarray(fb.input_ids)[:n], np.asarray(fb.positions)[:n],
                            np.asarray(fb.out_cache_loc)[:n][None], np.asarray(sp.steps)[:n],
                            np.asarray(sp.constrained)[:n], batch.rows_pad, bool(np.any(sampling_filters(**params))))


def grammar_overlap_on(setting: str, platform: str) -> bool:
    """--grammar-overlap: "on", "off", or "auto" (on unless `platform`, JAX's, is "cpu")."""
    return setting == "on" or (setting == "auto" and platform != "cpu")


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
