"""Data-parallel rank pieces without a model: rank choice (load_balance.py), the shape of a step over several
ranks (schedule_batch.step_shape), stacking the ranks' batches (forward_batch.stack_ranks) and the
read-only prefix match cache-aware assignment compares (RadixCache.prefix_match_len)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_jax.srt.scheduler.load_balance import CACHE_AWARE_MIN_MATCH, choose_rank
from sgl_jax.srt.scheduler.schedule_batch import Req, ScheduleBatch, step_shape
from sgl_jax.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.chunk_cache import ChunkCache
from sgl_jax.srt.mem_cache.kv_memory import KVMemory
from sgl_jax.srt.mem_cache.radix_cache import RadixCache
from sgl_jax.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sgl_jax.srt.model_executor.buckets import ShapeBuckets
from sgl_jax.srt.forward_batch import ForwardMode, stack_ranks
from sgl_jax.srt.sampling.sampling_params import SamplingParams


def test_choose_rank_methods():
    assert [choose_rank("round_robin", [5, 0, 0], turn=t) for t in range(4)] == [0, 1, 2, 0]
    assert choose_rank("shortest_queue", [3, 1, 2]) == 1
    assert [choose_rank("shortest_queue", [0, 0, 0], turn=t) for t in range(3)] == [0, 1, 2]  # ties in turn
    # cache_aware: the longest useful match wins even on a longer queue; ties go to the shorter queue
    assert choose_rank("cache_aware", [4, 0, 0], [90, 10, 0], num_tokens=100) == 0
    assert choose_rank("cache_aware", [4, 1, 0], [90, 90, 0], num_tokens=100) == 1
    # a match below the threshold (two prompts sharing their first words) does not attract the request
    short = int(CACHE_AWARE_MIN_MATCH * 100) - 1
    assert choose_rank("cache_aware", [1, 0, 0], [short, 0, 0], num_tokens=100) == 1
    with pytest.raises(ValueError, match="--load-balance-method must be one of"):
        choose_rank("random", [0, 0])
    with pytest.raises(ValueError, match="one prefix match length per rank"):
        choose_rank("cache_aware", [0, 0])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=12), min_size=1, max_size=6),
       st.lists(st.integers(1, 4), max_size=14), st.sampled_from([1, 2, 4]))
def test_prefix_match_len_is_match_prefix_without_side_effects(inserted, query, page_size):
    pool = ReqToTokenPool(4, 64)
    alloc = PagedTokenToKVPoolAllocator(512, page_size)
    cache = RadixCache(pool, alloc, page_size)
    for ids in inserted:
        n = len(ids) // page_size * page_size
        row = np.zeros(64, np.int32)
        row[:n] = alloc.alloc_token_slots(row, 0, n)
        cache.insert(ids[:n], row[:n].copy())
    nodes = len(cache.nodes())
    n = cache.prefix_match_len(query)
    assert len(cache.nodes()) == nodes  # no split
    assert n == cache.match_prefix(query).length
    assert ChunkCache(pool, alloc).prefix_match_len(query) == 0


def _req(ids, rid):
    req = Req(rid, ids, SamplingParams(max_new_tokens=4, temperature=0.0), eos_token_ids=[2], seed=1)
    req.extend_input_len = len(ids)
    return req


def test_step_shape_and_stacked_ranks():
    buckets = ShapeBuckets((16, 64), (1, 4))
    pools = [ReqToTokenPool(4, 64) for _ in range(2)]
    allocs = [PagedTokenToKVPoolAllocator(128, 4) for _ in range(2)]
    caches = [ChunkCache(p, a) for p, a in zip(pools, allocs)]
    mems = [KVMemory(p, a, c) for p, a, c in zip(pools, allocs, caches)]
    # rank 0 extends a prompt of 6 tokens; rank 1 decodes 3 requests (prefilled earlier)
    ext = ScheduleBatch([_req([5, 6, 7, 8, 9, 10], "e")], ForwardMode.EXTEND)
    ext.prepare_for_extend(mems[0])
    dec_reqs = [_req([20 + i, 21 + i], f"d{i}") for i in range(3)]
    pre = ScheduleBatch(dec_reqs, ForwardMode.EXTEND)
    pre.prepare_for_extend(mems[1])
    for r in dec_reqs:
        r.kv_committed_len = r.kv_allocated_len
        r.output_ids.append(40)
    dec = ScheduleBatch(dec_reqs, ForwardMode.DECODE)
    assert dec.prepare_for_decode(mems[1])

    assert step_shape([dec], buckets) == (ForwardMode.DECODE, 4, 4)
    assert step_shape([ext], buckets) == (ForwardMode.EXTEND, 16, 4)
    shape = step_shape([ext, None, dec], buckets)
    assert shape == (ForwardMode.EXTEND, 16, 4)  # the decode rank runs as one-token extends
    with pytest.raises(ValueError, match="does not fit the step shape"):
        ext.build_model_worker_batch(buckets, mems[0], (ForwardMode.DECODE, 4, 4))

    b0 = ext.build_model_worker_batch(buckets, mems[0], shape)
    b1 = dec.build_model_worker_batch(buckets, mems[1], shape)
    assert b1.forward_batch.forward_mode == ForwardMode.EXTEND and b1.forward_batch.cu_q_lens.tolist() == [0, 1, 2, 3, 3]
    assert b1.sampling.last_token[:3].tolist() == [40, 40, 40]  # still a decode row for the sampler
    s = stack_ranks([b0, b1], slots_per_rank=4)
    fb = s.forward_batch
    assert fb.input_ids.shape == (32,) and fb.kv_lens.shape == (8,) and fb.cu_q_lens.shape == (10,)
    assert fb.num_seqs.tolist() == [1, 3] and fb.shared_prefix_len.shape == (2,)
    assert fb.logits_indices[:1].tolist() == [5] and fb.logits_indices[4:7].tolist() == [16, 17, 18]
    np.testing.assert_array_equal(fb.out_cache_loc[16:19], b1.forward_batch.out_cache_loc[:3])  # rank-local slots
    assert s.sampling.slots[:1].tolist() == [ext.reqs[0].req_pool_idx]
    assert s.sampling.slots[4:7].tolist() == [4 + r.req_pool_idx for r in dec_reqs]
    assert s.sampling.vocab_mask is None and s.num_seqs == 4
    with pytest.raises(ValueError, match="share one padded shape"):
        stack_ranks([b0, dec.build_model_worker_batch(buckets, mems[1])], 4)
