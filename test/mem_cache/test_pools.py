"""ReqToTokenPool, the paged allocator, ChunkCache and release_kv_cache, without a model."""

import numpy as np
import pytest

from sgl_jax.srt.scheduler.schedule_batch import Req
from sgl_jax.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.chunk_cache import ChunkCache
from sgl_jax.srt.mem_cache.hi_radix_cache import HostSlots
from sgl_jax.srt.mem_cache.common import release_kv_cache
from sgl_jax.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sgl_jax.srt.sampling.sampling_params import SamplingParams


def test_req_to_token_pool_alloc_free_and_double_free():
    pool = ReqToTokenPool(3, 8)
    got = {pool.alloc(), pool.alloc(), pool.alloc()}
    assert got == {0, 1, 2} and pool.alloc() is None and pool.available_size() == 0
    pool.write(1, 2, np.array([7, 8, 9], np.int32))
    assert pool.req_to_token[1, 2:5].tolist() == [7, 8, 9]
    pool.free(1)
    with pytest.raises(ValueError):
        pool.free(1)
    assert pool.alloc() == 1


@pytest.mark.parametrize("page_size", [1, 16])
def test_allocator_conservation_and_errors(page_size):
    a = PagedTokenToKVPoolAllocator(64 * page_size, page_size)
    assert a.size == 64 * page_size and a.available_size() == a.size
    pages = a.alloc_pages(10)
    assert 0 not in pages and len(set(pages.tolist())) == 10
    assert a.available_size() == a.size - 10 * page_size
    assert a.alloc_pages(55) is None and a.available_pages() == 54  # nothing taken on failure
    a.free_pages(pages[:4])
    with pytest.raises(ValueError):
        a.free_pages(pages[:1])  # double free
    with pytest.raises(ValueError):
        a.free_pages(np.array([0]))  # the reserved padding page
    a.free_pages(pages[4:])
    assert a.available_size() == a.size


def test_the_free_list_is_a_fifo_queue_across_wraps():
    """Pages come from the head of the free list and go back at its tail, in that order, however often the ring
    that holds it wraps: the same pages as a deque of the free pages gives, over random allocs and frees."""
    import collections
    import random

    rng = random.Random(0)
    a = PagedTokenToKVPoolAllocator(37, 1)
    ref, held = collections.deque(range(1, 38)), []
    for _ in range(2000):
        if held and rng.random() < 0.5:
            pages = held.pop(rng.randrange(len(held)))
            a.free_pages(pages)
            ref.extend(pages.tolist())
        else:
            n = rng.randrange(0, 12)
            pages = a.alloc_pages(n)
            if n > len(ref):
                assert pages is None
                continue
            assert pages.tolist() == [ref.popleft() for _ in range(n)]
            held.append(pages)
        assert a.available_pages() == len(ref) and a.free_page_ids().tolist() == list(ref)


def _device_pool(num_pages: int):
    a = PagedTokenToKVPoolAllocator(num_pages, 1)
    return (lambda: a.alloc_pages(200)), a.free_pages


def _host_pool(num_pages: int):
    h = HostSlots(num_pages, 1)
    return (lambda: h.alloc(200)), h.free


@pytest.mark.parametrize("pool", [_device_pool, _host_pool], ids=["device", "host"])
def test_alloc_and_free_cost_the_pages_they_move_not_the_pool(pool):
    """An alloc + free of 200 pages costs about the same in a pool of 8M pages as in one of 4,000 (the free list
    was re-concatenated at every free: 20 ms each in the large pool), for the device KV allocator and the host
    tier's pages alike (one PageFreeList). Timed against the small pool in this run."""
    import time

    def cycle_seconds(num_pages: int) -> float:
        alloc, free = pool(num_pages)
        free(alloc())  # (numpy's first unique call compiles and imports)
        t0 = time.perf_counter()
        for _ in range(50):
            held = [alloc() for _ in range(4)]
            for pages in held:
                free(pages)
        return time.perf_counter() - t0

    small, large = min(cycle_seconds(4_000) for _ in range(3)), min(cycle_seconds(8_000_000) for _ in range(3))
    assert large < 10 * small + 0.05, (large, small)


def test_host_pages_are_a_fifo_queue_and_a_double_free_fails():
    """The host tier's pages come and go in the same FIFO order as the device allocator's; a page freed twice is a
    ValueError that gives nothing back."""
    h = HostSlots(8, 2)
    first, second = h.alloc(4), h.alloc(2)
    assert first.tolist() == [0, 1, 2, 3] and second.tolist() == [4, 5]
    h.free(first)
    assert h.alloc(2).tolist() == [6, 7] and h.alloc(4).tolist() == [0, 1, 2, 3] and h.alloc(2) is None
    h.free(second)
    with pytest.raises(ValueError, match="host KV page freed twice"):
        h.free(second)
    assert h.available_size() == 2


@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_token_slots_continues_the_last_page(page_size):
    a = PagedTokenToKVPoolAllocator(32 * page_size, page_size)
    row = np.zeros(64, np.int32)
    s1 = a.alloc_token_slots(row, 0, 6)
    row[:6] = s1
    s2 = a.alloc_token_slots(row, 6, 11)
    row[6:11] = s2
    slots = row[:11]
    assert len(set(slots.tolist())) == 11 and (slots >= page_size).all()
    # positions within a page are contiguous slots of that page
    for p in range(11):
        assert slots[p] // page_size == slots[p - p % page_size] // page_size
        assert slots[p] % page_size == p % page_size
    used_pages = a.pages_of(row, 11)
    assert len(used_pages) == -(-11 // page_size)
    assert a.available_pages() == 32 - len(used_pages)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_alloc_decode_slots_equals_one_token_slot_per_sequence(page_size):
    """The batched decode allocation gives each sequence the slot alloc_token_slots(row, p, p + 1) gives, takes
    the same pages, and takes nothing when pages run out."""
    rng = np.random.default_rng(page_size)
    lens = rng.integers(1, 40, 12)
    batched, single = (PagedTokenToKVPoolAllocator(13 * 64, page_size) for _ in range(2))
    rows = np.zeros((12, 64), np.int32)
    for i, n in enumerate(lens):
        rows[i, :n] = batched.alloc_token_slots(rows[i], 0, int(n))
        assert np.array_equal(rows[i, :n], single.alloc_token_slots(rows[i], 0, int(n)))
    for _ in range(page_size + 2):  # (crosses a page boundary for every sequence)
        got = batched.alloc_decode_slots(rows[np.arange(12), lens - 1], lens)
        want = [single.alloc_token_slots(rows[i], int(n), int(n) + 1)[0] for i, n in enumerate(lens)]
        np.testing.assert_array_equal(got, want)
        rows[np.arange(12), lens] = got
        lens = lens + 1
        np.testing.assert_array_equal(batched.free_page_ids(), single.free_page_ids())
    tight = PagedTokenToKVPoolAllocator(2 * page_size, page_size)
    assert tight.alloc_decode_slots(np.zeros(3, np.int32), np.zeros(3, np.int64)) is None
    assert tight.available_pages() == 2


def _req(n_input, rid="r"):
    return Req(rid, list(range(n_input)), SamplingParams(max_new_tokens=4), eos_token_ids=[], seed=0)


@pytest.mark.parametrize("page_size", [1, 16])
def test_release_kv_cache_frees_everything_once(page_size):
    pool = ReqToTokenPool(2, 128)
    a = PagedTokenToKVPoolAllocator(256, page_size)
    cache = ChunkCache(pool, a)
    req = _req(37)
    req.req_pool_idx = pool.alloc()
    slots = a.alloc_token_slots(pool.req_to_token[req.req_pool_idx], 0, 37)
    pool.write(req.req_pool_idx, 0, slots)
    req.kv_allocated_len = 37
    assert a.available_size() < a.size
    release_kv_cache(req, cache)
    assert a.available_size() == a.size and pool.available_size() == 2
    assert req.req_pool_idx is None
    release_kv_cache(req, cache)  # idempotent
    assert a.available_size() == a.size and pool.available_size() == 2
    assert cache.match_prefix(list(range(37))).length == 0
