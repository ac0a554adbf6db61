"""Speculative decoding's host side without a model (scheduler/speculative/speculation.py): a decode batch turned into a
verify step -- draft slots allocated, the verify layout (positions by depth, KV slots in slot order, tree bits, a logits
row and a sampling row per slot) --, then a step's sampled tokens applied: the accepted path off the tree's first
branch (its K/V queued to move), the bonus token, the unaccepted slots' pages given back, the pools exact after
the requests are released. The model's part (the same outputs as without speculation) is test_speculative_serving.
"""

from __future__ import annotations

import numpy as np
import pytest

from sgl_jax.srt.forward_batch import ForwardMode
from sgl_jax.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.kv_memory import KVMemory
from sgl_jax.srt.mem_cache.radix_cache import RadixCache
from sgl_jax.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sgl_jax.srt.model_executor.buckets import ShapeBuckets
from sgl_jax.srt.model_executor.step_output import StepOutput
from sgl_jax.srt.sampling.sampling_params import SamplingParams
from sgl_jax.srt.scheduler.schedule_batch import Req, ScheduleBatch, finish_length
from sgl_jax.srt.scheduler.speculative.spec_costs import PAY_MARGIN, StepCosts
from sgl_jax.srt.scheduler.speculative.speculation import (
    PROBE_INTERVAL, SpecCounts, Speculator, build_verify_batch, unify_step)
from sgl_jax.srt.speculative.draft_tree import NO_TREE, tree_bits
from sgl_jax.srt.speculative.ngram_cache import NgramConfig

PAGE = 4


def _setup(max_new=(20, 20)):
    pool = ReqToTokenPool(4, 64)
    alloc = PagedTokenToKVPoolAllocator(256, PAGE)
    memory = KVMemory(pool, alloc, RadixCache(pool, alloc, PAGE))
    spec = Speculator(NgramConfig(num_draft_tokens=6, max_match_window=3, min_bfs_breadth=2, max_bfs_breadth=2,
                                  branch_length=8), context_len=64)
    # a: its prompt holds "5 6 7 8" and "5 6 9 10" (two continuations of 5 6: a tree); b: nothing to match
    a = Req("a", [1, 5, 6, 7, 8, 2, 5, 6, 9, 10, 3, 4],
            SamplingParams(max_new_tokens=max_new[0], temperature=0.0, stop_token_ids=[]), eos_token_ids=[0], seed=1)
    b = Req("b", [40, 41, 42], SamplingParams(max_new_tokens=max_new[1], temperature=0.8, stop_token_ids=[]),
            eos_token_ids=[0], seed=2)
    for r in (a, b):
        r.spec = SpecCounts()
        r.extend_input_len = len(r.origin_input_ids)
    ScheduleBatch([a, b], ForwardMode.EXTEND).prepare_for_extend(memory)
    for r, first in ((a, 5), (b, 43)):  # the prefill ran and sampled each request's first token
        r.kv_committed_len = r.kv_allocated_len
        r.output_ids.append(first)
        spec.cache.insert_prompt(r.origin_input_ids)
    return memory, spec, a, b


def test_verify_step_layout_acceptance_and_rollback():
    memory, spec, a, b = _setup()
    free0 = memory.free_tokens()
    dec = ScheduleBatch([a, b], ForwardMode.DECODE)
    assert dec.prepare_for_decode(memory)
    verify = spec.verify_batch(dec, memory)
    assert verify.forward_mode == ForwardMode.TARGET_VERIFY and list(verify.drafts) == [id(a)]  # b: no match
    tokens, parents = verify.drafts[id(a)]
    assert tokens[0] == 5 and 6 in tokens[1:].tolist()
    assert len(tokens) == 6 and a.kv_allocated_len == a.seqlen - 1 + 6 and b.kv_allocated_len == b.seqlen
    depth_of = {0: 0}
    for i in range(1, len(parents)):
        depth_of[i] = depth_of[int(parents[i])] + 1

    buckets = ShapeBuckets((16,), (1, 4), verify_tokens=6)
    mwb = build_verify_batch(verify, buckets, memory)
    fb = mwb.forward_batch
    base = a.seqlen - 1
    assert fb.forward_mode == ForwardMode.TARGET_VERIFY and fb.input_ids.shape == (24,) and fb.kv_lens.shape == (4,)
    assert mwb.rows_pad == 24 and mwb.num_rows == 7 and fb.logits_indices[:7].tolist() == list(range(7))
    assert fb.input_ids[:7].tolist() == tokens.tolist() + [43]
    assert fb.positions[:6].tolist() == [base + depth_of[i] for i in range(6)] and fb.positions[6] == b.seqlen - 1
    row = memory.row(a)
    assert fb.out_cache_loc[:6].tolist() == row[base:base + 6].tolist()  # slot order
    assert fb.tree_bits[:6].tolist() == tree_bits(parents).tolist() and fb.tree_bits[6] == NO_TREE
    assert (fb.tree_bits[7:] == NO_TREE).all() and fb.cu_q_lens[:3].tolist() == [0, 6, 7]
    assert fb.kv_lens[:2].tolist() == [a.kv_allocated_len, b.kv_allocated_len]
    s = mwb.sampling
    assert s.steps[:7].tolist() == [1 + depth_of[i] for i in range(6)] + [1]
    assert s.params["temperature"][6] == np.float32(0.8) and s.seeds[:7].tolist() == [1] * 6 + [2]

    # the target agrees with the draft along the branch through the slot holding 9 (the second continuation of 5 6),
    # then predicts 77: accepted 6, 9, 10, bonus 77 -- unless the tree holds 10 under 9 only on the other branch
    launched = verify.launched()
    target = np.zeros(24, np.int32)
    kids = {i: [j for j in range(1, 6) if parents[j] == i] for i in range(6)}
    six = next(j for j in kids[0] if tokens[j] == 6)
    nine = next(j for j in kids[six] if tokens[j] == 9)
    target[0], target[six], target[nine] = 6, 9, 10
    ten = next((j for j in kids[nine] if tokens[j] == 10), None)
    want = [6, 9, 10] if ten is None else [6, 9, 10, 77]
    if ten is not None:
        target[ten] = 77
    target[6] = 44  # b's sampled token
    out = StepOutput(target, np.zeros(24, np.float32), None, None, None)
    slots = {j: int(memory.row(a)[base + j]) for j in range(6)}
    spec.apply_verify(launched, out, memory, decode_tail=lambda r, ids: "")
    assert a.output_ids == [5] + want and b.output_ids == [43, 44]
    path = [0, six, nine] + ([ten] if ten is not None else [])
    assert a.kv_allocated_len == a.kv_committed_len == a.seqlen - 1 == base + len(path)
    src, dst = spec.take_moves()
    moved = [(slots[p], slots[m]) for m, p in enumerate(path) if m and p != m]
    assert list(zip(src.tolist(), dst.tolist())) == moved and moved  # the second branch: its K/V moves
    assert a.spec.draft_tokens == 5 and a.spec.accepted_tokens == len(path) - 1
    assert b.spec.draft_tokens == 0 and b.kv_allocated_len == b.kv_committed_len == b.seqlen - 1
    assert memory.check_invariants([a, b]) == []
    for r in (a, b):
        r.finished_reason = finish_length(len(r.output_ids))
        memory.release(r)
    acc = memory.accounting()
    assert acc["kv_tokens_free"] + acc["kv_tokens_cached"] == acc["kv_tokens_total"] and memory.free_tokens() <= free0


def test_drafts_stop_at_max_new_tokens_and_nothing_to_draft_stays_a_decode_step():
    memory, spec, a, b = _setup(max_new=(3, 20))
    dec = ScheduleBatch([a, b], ForwardMode.DECODE)
    assert dec.prepare_for_decode(memory)
    verify = spec.verify_batch(dec, memory)
    tokens, _ = verify.drafts[id(a)]
    assert len(tokens) == 2  # 2 of 3 output tokens left: the root and one draft, never past max_new_tokens
    solo = ScheduleBatch([b], ForwardMode.DECODE)
    assert spec.verify_batch(solo, memory) is solo  # nothing in the cache follows b: no verify step


def test_batch_rule_decodes_batches_whose_drafts_do_not_pay():
    """The batch rule (scheduler/speculative/spec_costs.py): with a verify step costing 4x a decode step at S_pad 2
    (as on a CPU in a batch), a's draft (counted as wholly accepted, 5 tokens: it has not drafted yet) does not pay --
    the batch decodes, no draft slot taken -- while at 1.2x (a GPU at batch 1) it does; drafting time counts against
    it."""
    memory, spec, a, b = _setup()
    assert spec.may_verify([a, b])  # (without costs every batch drafts: a step of it may verify)
    # the overlap scheduler's test (scheduler/overlap.py): at 8x, not even both requests' whole budgets (2 + 5 + 5
    # tokens) would pay, so the next step may run ahead; at 4x they would, so the step waits for its drafts
    spec.costs = StepCosts({1: 10.0, 2: 10.0}, {1: 12.0, 2: 80.0})
    assert not spec.may_verify([a, b]) and spec.num_unpaid_steps == 0
    spec.costs = StepCosts({1: 10.0, 2: 10.0}, {1: 12.0, 2: 40.0})
    assert spec.may_verify([a, b])
    dec = ScheduleBatch([a, b], ForwardMode.DECODE)
    assert dec.prepare_for_decode(memory)
    free1 = memory.free_tokens()
    assert spec.verify_batch(dec, memory) is dec and spec.num_unpaid_steps == 1
    assert memory.free_tokens() == free1 and a.kv_allocated_len == a.seqlen  # no draft slot was taken
    assert spec.expected_tokens(2, [(a, 6)]) == 2 + 5  # a has not drafted yet: its whole draft
    spec.costs = StepCosts({1: 10.0, 2: 10.0}, {1: 12.0, 2: 12.0})
    assert spec.may_verify([a, b])
    for r in (a, b):  # (a request with penalties never drafts)
        r.sampling_params.frequency_penalty = 0.5
    assert not spec.may_verify([a, b])
    for r in (a, b):
        r.sampling_params.frequency_penalty = 0.0
    verify = spec.verify_batch(dec, memory)
    assert verify.forward_mode == ForwardMode.TARGET_VERIFY and list(verify.drafts) == [id(a)]
    assert 2 in spec.costs.draft_ms  # the n-gram lookups' time, observed at S_pad 2
    # 4 tokens expected from 2 sequences: pays while 12 + draft ms <= 4 x 10 / (2 x PAY_MARGIN) ms
    assert spec.costs.pays(2, 4.0)
    spec.costs.draft_ms[2] = 4 * 10.0 / (2 * PAY_MARGIN) - 12.0 + 0.5
    assert not spec.costs.pays(2, 4.0)
    assert memory.check_invariants([a, b]) == []
    for r in (a, b):
        memory.rollback(r, r.seqlen)  # (the step did not run: its draft slots go back)
        r.finished_reason = finish_length(len(r.output_ids))
        memory.release(r)
    acc = memory.accounting()
    assert acc["kv_tokens_free"] + acc["kv_tokens_cached"] == acc["kv_tokens_total"]


def test_step_costs_and_expected_tokens():
    """S_pad lookup (the smallest padding that holds the batch, else the largest); the drafting time's moving
    average; a request's expected accepted tokens (its whole draft before its first verified draft token and
    when it probes, else its moving average capped by its draft's length)."""
    costs = StepCosts({1: 5.0, 4: 6.0, 16: 9.0}, {1: 6.0, 4: 20.0, 16: 80.0})
    assert [costs.s_pad(n) for n in (1, 2, 4, 5, 16, 40)] == [1, 4, 4, 16, 16, 16]
    assert costs.pays(1, 1.0 * PAY_MARGIN * 6.0 / 5.0) and not costs.pays(1, 0.99 * PAY_MARGIN * 6.0 / 5.0)
    costs.observe_draft(3, 10.0)
    costs.observe_draft(4, 20.0)
    assert costs.draft_ms == {4: 13.0} and costs.table()[1] == (4, 6.0, 20.0, 13.0)
    req = Req("r", [1, 2, 3], SamplingParams(max_new_tokens=8), eos_token_ids=[0], seed=0)
    req.spec = SpecCounts()
    assert Speculator.expected_tokens(3, [(req, 12)]) == 3 + 11  # before its first draft: all of it
    req.spec.observe(11, 9)
    assert Speculator.expected_tokens(3, [(req, 12)]) == 3 + req.spec.accept_ema > 3 + 2.0
    for _ in range(3):
        req.spec.observe(11, 0)
    assert Speculator.expected_tokens(3, [(req, 12)]) == 3 + req.spec.accept_ema < 3 + 2.0
    assert Speculator.expected_tokens(3, [(req, 2)]) == 3 + 1  # a 2-slot draft accepts at most 1 token
    req.spec.verify_ct += req.spec.probe_interval
    assert req.spec.probing and Speculator.expected_tokens(3, [(req, 6)]) == 3 + 5  # a probe: all of it


def test_draft_size_follows_acceptance():
    """A request's drafts grow while they are accepted and shrink when they are not; with nothing accepted it
    stops drafting, but probes with a new request's draft after PROBE_INTERVAL decode steps without one, the
    interval doubling after each probe that finds nothing, and a probe whose drafts match resumes drafting."""
    spec = Speculator(NgramConfig(num_draft_tokens=12), context_len=1024)
    counts = SpecCounts()
    assert spec.draft_size(counts) == 6  # 2 + 2 x the optimistic start (2.0)
    for _ in range(10):
        counts.verify_ct += 1
        counts.observe(spec.draft_size(counts) - 1, spec.draft_size(counts) - 1)  # everything accepted
    assert spec.draft_size(counts) == 12
    sizes = []
    for _ in range(150):
        n = spec.draft_size(counts)
        sizes.append(n)
        counts.observe(max(n - 1, 0), 0)  # nothing accepted
        counts.verify_ct += 1
    first_stop = sizes.index(0)
    drafting = sizes[:first_stop]
    assert drafting[0] == 12 and drafting == sorted(drafting, reverse=True) and drafting[-1] == 2
    probes = [i for i, n in enumerate(sizes) if i > first_stop and n]
    assert len(probes) == 3 and all(sizes[i] == 6 for i in probes)  # sized as a new request's draft
    gaps = [b - a for a, b in zip([first_stop - 1] + probes, probes)]
    assert gaps == [PROBE_INTERVAL, 2 * PROBE_INTERVAL, 4 * PROBE_INTERVAL]
    while not counts.probing:
        counts.verify_ct += 1
    counts.observe(5, 5)  # the probe's drafts match: drafting resumes at once, the interval back to its start
    counts.verify_ct += 1
    assert spec.draft_size(counts) >= 4 and counts.probe_interval == PROBE_INTERVAL


def test_a_failure_midway_keeps_only_positions_whose_kv_is_in_place():
    """The target follows the tree's second branch (5 6 7 8, slots 0, 1, 3, 5); taking the fourth token raises (its
    stop-string check). The request keeps the positions whose K/V is in place: root, 6, and 7 moved from slot 3 to
    position base + 2; no move for 8 (its position is not kept)."""
    memory, spec, a, b = _setup()
    a.sampling_params.stop = ["never"]
    dec = ScheduleBatch([a, b], ForwardMode.DECODE)
    assert dec.prepare_for_decode(memory)
    verify = spec.verify_batch(dec, memory)
    tokens, parents = verify.drafts[id(a)]
    assert tokens.tolist() == [5, 6, 9, 7, 10, 8] and parents.tolist() == [-1, 0, 1, 1, 2, 3]  # 9: seen last
    target = np.zeros(24, np.int32)
    target[0], target[1], target[3], target[5] = 6, 7, 8, 55
    base = a.seqlen - 1
    slots = [int(x) for x in memory.row(a)[base:base + 6]]
    failed = []

    def decode_tail(req, ids):
        if req is a and len(a.output_ids) == 5:  # the fourth token (55) fails its check
            raise RuntimeError("planted")
        return ""

    spec.apply_verify(verify.launched(), StepOutput(target, np.zeros(24, np.float32), None, None, None), memory,
                      decode_tail, on_error=lambda req, exc: failed.append(req))
    assert failed == [a] and a.output_ids == [5, 6, 7, 8, 55]
    assert a.kv_allocated_len == a.kv_committed_len == base + 3  # root, 6, 7 (three tokens were taken)
    src, dst = spec.take_moves()
    assert list(zip(src.tolist(), dst.tolist())) == [(slots[3], slots[2])]
    assert memory.check_invariants([a, b]) == []


def test_unify_step_gives_the_dp_ranks_one_mode():
    """A verify batch beside another rank's extend drops its drafts (their slots given back: a decode batch); beside
    a decode batch, the decode batch runs as a verify batch without drafts."""
    (mem0, spec0, a0, b0), (mem1, _, a1, b1) = _setup(), _setup()
    dec = ScheduleBatch([a0, b0], ForwardMode.DECODE)
    assert dec.prepare_for_decode(mem0)
    free = mem0.free_tokens()
    verify = spec0.verify_batch(dec, mem0)
    assert verify.forward_mode == ForwardMode.TARGET_VERIFY and mem0.free_tokens() < free
    extend = ScheduleBatch([a1], ForwardMode.EXTEND)
    out, changed = unify_step([verify, extend], [mem0, mem1])
    assert changed and out[0].forward_mode == ForwardMode.DECODE and not out[0].drafts and out[1] is extend
    assert mem0.free_tokens() == free and a0.kv_allocated_len == a0.seqlen  # the draft slots are back
    verify = spec0.verify_batch(ScheduleBatch([a0, b0], ForwardMode.DECODE), mem0)
    decode = ScheduleBatch([b1], ForwardMode.DECODE)
    out, changed = unify_step([verify, decode], [mem0, mem1])
    assert changed and out[0] is verify and out[1].forward_mode == ForwardMode.TARGET_VERIFY and not out[1].drafts
    assert unify_step([verify, None], [mem0, mem1]) == ([verify, None], False)


def test_top_k_trees_refused_for_a_sliding_window_target():
    """STANDALONE and EAGLE3 top-k > 1 trees over a target with sliding-window layers are refused at start-up,
    naming --speculative-eagle-topk (a window is measured on the KV position: such targets verify chains); chains
    pass."""
    import dataclasses as dc

    from sgl_jax.srt.configs.model_config import ModelConfig
    from sgl_jax.srt.scheduler.speculative.drafters import draft_model_config
    from sgl_jax.srt.server_args import prepare_server_args
    from srt_helpers import default_model_path

    path = default_model_path()
    args = prepare_server_args(["--model-path", path, "--speculative-algorithm", "STANDALONE",
                                "--speculative-draft-model-path", path, "--speculative-eagle-topk", "2"])
    target = ModelConfig.from_server_args(args, "cpu")
    assert draft_model_config(args, target, target.context_len, "cpu")[0] is not None
    windowed = dc.replace(target, sliding_window=16)
    with pytest.raises(ValueError, match="--speculative-eagle-topk 2: a model with sliding-window layers"):
        draft_model_config(args, windowed, target.context_len, "cpu")
    chains = dc.replace(args, speculative_eagle_topk=1, speculative_num_steps=None, speculative_num_draft_tokens=None)
    assert draft_model_config(chains, windowed, target.context_len, "cpu")[0] is not None
    eagle3 = prepare_server_args(["--model-path", path, "--speculative-algorithm", "EAGLE3",
                                  "--speculative-draft-model-path", "h", "--speculative-eagle-topk", "2"])
    with pytest.raises(ValueError, match="--speculative-eagle-topk 2: a model with sliding-window layers"):
        draft_model_config(eagle3, windowed, target.context_len, "cpu")  # (before the head is read)


def test_tree_draft_step_lays_out_the_fed_tree_as_a_verify_step():
    """A top-k tree draft step (`draft_model.tree_step_batch`) feeds each request's tree so far exactly as a verify
    step lays out a draft tree (`build_verify_batch`: slots, positions seq_len - 1 + depth, the tree mask's bits,
    kv lens, page tables), also when the request holds more draft slots than the tree uses; `tree_steps` keeps the
    tree a step feeds within the slots."""
    from sgl_jax.srt.scheduler.speculative.draft_model import tree_step_batch, tree_steps
    from sgl_jax.srt.speculative.draft_tree import TopkTree

    memory, _, a, b = _setup()
    dec = ScheduleBatch([a, b], ForwardMode.DECODE)
    assert dec.prepare_for_decode(memory)
    tree = TopkTree(a.output_ids[-1], 2)
    tree.expand([[30, 31]], [[-0.1, -0.2]])
    tree.expand([[32, 33], [34, 35]], [[-0.3, -0.4], [-0.05, -2.0]])  # frontier: 34 (under 31), 32 (under 30)
    fed = tree.fed()
    assert fed[0].tolist() == [a.output_ids[-1], 30, 31, 32, 34] and fed[1].tolist() == [-1, 0, 0, 1, 2]
    assert memory.allocate_drafts(a, len(fed[0]) - 1)
    trees = {id(a): fed[:2]}
    buckets = ShapeBuckets((16,), (1, 4), verify_tokens=6)
    want = build_verify_batch(ScheduleBatch([a, b], ForwardMode.TARGET_VERIFY, trees), buckets, memory).forward_batch
    assert memory.allocate_drafts(a, 1)  # a sixth slot the fed tree does not use
    root_b = (np.asarray([b.output_ids[-1]], np.int32), np.asarray([-1], np.int32))
    got = tree_step_batch([a, b], [fed[:2], root_b], memory, (ForwardMode.TARGET_VERIFY, 24, 4)).forward_batch
    for field in ("input_ids", "positions", "out_cache_loc", "cu_q_lens", "kv_lens", "page_indices", "tree_bits",
                  "logits_indices", "num_seqs"):
        assert np.array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field))), field
    assert got.tree_bits[:5].tolist() == tree_bits(fed[1]).tolist()
    assert [tree_steps(n, 2, 3) for n in (2, 3, 4, 5, 6, 8)] == [1, 2, 2, 3, 3, 3]
    assert all(1 + 4 * (tree_steps(n, 4, 5) - 1) <= n for n in range(2, 33))
    for r in (a, b):
        memory.rollback(r, r.seqlen)
        r.finished_reason = finish_length(len(r.output_ids))
        memory.release(r)
    acc = memory.accounting()
    assert acc["kv_tokens_free"] + acc["kv_tokens_cached"] == acc["kv_tokens_total"]
