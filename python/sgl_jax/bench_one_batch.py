"""Prefill and decode latency of one static batch, straight through the ModelRunner (no HTTP, no ZMQ).

SGLang's ``bench_one_batch``: for each batch size B and input length L, B requests of L random token ids
(seeded) are prefilled, then decoded step by step; every step is built and dispatched by the scheduler's own parts
(Req, ScheduleBatch.prepare_for_extend / prepare_for_decode, build_decode_rows or build_model_worker_batch,
ModelRunner.launch_decode / launch_ranks: bench_decode_loops.DecodeLoop)::

    JAX_PLATFORMS=cpu python -m sgl_jax.bench_one_batch --batch-size 1 16 64 --input-len 1500 --output-len 16
    python -m sgl_jax.bench_one_batch --load-format dummy --batch-size 1 4 --input-len 64 --output-len 4 \
        --result-filename results.jsonl --report one_batch.md --profile traces/

Every ServerArgs flag works (``--model-path``, ``--dtype``, ``--page-size``, ``--max-total-tokens``,
``--num-continuous-decode-steps`` ...); ``--temperature``, ``--top-p`` and ``--top-k`` set every request's sampling
(default: temperature 1, no filter). Compilation is excluded: ModelRunner.warmup() compiles every bucket first,
and ``--warmup-steps`` untimed decode steps run before the ``--output-len`` timed ones; each row's timed loops run
``--decode-repeats`` passes (default 5; the prompts prefilled again, the same seeds) and their medians are over the
iterations of all passes (with K = 8, 64 output tokens are 8 launches: one pass alone is a few ms). A step's time
includes its host work as the scheduler pays it; ``host ms`` is that part (build, h2d, dispatch and apply of
bench_decode_loops.py). ``device ms`` is the device's own time per step: the last launch re-run back to back with
nothing read in between (`device_timing.device_seconds_per_decode` / `device_seconds_per_step`; the median of
DEVICE_BLOCKS such blocks); ``busy %`` =
device ms / decode p50 ms, the share of a decode loop the device is busy (on CPU the "device" is the same cores,
so both shares compete). The overlap columns rerun the row (the same prompts and seeds, prefilled again) with the
overlap scheduler's decode loop: each step is launched before the previous step's sampled ids are read (its input
tokens are the ones the device holds, model_executor/future_tokens.py); ``overlap ms`` is its median step,
``overlap busy %`` = device ms / overlap ms, ``x overlap`` = decode p50 ms / overlap ms (decode steps/s with
overlap over without), and the row's output tokens must equal the loop without overlap (``tokens_identical``; the
script exits non-zero otherwise). ``--disable-overlap-schedule`` skips that pass. With
``--num-continuous-decode-steps K`` every launch runs K decode steps in one program and the times are per step (a
launch's divided by K). A second table splits each loop's median iteration into build, h2d, dispatch, wait, d2h and
apply (bench_decode_loops.py) beside the device's time and the share of the iteration the device is idle;
``--profile DIR`` writes a ``jax.profiler`` trace (TensorBoard's xplane and Perfetto's perfetto_trace.json.gz, each
iteration a step) of the first ``--profile-steps`` iterations of each row's overlapped loop to DIR/bs{B}-in{L},
and on a GPU the report gets a third table from it (bench_trace.py): the device streams' own busy time beside the
host's CUDA-graph and conditional spans ("device ms" above re-runs the program, so it holds the host's launch).
A batch whose prompts exceed one prefill step's token budget (--chunked-prefill-size, else --max-prefill-tokens)
is prefilled in several steps (whole requests, the last one cut to a page-aligned chunk), and the prefill time is
their sum. The KV pool is sized to B x (L + warm-up + K + output) tokens unless --max-total-tokens or
--mem-fraction-static is given. A ChunkCache (no prefix sharing) is used whatever the radix flag says: random
prompts share nothing.

Floors (per device, for the real tokens, padding excluded): what the step must at least cost at the machine's
rates, both measured at the start of the run by ``bench_utils.measure_machine_rates`` (XLA's matmul rate in the
model's dtype, GFLOP/s; the memory read rate, GB/s), never a constant.
  FLOPs = 2 x (active parameters except embedding and lm-head) x tokens + 2 x vocab x hidden x sequences (the lm-head
          runs on each sequence's last token only) + 4 x layers x heads x head_dim x sum over query tokens of
          the context each sees (causal: position p sees p + 1 tokens, a sliding-window layer at most its window).
  bytes = weights read once (the parameters' bytes on device; an untied embedding table is only gathered, so
          it is left out; a mixture of experts' stacked expert weights only for the experts the step's tokens are
          expected to reach: E x (1 - (1 - 1/E)^(tokens x k)) of E under uniform routing) + per layer and sequence: KV read of its whole context after the step (window-capped)
          and KV written for its new tokens, at the bytes per token of the runner's KV buffers (their dtype).
  floor = max(FLOPs / matmul rate, bytes / memory rate) (``MachineRates.floor``), marked F (compute-bound) or B
  (bandwidth-bound); ``x floor`` = measured / floor. Decode: the median step against the median step's floor.

A mixture-of-experts model's active parameters count each stacked expert weight at k / E of its size (each
token runs k of the E experts); ``--moe-backend`` picks the expert computation whose speed is measured.

Every JSONL line holds its row, the measured rates and the programs compiled after warm-up (the runner's own
count; null with --disable-precompile, which counts none). ``--report NAME.md`` writes a generated report
(``bench_utils.write_report``): NAME.md (computed from the rows alone) and NAME.json (the command and the rows);
notes go in NAME.notes.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import shlex
import sys
import time
from typing import List, Optional, Tuple

import jax
import numpy as np
from tqdm import tqdm

from sgl_jax import bench_trace
from sgl_jax.bench_decode_loops import SPLIT_FIELDS, DecodeLoop, medians_ms
from sgl_jax.bench_utils import MachineRates, git_commit, measure_machine_rates, write_report
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.scheduler.schedule_batch import Req, ScheduleBatch
from sgl_jax.srt.model_executor.buckets import derive_limits
from sgl_jax.srt.model_executor.cpu_threads import yield_to_launcher
from sgl_jax.srt.mem_cache.kv_memory import KVMemory, kv_spec_for
from sgl_jax.srt.forward_batch import DecodeRows, ForwardMode
from sgl_jax.srt.kernels.ragged_paged_attention.backend import describe as describe_attention
from sgl_jax.srt.model_executor.device_timing import device_seconds_per_decode, device_seconds_per_step
from sgl_jax.srt.model_executor.memory_budget import compute_max_total_tokens
from sgl_jax.srt.model_executor.model_runner import ModelRunner, setup_jax
from sgl_jax.srt.sampling.sampling_params import SamplingParams
from sgl_jax.srt.server_args import ServerArgs
from sgl_jax.srt.utils import configure_logging

COLUMNS = ("bs", "in", "out", "prefill s", "steps", "prefill tok/s", "floor s", "x floor", "decode p50 ms",
           "p90 ms", "host ms", "device ms", "busy %", "overlap ms", "overlap busy %", "x overlap", "decode tok/s",
           "floor ms", "x floor")


@dataclasses.dataclass
class ModelCost:
    """What the floors need, per device. token_params / head_params: parameters each token / each sequence's
    logits row multiplies (head: vocab x hidden); weight_bytes: bytes one step reads; layer_windows: per layer,
    its sliding window (None: full); layer_kv_bytes: per layer, K+V bytes per token; q_heads x head_dim: the
    query width on this device."""

    token_params: int
    head_params: int
    weight_bytes: int
    layer_windows: List[Optional[int]]
    layer_kv_bytes: List[int]
    q_heads: int
    head_dim: int
    expert_bytes: int = 0  # stacked expert weights' bytes on device (part of weight_bytes)
    num_experts: int = 0  # E (0: not a mixture of experts)
    top_k: int = 0

    def weight_bytes_read(self, tokens: int) -> float:
        """Weight bytes a step over `tokens` tokens reads: all but the experts, plus the share of experts its
        tokens are expected to reach under uniform routing."""
        if not self.num_experts:
            return float(self.weight_bytes)
        reached = 1.0 - (1.0 - 1.0 / self.num_experts) ** (tokens * self.top_k)
        return self.weight_bytes - self.expert_bytes + self.expert_bytes * reached


def model_cost(runner: ModelRunner) -> ModelCost:
    """ModelCost of `runner`: parameter counts from its params tree, KV bytes from its KV buffers (so a KV
    dtype that differs from the weights' is counted as stored)."""
    mc, tp = runner.model_config, runner.tp_size
    cfg = mc.hf_config
    num_experts = int(getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0)
    top_k = int(getattr(cfg, "num_experts_per_tok", 0) or 0) if num_experts else 0
    total = embed = embed_bytes = expert_bytes = 0
    weight_bytes, untied = 0, False
    for path, leaf in jax.tree_util.tree_flatten_with_path(runner.params)[0]:
        name = jax.tree_util.keystr(path)
        untied |= "lm_head" in name
        nbytes = leaf.addressable_shards[0].data.nbytes
        weight_bytes += nbytes
        if num_experts and "'experts'" in name:  # a stacked expert weight: k of its E experts per token
            total += leaf.size * top_k // num_experts
            expert_bytes += nbytes
            continue
        total += leaf.size
        if "embed_tokens" in name:
            embed, embed_bytes = embed + leaf.size, embed_bytes + nbytes
    head = mc.vocab_size * mc.hidden_size
    kv = [2 * k.shape[2] // tp * k.shape[3] * k.dtype.itemsize for k, _ in runner.kv_caches]
    return ModelCost(token_params=(total - embed - (head if untied else 0)) // tp, head_params=head // tp,
                     weight_bytes=weight_bytes - (embed_bytes if untied else 0),
                     layer_windows=[mc.layer_window(i) for i in range(mc.num_hidden_layers)], layer_kv_bytes=kv,
                     q_heads=max(1, mc.num_attention_heads // tp), head_dim=mc.head_dim,
                     expert_bytes=expert_bytes, num_experts=num_experts, top_k=top_k)


def _context_sum(start: int, n: int, window: Optional[int]) -> int:
    """Sum of the contexts of queries at positions [start, start + n): position p sees min(p + 1, window)."""
    a, b = start + 1, start + n
    if window is None or b <= window:
        return (a + b) * n // 2
    if a > window:
        return window * n
    return (a + window) * (window - a + 1) // 2 + window * (b - window)


def step_floor(cost: ModelCost, seqs: List[Tuple[int, int]], rates: MachineRates
               ) -> Tuple[float, str, float, float]:
    """(floor seconds, "F" or "B", FLOPs, bytes) of one step over `seqs` = [(tokens already in KV, new tokens)]
    at the measured `rates`."""
    tokens = sum(n for _, n in seqs)
    flops = 2 * cost.token_params * tokens + 2 * cost.head_params * len(seqs)
    nbytes = cost.weight_bytes_read(tokens)
    for window, kv in zip(cost.layer_windows, cost.layer_kv_bytes):
        flops += 4 * cost.q_heads * cost.head_dim * sum(_context_sum(s, n, window) for s, n in seqs)
        nbytes += kv * sum(min(s + n, window or s + n) + n for s, n in seqs)
    return (*rates.floor(flops, nbytes), float(flops), float(nbytes))


def plan_prefill(prompt_lens: List[int], budget: int, max_seqs: int, page: int) -> List[List[Tuple[int, int]]]:
    """Extend steps that prefill prompts of `prompt_lens` tokens in order, as the scheduler admits them: at most
    `budget` tokens and `max_seqs` sequences a step, the last request of a step cut to whole pages when it does
    not fit (it goes on in the next step). Returns per step [(request index, new tokens)]."""
    steps, i, done = [], 0, 0  # done: tokens of request i planned so far
    while i < len(prompt_lens):
        step, room = [], budget
        while i < len(prompt_lens) and len(step) < max_seqs:
            left = prompt_lens[i] - done
            n = left if left <= room else room // page * page
            if n == 0:
                break
            step.append((i, n))
            room -= n
            if n < left:
                done += n
                break
            i, done = i + 1, 0
        steps.append(step)
    return steps


DEVICE_BLOCKS = 5  # blocks of back-to-back launches the device time is the median of (`device_seconds`)
DECODE_REPEATS = 5  # default passes of each row's timed decode loops (--decode-repeats)


class OneBatchRunner:
    """The model runner with one rank's pools, driven step by step as the scheduler drives it."""

    def __init__(self, sa: ServerArgs, args: argparse.Namespace):
        platform = setup_jax(sa)
        self.mc = mc = ModelConfig.from_server_args(sa, platform)
        self.rates = measure_machine_rates(mc.dtype)  # the device is still free: nothing loaded yet
        self.page = sa.page_size
        max_bs, self.warmup_steps = max(args.batch_size), args.warmup_steps
        per_seq = max(args.input_len) + args.warmup_steps + sa.num_continuous_decode_steps + args.output_len
        if per_seq > mc.context_len:
            sys.exit(f"--input-len + --warmup-steps + --output-len = {per_seq} exceeds the context length "
                     f"{mc.context_len}; raise --context-length")
        max_running, buckets, max_prefill, chunk = derive_limits(sa, mc, platform)
        if max_running < max_bs:
            if sa.max_running_requests is not None or sa.precompile_bs_paddings is not None:
                sys.exit(f"--batch-size {max_bs} exceeds --max-running-requests / the largest "
                         f"--precompile-bs-paddings ({max_running}); raise them")
            sa = dataclasses.replace(sa, max_running_requests=max_bs)  # re-validated
            max_running, buckets, max_prefill, chunk = derive_limits(sa, mc, platform)
        self.buckets, self.budget = buckets, chunk or max_prefill
        if self.budget < self.page:
            sys.exit(f"a prefill step's token budget ({self.budget}) is less than --page-size {self.page}")
        self.need = max(b * math.ceil((i + per_seq - max(args.input_len)) / self.page) * self.page
                        for b in args.batch_size for i in args.input_len)
        hybrid = bool(mc.swa_layer_ids) and not sa.disable_hybrid_swa_memory
        if sa.max_total_tokens is None and sa.mem_fraction_static is None:  # both pools must hold `need`
            ratio = min(sa.swa_full_tokens_ratio, 1.0) if hybrid else 1.0
            sa = dataclasses.replace(sa, max_total_tokens=math.ceil(self.need / ratio) + 2 * self.page)
        self.server_args = sa
        self.runner = runner = ModelRunner(
            sa, mc, buckets=buckets, max_context_len=mc.context_len, num_request_slots=max_running,
            kv_spec_fn=lambda wb: kv_spec_for(sa, mc, compute_max_total_tokens(sa, mc, wb, platform)))
        pools = runner.kv_spec.pool_tokens
        if min(pools) < self.need:
            sys.exit(f"the KV pool ({' / '.join(map(str, pools))} tokens) cannot hold the largest batch: "
                     f"{self.need} tokens (batch x (input + warm-up + output), pages of {self.page}); raise "
                     "--max-total-tokens (or leave it and --mem-fraction-static unset to size it from the batch)")
        # the scheduler's KV memory without prefix sharing (every row is timed from scratch)
        self.memory = KVMemory.create(runner.kv_spec, num_request_slots=max_running, context_len=mc.context_len,
                                      disable_radix_cache=True)
        self.cost = model_cost(runner)
        if not sa.disable_precompile:
            runner.warmup()
        yield_to_launcher(platform, sa.num_continuous_decode_steps)  # (as the scheduler does after its warm-up)
        self.loop = DecodeLoop(runner, self.memory, buckets, sa.num_continuous_decode_steps)
        self.warmup_iters = -(-args.warmup_steps // sa.num_continuous_decode_steps)  # launches of K steps
        self.profile_dir, self.profile_steps = args.profile, args.profile_steps
        self.repeats = args.decode_repeats
        self.sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}

    def _step(self, batch: ScheduleBatch) -> Tuple[list, float]:
        """Build and run one prepared step, then commit its KV and take the sampled tokens as the scheduler does.
        Returns ([(tokens in KV before, new tokens)] per sequence, seconds spent building the batch)."""
        seqs = [(r.kv_committed_len, r.kv_allocated_len - r.kv_committed_len) for r in batch.reqs]
        t0 = time.perf_counter()
        wb = batch.build_model_worker_batch(self.buckets, self.memory)
        host = time.perf_counter() - t0
        out = self.runner.forward(wb)  # returns host arrays of the sampled ids: the step has finished
        for i, r in enumerate(batch.reqs):
            r.kv_committed_len = r.kv_allocated_len
            if r.kv_committed_len >= r.seqlen:  # prompt fully prefilled, or a decode step: take the token
                r.output_ids.append(int(out.next_token_ids[i]))
        self.memory.after_step(batch.reqs)
        return seqs, host

    def prefill(self, reqs: List[Req]) -> Tuple[float, List[list]]:
        """Run the extend steps of `plan_prefill` (each padded shape run once untimed first).
        Returns (seconds, per step [(tokens in KV before, new tokens)] per sequence)."""
        plan = plan_prefill([len(r.origin_input_ids) for r in reqs], self.budget, self.buckets.max_bs, self.page)
        for t, s in {self.buckets.extend_shape(sum(n for _, n in st), len(st)) for st in plan}:
            self.runner.forward(self.runner.dummy_batch(ForwardMode.EXTEND, t, s))
        steps, t0 = [], time.perf_counter()
        for step in plan:
            for i, n in step:
                reqs[i].extend_input_len = n
            batch = ScheduleBatch([reqs[i] for i, _ in step], ForwardMode.EXTEND)
            batch.prepare_for_extend(self.memory)
            steps.append(self._step(batch)[0])
        return time.perf_counter() - t0, steps

    def new_reqs(self, bs: int, input_len: int, output_len: int, seed: int) -> List[Req]:
        """B requests of L random token ids (seeded by the row), sampled with per-request seeds."""
        rng = np.random.default_rng([seed, bs, input_len])
        ids = rng.integers(0, self.mc.vocab_size, size=(bs, input_len)).tolist()
        sp = SamplingParams(max_new_tokens=self.warmup_iters * self.loop.num_steps + output_len + 1, ignore_eos=True,
                            **self.sampling)
        return [Req(f"bench-{bs}-{input_len}-{i}", p, sp, eos_token_ids=self.mc.eos_token_ids, seed=seed + i)
                for i, p in enumerate(ids)]

    def release(self, reqs: List[Req]) -> None:
        for r in reqs:
            self.memory.release(r)
        assert self.memory.free_tokens() == self.memory.size, "KV pages leaked"

    def warm_decode_shape(self, bs: int) -> None:
        """Run the decode program of a batch of `bs` once on padding (its first run is not timed)."""
        t, s = self.buckets.decode_shape(bs)
        idle = [None] * (self.runner.dp_size - 1)
        if self.runner.slot_decode:
            filtering = bool(SamplingParams(**self.sampling).filters())  # (the program the rows will run)
            self.runner.launch_decode([DecodeRows.padding(s, self.loop.num_steps, filtering)] + idle).resolve()
        else:
            self.runner.forward(self.runner.dummy_batch(ForwardMode.DECODE, t, s))

    def decode_pass(self, reqs: List[Req], iterations: int, overlap: bool, trace: Optional[str] = None) -> list:
        """The row's prompts prefilled, the warm-up steps run, then `iterations` timed iterations of the decode loop
        (bench_decode_loops.DecodeLoop) with or without overlap; `trace`: a jax.profiler trace directory for the first
        --profile-steps iterations. Returns the iterations' times; the requests hold their tokens."""
        self.prefill(reqs)
        self.loop.run(reqs, self.warmup_iters, overlap=False)
        return self.loop.run(reqs, iterations, overlap, trace, self.profile_steps if trace else 0)

    def run_row(self, bs: int, input_len: int, output_len: int, seed: int) -> dict:
        """Prefill B x L random prompts, run the warm-up decode steps, time `output_len` decode steps (output_len / K
        launches of K steps), free all, --decode-repeats times; then as many passes of the overlap loop (unless
        --disable-overlap-schedule), whose output tokens must be the same. The loops' medians are over the
        iterations of all their passes (a batch of 1 with K = 8 launches 8 times a pass)."""
        K = self.loop.num_steps
        iterations = max(1, output_len // K)
        compiles = self.runner.num_compiles_after_warmup  # None: not counted (--disable-precompile)
        reqs = self.new_reqs(bs, input_len, output_len, seed)
        prefill_s, steps = self.prefill(reqs)
        prefill_floors = [step_floor(self.cost, st, self.rates) for st in steps]
        self.warm_decode_shape(bs)
        self.loop.run(reqs, self.warmup_iters, overlap=False)
        mid = [(r.seqlen - 1 + K * (iterations // 2), 1) for r in reqs]  # the median iteration's first step
        sync = self.loop.run(reqs, iterations, overlap=False)
        # the device's own time per launch: the last one re-run back to back (same KV slots)
        device_s = self.device_seconds(iterations)
        self.release(reqs)
        tokens = [r.output_ids for r in reqs]
        same = True  # every pass's tokens equal the first's
        for _ in range(self.repeats - 1):
            again = self.new_reqs(bs, input_len, output_len, seed)
            sync += self.decode_pass(again, iterations, False)
            same &= [r.output_ids for r in again] == tokens
            self.release(again)
        overlap = {}
        if not self.server_args.disable_overlap_schedule and iterations >= 2:
            trace = None if self.profile_dir is None else os.path.join(self.profile_dir, f"bs{bs}-in{input_len}")
            times = []
            for i in range(self.repeats):
                again = self.new_reqs(bs, input_len, output_len, seed)
                times += self.decode_pass(again, iterations, True, trace if i == 0 else None)
                same &= [r.output_ids for r in again] == tokens
                self.release(again)
            overlap = {"times": times, "tokens_identical": same}
            if trace is not None:  # the device's own busy share, from its stream events (None on CPU)
                overlap["trace"] = bench_trace.summarize(bench_trace.load_events(bench_trace.find_trace(trace)))
        if compiles is not None:
            compiles = self.runner.num_compiles_after_warmup - compiles
        p_floor = sum(f[0] for f in prefill_floors)
        p_flops, p_bytes = sum(f[2] for f in prefill_floors), sum(f[3] for f in prefill_floors)
        p_bound = self.rates.floor(p_flops, p_bytes)[1]
        sync_ms = medians_ms(sync)
        med = sync_ms["total"] / 1e3 / K  # seconds per decode step (token)
        d_floor = step_floor(self.cost, mid, self.rates)
        per_step = device_s / K
        return {"batch_size": bs, "input_len": input_len, "output_len": output_len, "decode_steps_per_launch": K,
                "prefill_latency_s": prefill_s, "prefill_steps": len(steps),
                "prefill_throughput_tok_s": bs * input_len / prefill_s, "prefill_floor_s": p_floor,
                "prefill_bound": p_bound, "prefill_x_floor": prefill_s / p_floor, "prefill_flops": p_flops,
                "prefill_bytes": p_bytes,
                "decode_median_ms": 1e3 * med,
                "decode_p90_ms": 1e3 * float(np.percentile([t.total for t in sync], 90)) / K,
                "decode_host_median_ms": (sync_ms["build"] + sync_ms["h2d"] + sync_ms["dispatch"]
                                          + sync_ms["apply"]) / K,
                "decode_throughput_tok_s": bs / med,
                "decode_device_ms": 1e3 * per_step, "decode_host_gap_ms": 1e3 * (med - per_step),
                "decode_busy_share": per_step / med, "split_sync_ms": sync_ms,
                **overlap_columns(overlap, med, per_step, K),
                "decode_floor_ms": 1e3 * d_floor[0], "decode_bound": d_floor[1],
                "decode_x_floor": med / d_floor[0], "decode_step_flops": d_floor[2], "decode_step_bytes": d_floor[3],
                "compiles_after_warmup": compiles, "trace": overlap.get("trace"), "decode_repeats": self.repeats,
                "decode_iterations_timed": len(sync), "overlap_iterations_timed": len(overlap.get("times", []))}

    def device_seconds(self, repeats: int, blocks: int = DEVICE_BLOCKS) -> float:
        """The device's time per launch of the loop's last inputs (`device_timing.device_seconds_per_decode`, or
        `device_seconds_per_step` on a runner without slot state): the median of `blocks` blocks of `repeats`
        launches back to back, so that one block slowed by the machine moves it no more than a slow iteration moves
        the loops' medians."""
        time_block = device_seconds_per_decode if self.runner.slot_decode else device_seconds_per_step
        return float(np.median([time_block(self.runner, self.loop.last_inputs, repeats) for _ in range(blocks)]))


def overlap_columns(overlap: dict, sync_step_s: float, device_step_s: float, num_steps: int = 1) -> dict:
    """The JSONL keys of the overlap pass (None when it did not run); times per decode step (a launch of K steps
    divided by K)."""
    if not overlap:
        return {"decode_overlap_median_ms": None, "decode_busy_share_overlap": None, "overlap_speedup": None,
                "tokens_identical": None, "split_overlap_ms": None}
    split = medians_ms(overlap["times"])
    med = split["total"] / 1e3 / num_steps
    return {"decode_overlap_median_ms": 1e3 * med, "decode_busy_share_overlap": device_step_s / med,
            "decode_host_gap_ms_overlap": 1e3 * (med - device_step_s), "overlap_speedup": sync_step_s / med,
            "tokens_identical": overlap["tokens_identical"], "split_overlap_ms": split}


def format_row(r: dict) -> str:
    """One markdown table row of a result of `OneBatchRunner.run_row`."""
    cells = [r["batch_size"], r["input_len"], r["output_len"], f"{r['prefill_latency_s']:.3f}", r["prefill_steps"],
             f"{r['prefill_throughput_tok_s']:.0f}", f"{r['prefill_floor_s']:.4f} {r['prefill_bound']}",
             f"{r['prefill_x_floor']:.1f}", f"{r['decode_median_ms']:.2f}", f"{r['decode_p90_ms']:.2f}",
             f"{r['decode_host_median_ms']:.2f}", f"{r['decode_device_ms']:.2f}",
             f"{100 * r['decode_busy_share']:.0f}", *overlap_cells(r), f"{r['decode_throughput_tok_s']:.1f}",
             f"{r['decode_floor_ms']:.3f} {r['decode_bound']}", f"{r['decode_x_floor']:.1f}"]
    return "| " + " | ".join(map(str, cells)) + " |"


def overlap_cells(r: dict) -> List[str]:
    """The row's overlap ms, overlap busy % and x overlap cells ("-" without the overlap pass)."""
    if r.get("decode_overlap_median_ms") is None:
        return ["-", "-", "-"]
    return [f"{r['decode_overlap_median_ms']:.2f}", f"{100 * r['decode_busy_share_overlap']:.0f}",
            f"{r['overlap_speedup']:.2f}"]


SPLIT_COLUMNS = ("bs", "loop", "K", "iteration ms", *(f"{f} ms" for f in SPLIT_FIELDS), "device ms", "idle %")


def split_rows(r: dict) -> List[str]:
    """The markdown rows of where one result's loop iterations spend their time (medians per launch of K steps;
    idle % = the share of an iteration the device does not run: 1 - device / iteration, at least 0)."""
    K = r.get("decode_steps_per_launch", 1)
    out = []
    for loop, key in (("no overlap", "split_sync_ms"), ("overlap", "split_overlap_ms")):
        split = r.get(key)
        if not split:
            continue
        device = r["decode_device_ms"] * K
        idle = max(0.0, 1.0 - device / split["total"])
        cells = [r["batch_size"], loop, K, f"{split['total']:.3f}", *(f"{split[f]:.3f}" for f in SPLIT_FIELDS),
                 f"{device:.3f}", f"{100 * idle:.0f}"]
        out.append("| " + " | ".join(map(str, cells)) + " |")
    return out


def split_table(rows: List[dict]) -> List[str]:
    """The split table of every row (see `split_rows`), header included."""
    return (["| " + " | ".join(SPLIT_COLUMNS) + " |", "|" + "---|" * len(SPLIT_COLUMNS)]
            + [line for r in rows for line in split_rows(r)])


def parse_args(argv: List[str]) -> Tuple[ServerArgs, argparse.Namespace]:
    """Every ServerArgs flag plus the benchmark's own."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--input-len", type=int, nargs="+", default=[1500], help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=16, help="decode steps timed")
    parser.add_argument("--warmup-steps", type=int, default=2, help="untimed decode steps before the timed ones")
    parser.add_argument("--decode-repeats", type=int, default=DECODE_REPEATS,
                        help="passes of each row's timed decode loops (prompts prefilled again, the same seeds); "
                             "the loops' medians are over all their iterations")
    parser.add_argument("--temperature", type=float, default=1.0, help="every request's temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="every request's top_p (1: off)")
    parser.add_argument("--top-k", type=int, default=-1, help="every request's top_k (-1: off)")
    parser.add_argument("--run-name", default="default")
    parser.add_argument("--result-filename", help="JSONL file: one line per row is appended")
    parser.add_argument("--profile", metavar="DIR", help="write a jax.profiler trace (TensorBoard's xplane and a "
                        "Perfetto perfetto_trace.json.gz) of the first --profile-steps iterations of each row's "
                        "overlapped decode loop to DIR/bs{B}-in{L}")
    parser.add_argument("--profile-steps", type=int, default=16, help="decode loop iterations traced per row")
    parser.add_argument("--report", help="generated report NAME.md (table, command, commit, date, CPUs, rates) "
                                         "and NAME.json (its raw rows) to write")
    args = parser.parse_args(argv)
    for name in ("batch_size", "input_len"):
        if min(getattr(args, name)) < 1:
            parser.error(f"--{name.replace('_', '-')} values must be >= 1")
    if args.output_len < 1 or args.warmup_steps < 0 or args.decode_repeats < 1:
        parser.error("--output-len and --decode-repeats must be >= 1, --warmup-steps >= 0")
    if not (0.0 <= args.temperature < float("inf")) or not (0.0 < args.top_p <= 1.0) or not -1 <= args.top_k < 2**31:
        parser.error("--temperature must be a finite value >= 0, --top-p in (0, 1], --top-k -1 (off) or >= 0")
    if args.random_seed is None:
        args.random_seed = 0  # random prompts and dummy weights reproducible by default
    try:
        return ServerArgs.from_cli_args(args), args
    except ValueError as e:
        parser.error(str(e))


def report_body(raw: dict) -> str:
    """The report's markdown body, computed from `raw` alone (the .json of `write_report`: header, rows)."""
    rows = raw["rows"]
    counts = [r["compiles_after_warmup"] for r in rows]
    compiles = ("not counted (--disable-precompile: no warm-up to count from)" if None in counts
                else sum(counts))
    table = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)] + [format_row(r) for r in rows]
    rates = MachineRates.from_json(rows[0]["rates"])
    split = ["Where a decode loop iteration's time goes (medians per launch; bench_decode_loops.py: build = batch, "
             "KV slots and inputs on the host, h2d = the packed inputs' copy, dispatch = the program's call, wait = "
             "blocked until the applied step's tokens are computed, d2h = then until they are on the host, apply = "
             "tokens appended; device = the program re-run back to back, the median of "
             f"{DEVICE_BLOCKS} blocks):", "", *split_table(rows)]
    traced = [(f"batch {r['batch_size']}, input {r['input_len']}", r["trace"]) for r in rows if r.get("trace")]
    if traced:
        split += ["", "From the jax.profiler trace of each row's overlapped loop (bench_trace.py: device ms = the "
                  "union of the device streams' events per iteration; busy % = that over the traced iterations' span; the "
                  "host columns are XLA's spans per iteration: the executable's thunks, the CUDA graph's update and "
                  "launch, conditionals waiting for their predicate; the Python tracer slows the host under "
                  "tracing):", "", bench_trace.markdown(traced)]
    return "\n".join([*[f"- {h}" for h in raw["header"]], f"- machine rates {rates.describe()}", "", *table, "",
                      *split, "",
                      f"Programs compiled after warm-up, over every row (the runner's count): {compiles}.", "",
                      f"Commit {raw['commit']}, {raw['date']}, {raw['cpus']}, jax {raw['jax']}."])


def main(argv: Optional[List[str]] = None) -> None:
    """Run every (batch size, input length) row; print the table, append JSONL lines, write the report."""
    argv = sys.argv[1:] if argv is None else argv
    sa, args = parse_args(argv)
    configure_logging(sa.log_level, "bench_one_batch")
    bench = OneBatchRunner(sa, args)
    sa, mc, runner, cost = bench.server_args, bench.mc, bench.runner, bench.cost
    kv_dtype = runner.kv_caches[0][0].dtype
    weights = "dummy" if sa.load_format == "dummy" else os.path.basename(mc.model_path)
    header = [f"model {mc.architecture} ({weights} weights, {mc.dtype}), KV {kv_dtype} "
              f"{sum(cost.layer_kv_bytes)} B/token, page {sa.page_size}, tp {runner.tp_size}, "
              f"{jax.devices()[0].device_kind} ({describe_attention(runner.attention_backend)} attention), "
              f"{os.cpu_count()} CPUs",
              f"per step: {cost.weight_bytes / 1e6:.1f} MB of weights read, {2 * cost.token_params / 1e6:.1f} "
              f"MFLOP per token + {2 * cost.head_params / 1e6:.1f} MFLOP lm-head per sequence (per device)",
              f"floors at the machine rates measured in this run; F: compute-bound, B: bandwidth-bound; x floor = "
              f"measured / floor; decode: median of {args.decode_repeats} x {args.output_len} steps, each pass after "
              f"{args.warmup_steps} warm-up",
              f"sampling: temperature {args.temperature}, top_p {args.top_p}, top_k {args.top_k}, a seed per request"]
    print("\n".join(header + [f"machine rates {bench.rates.describe()}", "", "| " + " | ".join(COLUMNS) + " |",
                              "|" + "---|" * len(COLUMNS)]), flush=True)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    commit = git_commit()
    extra = {"run_name": args.run_name, "model": mc.model_path, "dtype": mc.dtype, "kv_dtype": str(kv_dtype),
             "page_size": sa.page_size, "rates": bench.rates.to_json(), "commit": commit, "date": now}
    rows = []
    shapes = [(b, i) for b in args.batch_size for i in args.input_len]
    for bs, input_len in tqdm(shapes, desc="bench_one_batch", unit="row"):
        rows.append({**extra, **bench.run_row(bs, input_len, args.output_len, args.random_seed)})
        tqdm.write(format_row(rows[-1]))
        if args.result_filename:
            with open(args.result_filename, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
    print("\n".join([""] + split_table(rows)), flush=True)
    if runner.num_compiles_after_warmup:
        print(f"warning: {runner.num_compiles_after_warmup} programs compiled after warm-up (before the timed "
              "steps of their shape, untimed; see compiles_after_warmup per row)", flush=True)
    if args.report:
        env = " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in ("JAX_PLATFORMS", "XLA_FLAGS") if k in os.environ)
        command = (env + " " if env else "") + "python -m sgl_jax.bench_one_batch " + shlex.join(argv)
        raw = {"header": header, "commit": commit, "date": now, "jax": jax.__version__,
               "cpus": f"{os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} usable)", "rows": rows}
        write_report(args.report, f"bench_one_batch: {args.run_name}", command, report_body(raw), raw)
    if any(r["tokens_identical"] is False for r in rows):
        sys.exit("the overlap loop's output tokens differ from the loop without overlap (tokens_identical false)")


if __name__ == "__main__":
    main()
