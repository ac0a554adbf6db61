"""STANDALONE speculative decoding's draft model: a smaller model of the target's vocabulary that drafts a chain of
--speculative-num-steps tokens per request by decoding greedily (SGLang's StandaloneWorker; Leviathan et al. 2023).

Memory (SGLang's design: the draft worker shares the target's request-to-token map and allocator): the draft model
has its own K/V buffers, laid out like the target's full-attention pool, so a request's KV slot holds the target's
K/V in the target's buffers and the draft's in the draft's. One allocator, one page table per request, one prefix
cache and one release path serve both: a cached prefix, a retract, a rollback of rejected draft slots or a session's
kept KV is the same for both models. For that every forward the target runs (extend, decode, verify) also runs on
the draft (`DraftModel.mirror`), writing the draft's K/V at the same slots, so the draft's KV is valid wherever the
target's is.

A decode step with drafts (`DraftModel.draft`): each request that may draft takes KV slots for its chain
(`KVMemory.allocate_drafts`), then the draft model decodes: step k feeds the chain's k-th token (the root, the
request's last token, first) at position ``seq_len - 1 + k`` and takes the greedy next token. The chains become the
rank's TARGET_VERIFY batch (scheduler/speculative/speculation.py verifies, accepts and rolls back as for NGRAM). Chains
have their accepted slots in place: no K/V moves.

With --speculative-eagle-topk k > 1 the draft model drafts a tree instead (`DraftModel._decode_trees`, SGLang's
EAGLE search over a draft model, `draft_tree.TopkTree`): each draft step feeds the tree so far -- the root and the
ancestors of the k best paths -- as a TARGET_VERIFY forward of the draft model (tree-masked, into the request's
draft slots, which the target's verify step overwrites) and takes the k most likely next tokens after each of the k
paths; the verify step checks the best --speculative-num-draft-tokens slots of every candidate.

Sampled requests draft greedily too: verification draws the target's tokens with the request's own random stream
(see speculation.py), so a draft only decides how many of those tokens one step emits, never which.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np
from flax import nnx

from sgl_jax.srt import fault_injection
from sgl_jax.srt.forward_batch import ForwardBatch, ForwardMode, ModelWorkerBatch
from sgl_jax.srt.mem_cache.kv_memory import KVCacheSpec
from sgl_jax.srt.model_executor.buckets import ShapeBuckets
from sgl_jax.srt.scheduler.speculative.draft_runners import DraftModelRunner
from sgl_jax.srt.model_executor.memory_budget import kv_bytes_per_token
from sgl_jax.srt.model_executor.model_runner import ModelRunner
from sgl_jax.srt.model_loader.loader import JNP_DTYPES
from sgl_jax.srt.models.registry import get_model_class
from sgl_jax.srt.sampling.sampling_batch import SamplingBatch
from sgl_jax.srt.scheduler.schedule_batch import Req, ScheduleBatch, cumulative_lens, last_input_token, pad_to, \
    page_table
from sgl_jax.srt.scheduler.speculative.speculation import tree_forward_batch
from sgl_jax.srt.speculative.draft_tree import TopkTree, chain_parents

logger = logging.getLogger(__name__)


def draft_server_args(server_args, context_len: int):
    """The `ServerArgs` the draft model loads with: --speculative-draft-model-path (+ revision) as the model, the
    target's context length `context_len` (the draft reads every position the target does), no speculation of its
    own, and its weights in the model dtype (--quantization applies to the target only)."""
    return dataclasses.replace(
        server_args, model_path=server_args.speculative_draft_model_path, context_length=context_len,
        revision=server_args.speculative_draft_model_revision, speculative_algorithm=None, quantization=None,
        speculative_draft_model_path=None, speculative_draft_model_revision=None, speculative_num_steps=None,
        speculative_eagle_topk=None, speculative_num_draft_tokens=None)


def check_draft_config(draft_config, target_config) -> None:
    """A draft model must share the target's vocabulary (its token ids are the target's) and attend to every
    position (its K/V lives in the target's full-attention slots).

    Raises:
        ValueError: naming --speculative-draft-model-path and what differs.
    """
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"--speculative-draft-model-path {draft_config.model_path}: its vocabulary has "
                         f"{draft_config.vocab_size} tokens, the target's {target_config.vocab_size}; a draft model "
                         f"must use the target's tokenizer")
    if draft_config.sliding_window is not None:
        raise ValueError(f"--speculative-draft-model-path {draft_config.model_path}: a draft model with "
                         f"sliding-window layers is not supported (its K/V shares the target's full-attention "
                         f"slots)")


def param_bytes(model_config, tp_size: int = 1) -> int:
    """Bytes of the model's parameters on one device (split `tp_size` ways; from the abstract model, nothing is
    loaded): what the draft model takes from the KV budget before the target's pool is sized."""
    cls = get_model_class(model_config.architecture)
    dtype = JNP_DTYPES[model_config.dtype]
    abstract = nnx.eval_shape(lambda: cls(model_config, dtype=dtype, rngs=None))  # (shapes only)
    total = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in jax.tree.leaves(nnx.state(abstract)))
    return total // max(tp_size, 1)


def draft_reserve(server_args, draft_config) -> Tuple[int, int]:
    """(weight bytes, KV bytes per token) of the draft model on one device: taken out of the target's KV budget."""
    return (param_bytes(draft_config, server_args.tp_size),
            kv_bytes_per_token(draft_config, server_args.tp_size, server_args.kv_cache_dtype))


def draft_kv_spec(target_spec: KVCacheSpec, num_layers: int) -> KVCacheSpec:
    """The draft's K/V buffers: the target's full-attention pool (same pages and slots), one buffer per draft
    layer."""
    return KVCacheSpec(page_size=target_spec.page_size, pool_tokens=target_spec.pool_tokens[:1],
                       layer_pool=(0,) * num_layers)


def for_draft(batch: Optional[ModelWorkerBatch]) -> Optional[ModelWorkerBatch]:
    """A target step's batch as the draft runs it: without the sliding-window pool's fields (every draft layer
    reads the full-attention slots)."""
    if batch is None or batch.forward_batch.swa_page_indices is None:
        return batch
    fb = dataclasses.replace(batch.forward_batch, swa_page_indices=None, swa_out_cache_loc=None)
    return dataclasses.replace(batch, forward_batch=fb)


def tree_step_batch(reqs: Sequence[Req], trees: Sequence[Tuple[np.ndarray, np.ndarray]], memory,
                    shape: tuple) -> ModelWorkerBatch:
    """Host arrays of a tree draft step (a TARGET_VERIFY forward of the draft model, padded to `shape` =
    (TARGET_VERIFY, T_pad, S_pad)): request i's tree ``trees[i]`` (tokens, parents; `TopkTree.fed`) laid out as a
    verify step lays out a draft tree (`speculation.tree_forward_batch`) in its root's and first draft slots;
    padding (greedy) sampling rows."""
    _, t_pad, s_pad = shape
    fb = tree_forward_batch(reqs, trees, memory, t_pad, s_pad)
    return ModelWorkerBatch(forward_batch=fb, sampling=SamplingBatch.padding(t_pad),
                            num_tokens=sum(len(t) for t, _ in trees), num_seqs=len(reqs))


def tree_steps(num_slots: int, topk: int, num_steps: int) -> int:
    """Draft steps of a top-k tree of `num_slots` slots: at most `num_steps`, and no more than the slots hold the
    tree a step feeds (1 + topk x (steps - 1) <= num_slots)."""
    return max(1, min(num_steps, 1 + (num_slots - 1) // topk))


def draft_step_batch(reqs: Sequence[Req], tokens: Sequence[int], k: int, memory, shape: tuple) -> ModelWorkerBatch:
    """Host arrays of draft step `k` (a DECODE step of the draft model, padded to `shape` = (DECODE, T_pad, S_pad)):
    request i feeds ``tokens[i]`` at position ``seq_len - 1 + k`` into that position's KV slot (its root's, or a
    draft slot taken by `KVMemory.allocate_drafts`); every row samples greedily (padding rows are greedy)."""
    _, t_pad, s_pad = shape
    pool = memory.req_to_token_pool
    rows = np.asarray([r.req_pool_idx for r in reqs], np.int64)
    pos = np.asarray([r.seqlen - 1 + k for r in reqs], np.int64)
    n = len(reqs)
    fb = ForwardBatch(
        input_ids=pad_to(np.asarray(tokens, np.int32), t_pad), positions=pad_to(pos, t_pad),
        out_cache_loc=pad_to(pool.req_to_token[rows, pos], t_pad), cu_q_lens=cumulative_lens(np.ones(n), s_pad),
        kv_lens=pad_to(pos + 1, s_pad), page_indices=page_table(pool, rows, s_pad, memory.page_size),
        num_seqs=np.asarray(n, np.int32), logits_indices=pad_to(np.arange(n), s_pad),
        prefix_lens=np.zeros(s_pad, np.int32), segment_starts=np.zeros(t_pad, np.int32),
        shared_prefix_len=np.asarray(0, np.int32), forward_mode=ForwardMode.DECODE)
    return ModelWorkerBatch(forward_batch=fb, sampling=SamplingBatch.padding(s_pad), num_tokens=n, num_seqs=n)


class DraftModel:
    """The draft model of every DP rank (one runner: the ranks' K/V blocks are its buffers' blocks, as the
    target's).

    Args:
        runner: the draft `ModelRunner` (K/V buffers from `draft_kv_spec`).
        buckets: the compiled shapes (the target's: the draft runs every target step and its own decode steps).
    """

    def __init__(self, runner: ModelRunner, buckets: ShapeBuckets, topk: int = 1, num_steps: int = 1):
        self.runner = runner
        self.buckets = buckets
        self.topk = topk  # --speculative-eagle-topk: 1 drafts chains, more draft trees (`_decode_trees`)
        self.num_steps = num_steps  # --speculative-num-steps: a tree's depth
        self.num_draft_steps = 0  # draft-model decode steps run
        self.failed: Optional[str] = None  # why drafting stopped for good (a draft-model program failed)

    def _fail(self, what: str, exc: BaseException) -> None:
        """A draft-model program failed: drafting stops for good (its K/V may be stale or lost). Outputs stay
        correct -- the target verifies every token -- and decoding goes on without drafts."""
        self.failed = f"{what}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        logger.error("The draft model failed (%s); decoding goes on without speculation", self.failed)

    @property
    def mirror_runner(self) -> Optional[ModelRunner]:
        """The runner that runs every target step too (`mirror`): its cost counts in both of the batch rule's
        programs (scheduler/speculative/spec_costs.py)."""
        return self.runner

    def mirror(self, batches: Sequence[Optional[ModelWorkerBatch]]) -> None:
        """Dispatch the target step's forward on the draft model (its K/V at the step's slots; logits unused)."""
        if self.failed is None:
            try:
                self.runner.launch_forward([for_draft(b) for b in batches])
            except Exception as exc:
                self._fail("running a step on the draft model", exc)

    def after_step(self, launched, outs) -> None:
        """Nothing: the draft model ran the step with the target (`mirror`); an EAGLE head runs here."""

    def move_kv(self, moves) -> None:
        """The K/V moves of a verify step (`ModelRunner.move_kv`), on the draft's buffers too."""
        if self.failed is None:
            try:
                self.runner.move_kv(moves)
            except Exception as exc:
                self._fail("moving the draft model's K/V", exc)

    def draft(self, batches: List[Optional[ScheduleBatch]], ranks) -> List[Optional[ScheduleBatch]]:
        """Turn the ranks' decode batches into verify batches with chains drafted by the draft model. A rank's
        requests draft as its `Speculator.draft_budget` allows (slots, the root included) and as KV slots can be
        had; a batch with no draft stays a decode batch. Nothing is drafted in a step where a rank extends
        (`speculation.unify_step` would drop the drafts), nor after the draft model failed (`_fail`: the draft
        slots taken are given back and the batches decode)."""
        if self.failed is not None or any(b is not None and b.forward_mode == ForwardMode.EXTEND for b in batches):
            return batches
        plans = self._plan(batches, ranks)
        if not any(plans):
            return batches
        try:
            t0 = time.perf_counter()
            if self.topk > 1:
                drafts = self._decode_trees(plans, ranks)
            else:
                drafts = [{key: (np.asarray(c, np.int32), chain_parents(len(c))) for key, c in chains.items()}
                          for chains in self._decode_chains(plans, ranks)]
            seconds = time.perf_counter() - t0
            for batch, plan, rank in zip(batches, plans, ranks):
                if plan:
                    rank.speculator.observe_draft(len(batch.reqs), seconds)
        except Exception as exc:
            self._fail("drafting", exc)
            for plan, rank in zip(plans, ranks):
                for req, _ in plan:
                    rank.memory.rollback(req, req.seqlen)
            return batches
        out = []
        for batch, rank_drafts in zip(batches, drafts):
            if rank_drafts:
                batch = ScheduleBatch(list(batch.reqs), ForwardMode.TARGET_VERIFY, rank_drafts)
            out.append(batch)
        return out

    def _plan(self, batches: List[Optional[ScheduleBatch]], ranks) -> List[List[Tuple[Req, int]]]:
        """Per rank, its decode batch's requests that draft and their drafts' slots (KV slots taken); none in a
        batch where drafting does not pay (`Speculator.batch_pays`, which counts a tree as its deepest path: the
        most it can have accepted)."""
        plans: List[List[Tuple[Req, int]]] = []
        for batch, rank in zip(batches, ranks):
            plan = []
            if batch is not None and batch.forward_mode == ForwardMode.DECODE:
                budgets = [(req, rank.speculator.draft_budget(req)) for req in batch.reqs]
                budgets = [(req, n) for req, n in budgets if n >= 2]
                paths = budgets if self.topk == 1 else [(req, 1 + tree_steps(n, self.topk, self.num_steps))
                                                        for req, n in budgets]
                if rank.speculator.batch_pays(len(batch.reqs), paths):
                    plan = [(req, n) for req, n in budgets if rank.memory.allocate_drafts(req, n - 1)]
            plans.append(plan)
        return plans

    def _decode_chains(self, plans: List[List[Tuple[Req, int]]], ranks) -> List[Dict[int, List[int]]]:
        """Run the draft model's decode steps for every rank's plan: per rank, id(req) -> its chain's tokens (the
        root first)."""
        fault_injection.check("draft", [r.rid for p in plans for r, _ in p])
        chains: List[Dict[int, List[int]]] = [{id(r): [last_input_token(r)] for r, _ in p} for p in plans]
        for k in range(max(n for p in plans for _, n in p) - 1):
            live = [[r for r, n in p if n - 1 > k] for p in plans]
            shape = (ForwardMode.DECODE, *self.buckets.decode_shape(max(len(x) for x in live)))
            step = [draft_step_batch(x, [chains[i][id(r)][k] for r in x], k, ranks[i].memory, shape) if x else None
                    for i, x in enumerate(live)]
            if all(b is None for b in step):
                break
            outs = self.runner.forward_ranks(step)
            self.num_draft_steps += 1
            for i, x in enumerate(live):
                for r, token in zip(x, outs[i].next_token_ids if x else ()):
                    chains[i][id(r)].append(int(token))
        return chains

    def _decode_trees(self, plans: List[List[Tuple[Req, int]]], ranks) -> List[Dict[int, tuple]]:
        """Grow every planned request's top-k tree (`draft_tree.TopkTree`, `tree_step_batch`): per rank, id(req)
        -> the tree to verify (tokens int32, parents int32), its unused draft slots given back."""
        fault_injection.check("draft", [r.rid for p in plans for r, _ in p])
        trees = [{id(r): TopkTree(last_input_token(r), self.topk) for r, _ in p} for p in plans]
        steps = [{id(r): tree_steps(n, self.topk, self.num_steps) for r, n in p} for p in plans]
        for k in range(max(s for rank in steps for s in rank.values())):
            live = [[r for r, _ in p if steps[i][id(r)] > k] for i, p in enumerate(plans)]
            fed = [[trees[i][id(r)].fed() for r in x] for i, x in enumerate(live)]
            shape = (ForwardMode.TARGET_VERIFY, *self.buckets.verify_shape(max(len(x) for x in live)))
            step = [tree_step_batch(x, [(t, p) for t, p, _ in f], ranks[i].memory, shape) if x else None
                    for i, (x, f) in enumerate(zip(live, fed))]
            fwd = self.runner.launch_forward(step)  # (logits only: nothing is sampled)
            self.num_draft_steps += 1
            lp, tok = self.runner.tree_top(fwd)  # [dp * T_pad, k]: every rank's slots, best first
            for i, x in enumerate(live):
                if not x:
                    continue
                start = i * fwd.s_pad
                for r, (tokens, _, rows) in zip(x, fed[i]):
                    at = start + np.asarray(rows)
                    trees[i][id(r)].expand(tok[at], lp[at])
                    start += len(tokens)
        return self._final_trees(plans, trees, ranks)

    @staticmethod
    def _final_trees(plans: List[List[Tuple[Req, int]]], trees: List[Dict[int, TopkTree]], ranks
                     ) -> List[Dict[int, tuple]]:
        """Per rank, id(req) -> the tree to verify of each planned request (`TopkTree.final` of its slots), its draft
        slots past the tree given back."""
        out = []
        for i, p in enumerate(plans):
            drafts = {}
            for r, n in p:
                tokens, parents = trees[i][id(r)].final(n)
                ranks[i].memory.rollback(r, r.seqlen - 1 + len(tokens))  # (slots past the tree go back)
                drafts[id(r)] = (tokens, parents)
            out.append(drafts)
        return out


def new_draft_model(server_args, target_runner: ModelRunner, buckets: ShapeBuckets, draft_config) -> DraftModel:
    """Load the draft model (`draft_config`: its `ModelConfig`, from `draft_server_args`) with K/V buffers beside
    the target's."""
    spec = draft_kv_spec(target_runner.kv_spec, draft_config.num_hidden_layers)
    topk = server_args.speculative_eagle_topk or 1
    runner = DraftModelRunner(draft_server_args(server_args, target_runner.max_context_len), draft_config,
                              buckets=buckets, max_context_len=target_runner.max_context_len,
                              kv_spec_fn=lambda _: spec, num_request_slots=target_runner.num_request_slots,
                              topk=topk)
    logger.info("Draft model %s (%s, %d layers) for STANDALONE speculative decoding: %s", draft_config.model_path,
                draft_config.architecture, draft_config.num_hidden_layers,
                "chains" if topk == 1 else f"top-{topk} trees, {server_args.speculative_num_steps} steps deep")
    return DraftModel(runner, buckets, topk, server_args.speculative_num_steps or 1)
