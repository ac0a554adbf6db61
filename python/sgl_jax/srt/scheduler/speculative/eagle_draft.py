"""EAGLE and EAGLE3 speculative decoding (Li et al. 2024 and 2025; SGLang's EAGLEWorker): a one-layer head over the
target's hidden states drafts a chain of --speculative-num-steps tokens per request. EAGLE's head
(models/llama_eagle.py) reads the target's final hidden states, EAGLE-3's (models/llama_eagle3.py) the outputs of
three of its layers (`ModelRunner.aux_layers`); the flow is the same.

Draft row p sits in position p's KV slot and reads the token after p, so it can only run once the target has
produced that token. Hence, unlike STANDALONE's mirror, the head runs after each target step:

1. **Draft extend** (`EagleDraft.after_step`, once the step's results are applied): the target step's rows again,
   each fed the token after it (the next prompt token inside a prompt; the sampled token at a sequence's last row;
   in a verify step the target's token after each slot) and the target's features there. The row of each
   request's last committed position (``seq_len - 2`` once the step is applied: the sampling row, or in a verify
   step the last accepted slot) stores its output and draft token in the request slot's state
   (scheduler/speculative/draft_runners.py). Every committed position then has its draft K/V, as the target's: a cached
   prefix, a retract, a rollback or a session's kept KV is the same for both (SGLang's EAGLE worker shares the
   target's allocator and page tables too).
2. **Drafting** (`EagleDraft.draft`, before the step, as STANDALONE): a request's chain is its root (the last
   token), the stored draft token, then one draft decode step per further token: step k feeds chain token k + 1 at
   position ``seq_len - 1 + k`` with the stored output of the step before, so a chain of n slots costs n - 2
   head forwards. Those draft rows are overwritten by the next draft extend.

Verification, acceptance, rollback and sampling are the target's (scheduler/speculative/speculation.py), as for
every drafter.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from sgl_jax.srt import fault_injection
from sgl_jax.srt.forward_batch import ForwardMode, ModelWorkerBatch
from sgl_jax.srt.model_executor.buckets import ShapeBuckets
from sgl_jax.srt.scheduler.speculative.draft_runners import EagleRunner
from sgl_jax.srt.model_executor.model_runner import ModelRunner
from sgl_jax.srt.model_loader.loader import JNP_DTYPES, read_checkpoint_tensor
from sgl_jax.srt.models.llama_eagle import head_architecture
from sgl_jax.srt.models.llama_eagle3 import hot_token_ids
from sgl_jax.srt.scheduler.speculative.draft_model import DraftModel, draft_kv_spec, for_draft, draft_server_args, \
    draft_step_batch, tree_step_batch, tree_steps
from sgl_jax.srt.scheduler.schedule_batch import Req, ScheduleBatch, last_input_token
from sgl_jax.srt.speculative.draft_tree import TopkTree

logger = logging.getLogger(__name__)

EAGLE_TARGETS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM",
                 "MixtralForCausalLM")  # targets whose embedding the head can read as it is (no scale)


def eagle_head_config(head_config, target_config, algorithm: str):
    """The head's `ModelConfig` for --speculative-algorithm `algorithm` ("EAGLE": `LlamaForCausalLMEagle`, published
    configs' ``LlamaForCausalLM`` taken as it; "EAGLE3": `LlamaForCausalLMEagle3`), checked against the target: the
    same vocabulary and hidden size, a target in EAGLE_TARGETS.

    Raises:
        ValueError: naming --speculative-draft-model-path (or the algorithm) and what differs.
    """
    path = head_config.model_path
    if algorithm == "EAGLE":
        head_config = head_architecture(head_config)
    elif head_config.architecture != "LlamaForCausalLMEagle3":
        raise ValueError(f"--speculative-draft-model-path {path}: an EAGLE3 head's architecture is "
                         f"LlamaForCausalLMEagle3, not {head_config.architecture}")
    if target_config.architecture not in EAGLE_TARGETS:
        raise ValueError(f"--speculative-algorithm {algorithm} serves targets {list(EAGLE_TARGETS)}, not "
                         f"{target_config.architecture}")
    for what, a, b in (("vocabulary size", head_config.vocab_size, target_config.vocab_size),
                       ("hidden size", head_config.hidden_size, target_config.hidden_size)):
        if a != b:
            raise ValueError(f"--speculative-draft-model-path {path}: the head's {what} is {a}, the target's {b}")
    return head_config


def draft_extend_batch(batch: ScheduleBatch, wb: ModelWorkerBatch, out) -> Tuple[ModelWorkerBatch, np.ndarray]:
    """A target step's batch as the head's draft extend runs it (see the module docstring).

    Args:
        batch: the step's launched copy (its results applied); wb: its worker batch (host arrays); out: the rank's
            `StepOutput` (sampled tokens: a row per sequence, per token in a verify step).
    Returns:
        (the batch with each token replaced by the token after it, int32[rows_pad]: per logits row the request slot
        whose state it writes, -1 for none).
    """
    fb = wb.forward_batch
    ids, positions, cu = np.asarray(fb.input_ids), np.asarray(fb.positions), np.asarray(fb.cu_q_lens)
    sampled = np.asarray(out.next_token_ids)
    new = np.zeros_like(ids)
    rows = np.full(wb.rows_pad, -1, np.int32)
    verify = fb.forward_mode == ForwardMode.TARGET_VERIFY
    for i, req in enumerate(batch.reqs):
        a, b = int(cu[i]), int(cu[i + 1])
        keep = not req.finished() and req.score is None
        if verify:  # (the last kept slot: in a tree, off the first branch too; the K/V moves run after this)
            new[a:b] = sampled[a:b]
            at = np.nonzero(positions[a:b] == req.seqlen - 2)[0]  # (a chain's, or without SpecCounts)
            last = req.spec.last_slot if req.spec is not None else (int(at[0]) if len(at) else -1)
            if keep and 0 <= last < b - a and int(positions[a + last]) == req.seqlen - 2:
                rows[a + last] = req.req_pool_idx
            continue
        new[a:b - 1] = ids[a + 1:b]
        if batch.row_samples[i]:
            new[b - 1] = sampled[i]
        elif int(positions[b - 1]) + 1 < len(req.fill_ids):
            new[b - 1] = req.fill_ids[int(positions[b - 1]) + 1]  # a prompt chunk's next token
        if keep and batch.row_samples[i] and int(positions[b - 1]) == req.seqlen - 2:
            rows[i] = req.req_pool_idx
    fb2 = dataclasses.replace(for_draft(wb).forward_batch, input_ids=new)
    return ModelWorkerBatch(forward_batch=fb2, sampling=wb.sampling, num_tokens=wb.num_tokens,
                            num_seqs=wb.num_seqs), rows


def fed_forest(tree: TopkTree, slot: int, rows_before: Dict[int, int], t0: int) -> tuple:
    """One request's part of an EAGLE tree step (`EagleDraft._decode_trees`): its fed tree without the root.

    Args:
        tree: the request's tree; slot: its request slot; rows_before: node -> its token row in the step before;
        t0: the rank's token row of the forest's first node.
    Returns:
        ((tokens int32[m], parents int32[m], -1 for the root's children), each node's feature source for
        `EagleRunner.draft_tree` (``-1 - slot``: the stored output, else its parent's row in the step before), node ->
        its token row in this step).
    """
    nodes = tree.fed_nodes()[1:]
    at = {node: j for j, node in enumerate(nodes)}
    parents = np.asarray([at.get(tree.parents[n], -1) for n in nodes], np.int32)
    tokens = np.asarray([tree.tokens[n] for n in nodes], np.int32)
    sources = [-1 - slot if tree.parents[n] == 0 else rows_before[tree.parents[n]] for n in nodes]
    return (tokens, parents), sources, {n: t0 + j for j, n in enumerate(nodes)}


class EagleDraft(DraftModel):
    """The EAGLE or EAGLE-3 head of every DP rank (see the module docstring): `DraftModel`'s planning, failure
    handling and verify batches, with the head's draft extend after each target step and its own draft steps.

    Args:
        runner: the head's `EagleRunner`; buckets: the compiled shapes (the target's).
        features: which of the target's outputs the head reads: "aux" (`StepOutput.aux`, EAGLE-3) or "hidden" (the
            final hidden states, EAGLE).
        topk, num_steps: --speculative-eagle-topk (1: chains, more: trees, `_decode_trees`) and
            --speculative-num-steps (a tree's depth).
    """

    def __init__(self, runner: EagleRunner, buckets: ShapeBuckets, features: str, topk: int = 1,
                 num_steps: int = 1):
        super().__init__(runner, buckets, topk, num_steps)
        self.features = features
        self._step: Optional[list] = None  # the worker batches of the target step last dispatched

    @property
    def mirror_runner(self) -> None:
        """None: the head runs after each step over its rows (`after_step`), one layer, left out of the batch
        rule's costs."""
        return None

    def mirror(self, batches: Sequence[Optional[ModelWorkerBatch]]) -> None:
        """Remember the target step's worker batches (the head runs over them once the step's tokens are known:
        `after_step`)."""
        self._step = list(batches)

    def move_kv(self, moves) -> None:
        """The K/V moves of a verify step on the head's buffers too when it drafts trees (the draft extend wrote
        its K/V at the tree's slots); a chain's accepted slots stay in place."""
        if self.topk > 1:
            super().move_kv(moves)

    def after_step(self, launched: Sequence[Optional[ScheduleBatch]], outs: Sequence) -> None:
        """Dispatch the draft extend of the target step just applied (`launched`: its launched batches, `outs`: the
        ranks' `StepOutput`s)."""
        step, self._step = self._step, None
        if self.failed is not None or step is None:
            return
        live = [b is not None and o is not None and w is not None and any(r.score is None for r in b.reqs)
                for b, o, w in zip(launched, outs, step)]
        if not any(live):
            return
        try:
            made = [draft_extend_batch(b, w, o) if ok else (None, None)
                    for b, w, o, ok in zip(launched, step, outs, live)]
            aux = next(getattr(o, self.features) for o, ok in zip(outs, live) if ok)
            self.runner.draft_extend([m[0] for m in made], aux, [m[1] for m in made])
        except Exception as exc:
            self._fail("running the EAGLE head after a step", exc)

    def _decode_chains(self, plans: List[List[Tuple[Req, int]]], ranks) -> List[Dict[int, List[int]]]:
        """Per rank, id(req) -> its chain (the root, the stored draft token, then one draft step per token)."""
        fault_injection.check("draft", [r.rid for p in plans for r, _ in p])
        slots = self.runner.num_request_slots
        tok = self.runner.tokens()
        chains = [{id(r): [last_input_token(r), int(tok[i * slots + r.req_pool_idx])] for r, _ in p}
                  for i, p in enumerate(plans)]
        for k in range(max(n for p in plans for _, n in p) - 2):
            live = [[r for r, n in p if n - 2 > k] for p in plans]
            if not any(live):
                break
            shape = (ForwardMode.DECODE, *self.buckets.decode_shape(max(len(x) for x in live)))
            step = [draft_step_batch(x, [chains[i][id(r)][k + 1] for r in x], k, ranks[i].memory, shape)
                    if x else None for i, x in enumerate(live)]
            tok = self.runner.draft_decode(step, [np.asarray([r.req_pool_idx for r in x], np.int32) if x else None
                                                  for x in live])
            self.num_draft_steps += 1
            for i, x in enumerate(live):
                for r in x:
                    chains[i][id(r)].append(int(tok[i * slots + r.req_pool_idx]))
        return chains

    def _decode_trees(self, plans: List[List[Tuple[Req, int]]], ranks) -> List[Dict[int, tuple]]:
        """Grow every planned request's top-k tree (`draft_tree.TopkTree`): its first level from the k best tokens
        the draft extend stored, then one head tree step per level. A tree step feeds the fed tree without its root
        -- a forest of the root's children and their descendants, in the root's slot and the draft slots, a node at
        position ``seq_len - 2 + depth`` (the head's row of a token sits one position before it) -- each node with
        its parent's output (`EagleRunner.draft_tree`). Per rank, id(req) -> the tree to verify, unused draft
        slots given back (`DraftModel._final_trees`)."""
        fault_injection.check("draft", [r.rid for p in plans for r, _ in p])
        slots = self.runner.num_request_slots
        top_lp, top_tok = self.runner.top_states()
        trees = [{id(r): TopkTree(last_input_token(r), self.topk) for r, _ in p} for p in plans]
        for i, p in enumerate(plans):
            for r, _ in p:
                row = i * slots + r.req_pool_idx
                trees[i][id(r)].expand(top_tok[row][None], top_lp[row][None])
        steps = [{id(r): tree_steps(n, self.topk, self.num_steps) for r, n in p} for p in plans]
        rows_before: List[Dict[int, Dict[int, int]]] = [{} for _ in plans]  # node -> its row in the step before
        for k in range(1, max(s for rank in steps for s in rank.values())):
            live = [[r for r, _ in p if steps[i][id(r)] > k] for i, p in enumerate(plans)]
            if not any(live):
                break
            shape = (ForwardMode.TARGET_VERIFY, *self.buckets.verify_shape(max(len(x) for x in live)))
            batches, srcs, frontier_rows, rows_now = [], [], [], []
            for i, x in enumerate(live):
                forests, src, fr, now = [], [], {}, {}
                for r in x:
                    forest, sources, rows = fed_forest(trees[i][id(r)], r.req_pool_idx, rows_before[i].get(id(r), {}),
                                                       len(src))
                    forests.append(forest)
                    src += sources
                    now[id(r)] = rows
                    fr[id(r)] = [rows[n] for n in trees[i][id(r)].frontier]
                batches.append(tree_step_batch(x, forests, ranks[i].memory, shape) if x else None)
                srcs.append(np.asarray(src, np.int32) if x else None)
                frontier_rows.append(fr)
                rows_now.append(now)
            lp, tok = self.runner.draft_tree(batches, srcs)
            self.num_draft_steps += 1
            t_pad = lp.shape[0] // len(plans)
            for i, x in enumerate(live):
                for r in x:
                    at = i * t_pad + np.asarray(frontier_rows[i][id(r)])
                    trees[i][id(r)].expand(tok[at], lp[at])
            rows_before = rows_now
        return self._final_trees(plans, trees, ranks)


def _table(layer_state):
    """A target layer's [V, H] table from its parameter state (`layers.embedding.Table`): the weight, or (int8
    weight, float32 scales) when ``--quantization`` stored it in groups."""
    weight = layer_state["weight"].get_value()
    return (weight, layer_state["weight_scale"].get_value()) if "weight_scale" in layer_state else weight


def new_eagle_draft(server_args, target_runner: ModelRunner, buckets: ShapeBuckets, head_config) -> EagleDraft:
    """Load the EAGLE or EAGLE-3 head (`head_config`: its `ModelConfig` from `eagle_head_config`) with one layer of
    K/V buffers beside the target's; an EAGLE-3 head's target captures its aux hidden states
    (`ModelRunner.aux_layers`)."""
    spec = draft_kv_spec(target_runner.kv_spec, 1)
    eagle3 = head_config.architecture == "LlamaForCausalLMEagle3"
    params = target_runner.params
    embed = _table(params["model"]["embed_tokens"])
    target_head = _table(params["lm_head"]) if "lm_head" in params else embed
    if eagle3:
        cfg = head_config.hf_config
        columns = int(getattr(cfg, "draft_vocab_size", None) or head_config.vocab_size)
        d2t = None if server_args.load_format == "dummy" else read_checkpoint_tensor(head_config, "d2t")
        hidden = target_runner.model_config.hidden_size
        aux_width = len(target_runner.aux_layers) * hidden
    else:
        rows = target_head[0] if isinstance(target_head, tuple) else target_head
        columns, d2t, aux_width = rows.shape[0], None, target_runner.model_config.hidden_size
    runner = EagleRunner(draft_server_args(server_args, target_runner.max_context_len), head_config,
                         buckets=buckets, max_context_len=target_runner.max_context_len, kv_spec_fn=lambda _: spec,
                         num_request_slots=target_runner.num_request_slots, embed=embed, target_head=target_head,
                         hot=hot_token_ids(d2t, columns), aux_width=aux_width,
                         aux_dtype=JNP_DTYPES[target_runner.model_config.dtype],
                         topk=server_args.speculative_eagle_topk or 1)
    if eagle3:
        logger.info("EAGLE-3 head %s (draft vocabulary %d) over the target's layers %s", head_config.model_path,
                    columns, list(target_runner.aux_layers))
    else:
        logger.info("EAGLE head %s over the target's final hidden states", head_config.model_path)
    topk = server_args.speculative_eagle_topk or 1
    return EagleDraft(runner, buckets, "aux" if eagle3 else "hidden", topk, server_args.speculative_num_steps or 1)
