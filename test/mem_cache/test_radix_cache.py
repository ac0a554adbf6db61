"""RadixCache without a model: matching, page alignment, locking, LRU eviction, request hand-off."""

import numpy as np
import pytest

from sgl_jax.srt.scheduler.schedule_batch import Req
from sgl_jax.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.cache_manager import cache_unfinished_req
from sgl_jax.srt.mem_cache.common import release_kv_cache
from sgl_jax.srt.mem_cache.radix_cache import RadixCache
from sgl_jax.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sgl_jax.srt.sampling.sampling_params import SamplingParams


def make(page_size=1, tokens=256):
    pool = ReqToTokenPool(4, 512)
    alloc = PagedTokenToKVPoolAllocator(tokens, page_size)
    return pool, alloc, RadixCache(pool, alloc, page_size)


def slots_for(alloc, n):
    row = np.zeros(512, np.int32)
    row[:n] = alloc.alloc_token_slots(row, 0, n)
    return row[:n].copy()


def test_match_insert_and_split():
    _, alloc, cache = make()
    s = slots_for(alloc, 6)
    assert cache.insert([1, 2, 3, 4, 5, 6], s) == 0
    assert cache.evictable_size() == 6
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert m.device_indices.tolist() == s.tolist()
    m = cache.match_prefix([1, 2, 3, 9])  # diverges inside the node: split
    assert m.device_indices.tolist() == s[:3].tolist() and len(m.last_node.key) == 3
    assert len(cache.nodes()) == 2 and cache.evictable_size() == 6
    s2 = slots_for(alloc, 2)
    assert cache.insert([1, 2, 3, 9, 9], np.concatenate([s[:3], s2])[:5]) == 3  # 3 already cached
    assert cache.match_prefix([1, 2, 3, 9, 9]).length == 5 and cache.evictable_size() == 8
    assert cache.match_prefix([7]).length == 0


def test_page_aligned_matching():
    _, alloc, cache = make(page_size=4)
    s = slots_for(alloc, 8)
    cache.insert(list(range(8)), s)
    assert cache.match_prefix(list(range(7))).length == 4  # only whole pages
    assert cache.match_prefix(list(range(6)) + [99, 99]).length == 4  # mismatch inside page 2
    assert cache.match_prefix(list(range(8)) + [5]).length == 8
    with pytest.raises(AssertionError):
        cache.insert(list(range(6)), s[:6])  # inserts must be whole pages


def test_locked_paths_survive_eviction_and_lru_order():
    _, alloc, cache = make()
    a, b = slots_for(alloc, 4), slots_for(alloc, 4)
    cache.insert([1, 1, 1, 1], a)
    cache.insert([2, 2, 2, 2], b)
    cache.match_prefix([1, 1, 1, 1])  # touch: [2, ...] is now least recently used
    locked = cache.match_prefix([1, 1])
    assert cache.inc_lock_ref(locked.last_node) == 2  # the split-off upper node
    assert cache.protected_size() == 2 and cache.evictable_size() == 6
    free_before = alloc.available_size()
    assert cache.evict(1) == 4  # the LRU leaf [2, 2, 2, 2]
    assert cache.match_prefix([2, 2]).length == 0 and cache.match_prefix([1, 1, 1, 1]).length == 4
    assert cache.evict(100) == 2  # only the unlocked tail of [1, 1, 1, 1] can go
    assert cache.match_prefix([1, 1, 1, 1]).length == 2
    assert alloc.available_size() == free_before + 6
    with pytest.raises(RuntimeError):
        cache.reset()  # locked
    assert cache.dec_lock_ref(locked.last_node) == 2
    cache.reset()
    assert alloc.available_size() == alloc.size and cache.evictable_size() == cache.protected_size() == 0


def _running_req(pool, alloc, cache, ids, committed, page_size):
    """A request admitted through its matched prefix, with `committed` positions computed."""
    req = Req("r", ids, SamplingParams(max_new_tokens=8), eos_token_ids=[], seed=0)
    m = cache.match_prefix(ids[:len(ids) - 1])
    cache.inc_lock_ref(m.last_node)
    req.last_node = m.last_node
    req.req_pool_idx = pool.alloc()
    pool.write(req.req_pool_idx, 0, m.device_indices)
    req.cache_protected_len = req.kv_committed_len = m.length
    row = pool.req_to_token[req.req_pool_idx]
    pool.write(req.req_pool_idx, m.length, alloc.alloc_token_slots(row, m.length, len(ids)))
    req.kv_allocated_len = len(ids)
    req.kv_committed_len = committed
    return req


@pytest.mark.parametrize("page_size", [1, 4])
def test_finished_requests_share_and_free_exactly(page_size):
    pool, alloc, cache = make(page_size)
    ids = list(range(30))
    a = _running_req(pool, alloc, cache, ids, 30, page_size)
    b = _running_req(pool, alloc, cache, ids[:20] + [99] * 5, 25, page_size)  # computed the prefix again
    release_kv_cache(a, cache)
    aligned = 30 // page_size * page_size
    assert cache.evictable_size() == aligned
    release_kv_cache(b, cache)  # its duplicate prefix pages are freed, its own suffix cached
    release_kv_cache(b, cache)  # no-op
    used = alloc.size - alloc.available_size()
    assert used == cache.evictable_size() and cache.protected_size() == 0
    c = Req("c", ids[:20] + [99] * 5 + [1], SamplingParams(), eos_token_ids=[], seed=0)
    assert cache.match_prefix(c.fill_ids).length == 25 // page_size * page_size  # b computed 25
    cache.reset()
    assert alloc.available_size() == alloc.size


def test_chunk_handoff_keeps_row_consistent():
    pool, alloc, cache = make(page_size=4)
    ids = list(range(50))
    req = _running_req(pool, alloc, cache, ids, 22, 4)  # a chunk of 22 computed
    cache_unfinished_req(req, cache)
    assert req.cache_protected_len == 20 and cache.protected_size() == 20
    row = pool.req_to_token[req.req_pool_idx]
    assert row[:20].tolist() == cache.match_prefix(ids[:20]).device_indices.tolist()
    req.kv_committed_len = 50
    release_kv_cache(req, cache, is_insert=False)  # retract: the request's own pages are freed
    assert cache.protected_size() == 0 and cache.evictable_size() == 20
    assert alloc.size - alloc.available_size() == 20


def test_lfu_evicts_the_least_reused_prefix_first():
    """--radix-eviction-policy lfu (LFURadixCache): a prefix reused by three finished requests survives eviction
    although used longest ago; LRU (RadixCache) evicts it first. A hit is one finished request (release_kv_cache),
    not a match: re-matching (a request waiting for room) and a retract count nothing. Hits survive a split."""
    from sgl_jax.srt.mem_cache.lfu_radix_cache import LFURadixCache

    def finish_one(pool, alloc, cache, ids, rid, insert=True):
        req = Req(rid, ids, SamplingParams(max_new_tokens=1), eos_token_ids=[], seed=0)
        match = cache.match_prefix(ids)
        cache.inc_lock_ref(match.last_node)
        req.req_pool_idx, req.last_node = pool.alloc(), match.last_node
        pool.write(req.req_pool_idx, 0, match.device_indices)
        row = pool.req_to_token[req.req_pool_idx]
        pool.write(req.req_pool_idx, match.length, alloc.alloc_token_slots(row, match.length, len(ids)))
        req.cache_protected_len = match.length
        req.kv_allocated_len = req.kv_committed_len = len(ids)
        release_kv_cache(req, cache, is_insert=insert)

    for cls, survivor in ((LFURadixCache, "shared"), (RadixCache, "recent")):
        pool = ReqToTokenPool(4, 512)
        alloc = PagedTokenToKVPoolAllocator(256, 1)
        cache = cls(pool, alloc, 1)
        shared, recent = [1, 2, 3, 4], [7, 8, 9, 10]
        finish_one(pool, alloc, cache, shared, "first")
        for i in range(3):
            finish_one(pool, alloc, cache, shared + [5 + i], f"reuse{i}")  # reuses [1, 2, 3, 4]
        cache.evict(3)  # the three one-token suffixes ([5], [6], [7] leaves) go first in both orders
        finish_one(pool, alloc, cache, recent, "recent")
        for _ in range(5):
            cache.match_prefix(recent)  # matched, never reused: no hit
        assert cache.evict(4) == 4
        kept = "shared" if cache.match_prefix(shared).length == 4 else "recent"
        assert kept == survivor, cls.__name__
    lfu = LFURadixCache(ReqToTokenPool(4, 512), PagedTokenToKVPoolAllocator(256, 1), 1)
    finish_one(lfu.req_to_token_pool, lfu.allocator, lfu, [1, 2, 3, 4], "a")
    finish_one(lfu.req_to_token_pool, lfu.allocator, lfu, [1, 2, 3, 4, 9], "b")  # one hit on [1, 2, 3, 4]
    finish_one(lfu.req_to_token_pool, lfu.allocator, lfu, [1, 2, 3, 4, 9], "c", insert=False)  # retract: none
    m = lfu.match_prefix([1, 2, 8])  # splits [1, 2 | 3, 4]: the upper node keeps the hit
    assert m.last_node.hit_count == 1 and next(iter(m.last_node.children.values())).hit_count == 1


@pytest.mark.parametrize("page_size", [1, 4])
def test_retire_frees_the_unlocked_and_sets_the_locked_apart(page_size):
    """RadixCache.retire (new weights): the unlocked prefixes are freed at once; the ones running requests lock
    (base and a LoRA namespace) are never matched again, their holders finish into the retired namespaces, and
    evict_namespace then frees them: the pool is exactly free again."""
    from sgl_jax.srt.mem_cache.base_prefix_cache import retired_namespace

    pool, alloc, cache = make(page_size)
    ids, other = list(range(1, 25)), list(range(100, 124))
    cache.insert(other, slots_for(alloc, 24))  # cached, nobody holds it
    a = _running_req(pool, alloc, cache, ids, 24, page_size)
    release_kv_cache(a, cache)  # ids cached now
    held = _running_req(pool, alloc, cache, ids + [7] * 8, 32, page_size)  # locks the cached ids
    held.cache_namespace = None
    lora = Req("l", ids, SamplingParams(max_new_tokens=8), eos_token_ids=[], seed=0)
    m = cache.match_prefix(ids[:-1], namespace=5)  # (nothing yet in namespace 5)
    assert m.length == 0
    cache.insert(ids[:16], slots_for(alloc, 16), namespace=5)
    m = cache.match_prefix(ids[:-1], namespace=5)
    cache.inc_lock_ref(m.last_node)
    lora.last_node, lora.cache_namespace = m.last_node, 5
    keys = cache.retire(1)
    assert sorted(keys, key=str) == sorted([retired_namespace(1, None), retired_namespace(1, 5)], key=str)
    assert cache.evictable_size() == 0  # the unlocked went at once
    assert cache.match_prefix(ids).length == 0 and cache.match_prefix(other).length == 0
    assert cache.match_prefix(ids, namespace=5).length == 0
    held.cache_namespace = retired_namespace(1, None)  # (what the scheduler does to the requests it pauses)
    held.finished_reason = None
    release_kv_cache(held, cache)  # its KV goes into the retired namespace, matched by nobody
    assert cache.match_prefix(ids + [7] * 8).length == 0
    cache.dec_lock_ref(lora.last_node)
    for key in keys:
        cache.evict_namespace(key)
    assert cache.namespace_roots() == [] and list(cache.root.children) == []
    assert alloc.available_size() == alloc.size and cache.protected_size() == 0
