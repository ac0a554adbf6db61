"""ScheduleBatch -> ModelWorkerBatch layout (pure numpy), and the prefill admission policy."""

import numpy as np

from sgl_jax.srt.scheduler.schedule_batch import Req, ScheduleBatch, shared_prefix_len
from sgl_jax.srt.scheduler.admission import (
    INIT_NEW_TOKEN_RATIO, LPM_MAX_WAITING, MIN_NEW_TOKEN_RATIO, NEW_TOKEN_RATIO_DECAY, RETRACT_DECODE_STEPS,
    AdmissionPolicy, PrefillAdder, by_policy,
)
from sgl_jax.srt.scheduler.scoring import SchedulerScoring
from sgl_jax.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.cache_manager import cache_finished_req
from sgl_jax.srt.mem_cache.chunk_cache import ChunkCache
from sgl_jax.srt.mem_cache.kv_memory import KVMemory
from sgl_jax.srt.mem_cache.radix_cache import RadixCache
from sgl_jax.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sgl_jax.srt.model_executor.buckets import ShapeBuckets
from sgl_jax.srt.forward_batch import ForwardMode
from sgl_jax.srt.sampling.sampling_params import SamplingParams


def _req(ids, max_new=8, temperature=0.0, rid="r"):
    return Req(rid, ids, SamplingParams(max_new_tokens=max_new, temperature=temperature), eos_token_ids=[2],
               seed=5)


def test_extend_then_decode_layout():
    pool = ReqToTokenPool(4, 64)
    alloc = PagedTokenToKVPoolAllocator(256, 4)
    buckets = ShapeBuckets((16, 64), (1, 4))
    cache = ChunkCache(pool, alloc)
    a, b = _req([10, 11, 12], rid="a"), _req([20, 21, 22, 23, 24], rid="b", temperature=0.7)
    a.extend_input_len, b.extend_input_len = 3, 5
    batch = ScheduleBatch([a, b], ForwardMode.EXTEND)
    batch.prepare_for_extend(KVMemory(pool, alloc, cache))
    mwb = batch.build_model_worker_batch(buckets, KVMemory(pool, alloc, cache))
    fb = mwb.forward_batch
    assert fb.input_ids.shape == (16,) and fb.kv_lens.shape == (4,)  # T bucket 16, S = bs bucket 4
    assert fb.input_ids[:8].tolist() == [10, 11, 12, 20, 21, 22, 23, 24] and not fb.input_ids[8:].any()
    assert fb.positions[:8].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert fb.cu_q_lens.tolist() == [0, 3, 8, 8, 8] and fb.kv_lens.tolist() == [3, 5, 0, 0]
    assert int(fb.num_seqs) == 2 and fb.logits_indices[:2].tolist() == [2, 7]
    np.testing.assert_array_equal(fb.out_cache_loc[:3], pool.req_to_token[a.req_pool_idx, :3])
    assert (fb.out_cache_loc[8:] == 0).all()  # padding tokens write the reserved page
    assert fb.page_indices[0, 0] == pool.req_to_token[a.req_pool_idx, 0] // 4
    assert mwb.sampling.params["temperature"][:2].tolist() == [0.0, np.float32(0.7)]
    assert mwb.sampling.seeds[:2].tolist() == [5, 5]

    for r in (a, b):
        r.kv_committed_len = r.kv_allocated_len  # the step ran
    a.output_ids.append(99)
    b.output_ids.append(98)
    dec = ScheduleBatch([a, b], ForwardMode.DECODE)
    assert dec.prepare_for_decode(KVMemory(pool, alloc, cache))
    fb = dec.build_model_worker_batch(buckets, KVMemory(pool, alloc, cache)).forward_batch
    assert fb.input_ids.shape == (4,) and fb.input_ids[:2].tolist() == [99, 98]
    assert fb.positions[:2].tolist() == [3, 5] and fb.kv_lens[:2].tolist() == [4, 6]
    assert fb.cu_q_lens.tolist() == [0, 1, 2, 2, 2]
    assert fb.out_cache_loc[0] == pool.req_to_token[a.req_pool_idx, 3]


def test_mixed_batch_carries_decode_rows_after_prefill_rows():
    """--enable-mixed-chunk: running requests ride in an EXTEND batch as one-token rows that sample as in a
    decode step (their penalty counts take in the input token, once)."""
    pool = ReqToTokenPool(4, 64)
    alloc = PagedTokenToKVPoolAllocator(256, 4)
    buckets = ShapeBuckets((16, 64), (1, 4))
    cache = ChunkCache(pool, alloc)
    a = _req([10, 11, 12], rid="a")
    a.extend_input_len = 3
    first = ScheduleBatch([a], ForwardMode.EXTEND)
    first.prepare_for_extend(KVMemory(pool, alloc, cache))
    a.kv_committed_len = a.kv_allocated_len  # the step ran and sampled 99
    a.output_ids.append(99)
    running = ScheduleBatch([a], ForwardMode.DECODE)
    assert running.prepare_for_decode(KVMemory(pool, alloc, cache))
    free = alloc.available_size()
    assert running.prepare_for_decode(KVMemory(pool, alloc, cache)) and alloc.available_size() == free  # taken once

    b = _req([20, 21, 22, 23, 24], rid="b")
    b.extend_input_len = 5
    mixed = ScheduleBatch([b], ForwardMode.EXTEND)
    mixed.prepare_for_extend(KVMemory(pool, alloc, cache))
    mixed.mix_with_running(running.reqs)
    assert mixed.reqs == [b, a] and running.reqs == [a]  # the running batch's list is not the mixed batch's
    assert [mixed.is_decode_row(r) for r in mixed.reqs] == [False, True] and mixed.num_decode_rows == 1
    mwb = mixed.build_model_worker_batch(buckets, KVMemory(pool, alloc, cache))
    fb, sm = mwb.forward_batch, mwb.sampling
    assert fb.forward_mode == ForwardMode.EXTEND and mwb.num_tokens == 6
    assert fb.input_ids[:6].tolist() == [20, 21, 22, 23, 24, 99]
    assert fb.positions[:6].tolist() == [0, 1, 2, 3, 4, 3]
    assert fb.cu_q_lens.tolist() == [0, 5, 6, 6, 6] and fb.kv_lens[:2].tolist() == [5, 4]
    assert fb.logits_indices[:2].tolist() == [4, 5]
    assert fb.out_cache_loc[5] == pool.req_to_token[a.req_pool_idx, 3]
    assert sm.last_token[:2].tolist() == [0, 99] and sm.last_token_index[:2].tolist() == [-1, 0]
    # the same request in a DECODE batch gets the same sampling inputs
    dsm = running.build_model_worker_batch(buckets, KVMemory(pool, alloc, cache)).sampling
    assert dsm.last_token[0] == 99 and dsm.last_token_index[0] == 0
    alone = mixed.subset([a])
    assert alone.is_decode_row(a) and alone.build_model_worker_batch(buckets, KVMemory(pool, alloc, cache)).forward_batch.cu_q_lens[1] == 1
    assert not mixed.subset([b]).is_decode_row(b)


def _adder(alloc, cache, buckets, running=(), chunk=None, slots=8, ratio=1.0, max_prefill=64):
    return PrefillAdder(buckets, KVMemory(cache.req_to_token_pool, alloc, cache), list(running), max_prefill_tokens=max_prefill, chunk_size=chunk,
                        free_req_slots=slots, new_token_ratio=ratio)


def test_prefill_adder_reserves_future_tokens():
    pool = ReqToTokenPool(8, 256)
    alloc = PagedTokenToKVPoolAllocator(100, 1)
    cache = ChunkCache(pool, alloc)
    buckets = ShapeBuckets((64,), (1, 8))
    adder = _adder(alloc, cache, buckets)
    assert adder.add(_req(list(range(10)), max_new=40))  # 50 tokens reserved
    assert adder.add(_req(list(range(10)), max_new=30))  # 90
    assert not adder.add(_req(list(range(5)), max_new=10))  # would need 105 > 100
    assert len(adder.can_run) == 2
    # with the decaying estimate only part of max_new_tokens is reserved
    adder = _adder(alloc, cache, buckets, ratio=0.1)
    assert all(adder.add(_req(list(range(10)), max_new=40)) for _ in range(5))


def test_prefill_adder_respects_slots_and_token_budget():
    pool = ReqToTokenPool(8, 512)
    alloc = PagedTokenToKVPoolAllocator(10_000, 1)
    cache = ChunkCache(pool, alloc)
    buckets = ShapeBuckets((64, 256), (1, 8))
    adder = _adder(alloc, cache, buckets, slots=2)
    assert adder.add(_req(list(range(200))))  # alone, a request may use the largest bucket
    assert not adder.add(_req(list(range(5))))  # budget 64 already exceeded
    adder = _adder(alloc, cache, buckets, slots=2, max_prefill=256)
    assert adder.add(_req([1])) and adder.add(_req([1])) and not adder.add(_req([1]))


def test_prefill_adder_cuts_page_aligned_chunks_and_locks_prefixes():
    pool = ReqToTokenPool(8, 512)
    alloc = PagedTokenToKVPoolAllocator(4096, 16)
    cache = RadixCache(pool, alloc, 16)
    buckets = ShapeBuckets((64, 256), (1, 8))
    adder = _adder(alloc, cache, buckets, chunk=100)
    a, b = _req(list(range(40)), rid="a"), _req(list(range(300)), rid="b")
    assert adder.add(a) and a.extend_input_len == 40
    assert adder.add(b) and b.extend_input_len == 48  # 60 tokens of budget left, cut to whole pages
    assert adder.new_chunked_req is b and not adder.add(_req([7]))


def test_shared_prefix_len_of_rows():
    rows = np.array([[5, 6, 7, 8, 9, 1], [5, 6, 7, 8, 3, 2], [5, 6, 7, 8, 9, 9]], np.int32)
    assert shared_prefix_len(rows, [5, 5, 5], 1) == 4  # the rows differ at position 4
    assert shared_prefix_len(rows, [5, 3, 5], 1) == 3  # a sequence whose queries start at 3
    assert shared_prefix_len(rows, [5, 5, 5], 3) == 3  # whole pages only
    assert shared_prefix_len(rows[[0, 2]], [6, 6], 1) == 5
    assert shared_prefix_len(rows[:1], [6], 4) == 4  # one sequence: its cached prefix
    assert shared_prefix_len(rows, [5, 0, 5], 1) == 0 and shared_prefix_len(rows[:0], [], 1) == 0


def test_extend_batch_sharing_a_radix_prefix_reports_it():
    """Two requests that hit the same radix-cache prefix share its pages; the batch tells attention how
    long that prefix is. A request without the prefix in the batch turns it off."""
    pool = ReqToTokenPool(8, 512)
    alloc = PagedTokenToKVPoolAllocator(4096, 16)
    cache = RadixCache(pool, alloc, 16)
    buckets = ShapeBuckets((64, 256), (1, 8))
    first = _req(list(range(60)), rid="first")
    adder = _adder(alloc, cache, buckets, max_prefill=256)
    assert adder.add(first)
    ScheduleBatch([first], ForwardMode.EXTEND).prepare_for_extend(KVMemory(pool, alloc, cache))
    first.kv_committed_len = first.kv_allocated_len
    cache_finished_req(first, cache)
    pool.free(first.req_pool_idx)

    b, c = (_req(list(range(50)) + [100 + i] * 5, rid=f"r{i}") for i in range(2))
    d = _req([900 + i for i in range(55)], rid="d")
    adder = _adder(alloc, cache, buckets, max_prefill=256)
    assert adder.add(b) and adder.add(c) and adder.add(d)
    assert len(b.prefix_indices) == len(c.prefix_indices) == 48  # whole pages of the 50 shared tokens
    ScheduleBatch([b, c, d], ForwardMode.EXTEND).prepare_for_extend(KVMemory(pool, alloc, cache))
    for reqs, expected in (([b, c], 48), ([b, c, d], 0), ([d], 0)):
        fb = ScheduleBatch(reqs, ForwardMode.EXTEND).build_model_worker_batch(buckets, KVMemory(pool, alloc, cache)).forward_batch
        assert int(fb.shared_prefix_len) == expected


def test_prefill_adder_leaves_room_for_mixed_decode_rows():
    """Decode rows riding in the batch take a token of the budget and a sequence of the bucket each; the
    step-budget limit caps the prefill tokens on top."""
    pool = ReqToTokenPool(8, 512)
    alloc = PagedTokenToKVPoolAllocator(4096, 4)
    cache = ChunkCache(pool, alloc)
    buckets = ShapeBuckets((64, 256), (1, 4, 8))
    running = [_req([1, 2, 3], rid=f"run{i}") for i in range(3)]
    adder = PrefillAdder(buckets, KVMemory(pool, alloc, cache), running, max_prefill_tokens=256, chunk_size=100, free_req_slots=5,
                         new_token_ratio=1.0, decode_rows=3)
    big = _req(list(range(300)), rid="big")
    assert adder.add(big) and big.extend_input_len == 96  # 100 - 3 decode rows, cut to whole pages
    adder = PrefillAdder(buckets, KVMemory(pool, alloc, cache), running, max_prefill_tokens=256, chunk_size=100, free_req_slots=5,
                         new_token_ratio=1.0, decode_rows=3, token_limit=40)
    big = _req(list(range(300)), rid="big")
    assert adder.add(big) and big.extend_input_len == 40
    # a bucket of 8 sequences holds 3 decode rows and 5 new requests, not 6
    adder = PrefillAdder(buckets, KVMemory(pool, alloc, cache), running, max_prefill_tokens=256, chunk_size=256, free_req_slots=8,
                         new_token_ratio=1.0, decode_rows=3)
    assert sum(adder.add(_req([5, 6], rid=f"n{i}")) for i in range(6)) == 5


def test_schedule_policy_lpm_admits_the_longest_cached_prefix_first():
    """--schedule-policy lpm: of two waiting requests, the one whose prompt the radix cache holds goes first (both
    fit); fcfs keeps arrival order; beyond LPM_MAX_WAITING waiting requests lpm falls back to arrival order."""
    pool = ReqToTokenPool(8, 512)
    alloc = PagedTokenToKVPoolAllocator(4096, 16)
    cache = RadixCache(pool, alloc, 16)
    memory = KVMemory(pool, alloc, cache)
    cached = list(range(64))
    warm = _req(cached + [1], rid="warm")
    assert _adder(alloc, cache, ShapeBuckets((64, 256), (1, 8)), max_prefill=256).add(warm)
    ScheduleBatch([warm], ForwardMode.EXTEND).prepare_for_extend(memory)
    warm.kv_committed_len = warm.kv_allocated_len
    memory.release(warm)  # its prompt stays cached
    scoring = SchedulerScoring(memory, 60.0, lambda msg: None, [2])
    for policy, first in (("fcfs", "cold"), ("lpm", "hot")):
        cold, hot = _req([900 + i for i in range(40)], rid="cold"), _req(cached + [7, 8], rid="hot")
        admission = AdmissionPolicy(buckets=ShapeBuckets((64, 256), (1, 8)), max_running_requests=8,
                                    max_prefill_tokens=256, chunk_size=None, memory=memory, scoring=scoring,
                                    schedule_policy=policy)
        decided = admission.admit([cold, hot], [], None)
        assert [r.rid for r in decided.can_run][0] == first, policy
        assert len(hot.prefix_indices) == 64
        for r in decided.can_run:
            memory.tree_cache.dec_lock_ref(r.last_node)
    many = [_req([5], rid=f"w{i}") for i in range(LPM_MAX_WAITING)] + [_req(cached + [3], rid="late")]
    assert by_policy(many, "lpm", memory) == many  # too many to order: arrival order
    assert by_policy(many[-3:], "lpm", memory)[0].rid == "late"


def test_the_policy_keeps_the_future_token_estimate():
    """new_token_ratio (SGLang's): decays per decode step to its floor, and after a retract reserves room for
    RETRACT_DECODE_STEPS more tokens of each running request."""
    pool = ReqToTokenPool(4, 256)
    alloc = PagedTokenToKVPoolAllocator(1024, 16)
    memory = KVMemory(pool, alloc, RadixCache(pool, alloc, 16))
    admission = AdmissionPolicy(buckets=ShapeBuckets((64,), (1, 4)), max_running_requests=4, max_prefill_tokens=64,
                                chunk_size=None, memory=memory,
                                scoring=SchedulerScoring(memory, 60.0, lambda msg: None, [2]))
    assert admission.new_token_ratio == INIT_NEW_TOKEN_RATIO
    admission.on_decode_step()
    assert admission.new_token_ratio == INIT_NEW_TOKEN_RATIO - NEW_TOKEN_RATIO_DECAY
    for _ in range(1000):
        admission.on_decode_step()
    assert admission.new_token_ratio == MIN_NEW_TOKEN_RATIO
    running = [_req([1, 2], max_new=100, rid=f"r{i}") for i in range(2)]
    running[0].output_ids = [5] * 10
    admission.on_retract(running)
    assert admission.new_token_ratio == (10 + 2 * RETRACT_DECODE_STEPS) / 200


def test_extend_cut_takes_a_smaller_bucket_when_it_saves_more_than_the_smallest_bucket():
    """ShapeBuckets.extend_cut: padded tokens of one step against a smaller bucket's step plus the rest's."""
    b = ShapeBuckets((64, 256, 1024, 2048), (1, 4, 16, 64))
    # 300 tokens: one 1024 step, or 256 + 64 (320 tokens computed); 257: 256 + 64 ties 64 + 256, the larger cut
    assert b.extend_cut(300) == 256 and b.extend_cut(257) == 256 and b.extend_cut(1025) == 1024
    assert b.extend_cut(65) == 64 and b.extend_cut(128) == 64  # 64 + 64 against 256
    # nothing to save beyond one step's stand-in cost (64 tokens), or a bucket filled
    assert b.extend_cut(129) is None and b.extend_cut(256) is None and b.extend_cut(2048) is None
    assert b.extend_cut(64) is None and b.extend_cut(1) is None and b.extend_cut(3000) is None
    assert b.extend_cut(300, page_size=48) == 240  # page-aligned
    full = ShapeBuckets((64, 128, 256, 512, 1024, 2048), (1, 4, 16, 64))
    assert full.extend_cut(129) is None and full.extend_cut(257) == 256  # 128 + 64 = 192 saves 64 of 256: not more


def test_prefill_adder_trim_cuts_the_crossing_request_and_releases_the_rest():
    pool = ReqToTokenPool(8, 512)
    alloc = PagedTokenToKVPoolAllocator(4096, 16)
    cache = RadixCache(pool, alloc, 16)
    memory = KVMemory(pool, alloc, cache)
    warm = _req(list(range(64)) + [1], rid="warm")  # a cached prefix, so the dropped request holds a lock
    assert _adder(alloc, cache, ShapeBuckets((64, 256), (1, 8)), max_prefill=256).add(warm)
    ScheduleBatch([warm], ForwardMode.EXTEND).prepare_for_extend(memory)
    warm.kv_committed_len = warm.kv_allocated_len
    memory.release(warm)
    buckets = ShapeBuckets((64, 256, 1024), (1, 8))
    adder = _adder(alloc, cache, buckets, chunk=1024)
    a, b, c = _req(list(range(500, 540)), rid="a"), _req(list(range(600, 660)), rid="b"), \
        _req(list(range(64)) + list(range(700, 900)), rid="c")
    assert adder.add(a) and adder.add(b) and adder.add(c)
    assert [r.extend_input_len for r in adder.can_run] == [40, 60, 200] and c.last_node is not None
    node = c.last_node
    locked = node.lock_ref
    assert adder.trim(64)  # a whole, b cut to 16 tokens (page-aligned: 24 -> 16), c out with its lock released
    assert [r.rid for r in adder.can_run] == ["a", "b"] and b.extend_input_len == 16 and adder.num_tokens == 56
    assert adder.new_chunked_req is b and node.lock_ref == locked - 1
    assert c.last_node is None and len(c.prefix_indices) == 0 and c.cached_tokens == 0  # as before `add`
    assert not adder.trim(56) and not adder.trim(100)  # the batch already fits
    adder = _adder(alloc, cache, buckets, chunk=1024)
    assert adder.add(_req(list(range(300, 310)), rid="d")) and not adder.trim(8)  # less than a page: no cut
    for r in (a, b):
        memory.tree_cache.dec_lock_ref(r.last_node)


def test_admission_cuts_a_padded_batch_at_a_smaller_bucket():
    """300 tokens of two requests with buckets 64, 256, 1024 and a 1024-token chunk: 256 run now (the second
    request cut to a chunk), not one 1024-token step; without chunking the batch runs whole."""
    pool = ReqToTokenPool(8, 512)
    alloc = PagedTokenToKVPoolAllocator(4096, 1)
    memory = KVMemory(pool, alloc, ChunkCache(pool, alloc))
    scoring = SchedulerScoring(memory, 60.0, lambda msg: None, [2])
    for chunk, want in ((1024, [200, 56]), (None, [200, 100])):
        admission = AdmissionPolicy(buckets=ShapeBuckets((64, 256, 1024), (1, 8)), max_running_requests=8,
                                    max_prefill_tokens=1024, chunk_size=chunk, memory=memory, scoring=scoring)
        a, b = _req(list(range(200)), rid="a"), _req(list(range(100)), rid="b")
        decided = admission.admit([a, b], [], None)
        assert [r.extend_input_len for r in decided.can_run] == want, chunk
        assert decided.new_chunked_req is (b if chunk else None)
        assert admission.num_bucket_cuts == (1 if chunk else 0)


def test_default_token_paddings_are_powers_of_four_then_the_chunk():
    from sgl_jax.srt.model_executor.buckets import default_token_paddings

    assert default_token_paddings(2048) == [64, 256, 1024, 2048]  # the default 2048-token chunk: 4 programs
    assert default_token_paddings(4096) == [64, 256, 1024, 4096]
    assert default_token_paddings(300) == [64, 256, 512] and default_token_paddings(256) == [64, 256]
    assert default_token_paddings(64) == [64] and default_token_paddings(10) == [64]
