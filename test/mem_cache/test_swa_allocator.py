"""Hybrid SWA memory without a model: the budget split, the two-pool allocator, and SWA release."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_jax.srt.scheduler.schedule_batch import Req
from sgl_jax.srt.mem_cache.cache_manager import own_swa_pages
from sgl_jax.srt.mem_cache.cache_manager import release_swa_out_of_window
from sgl_jax.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sgl_jax.srt.mem_cache.swa_allocator import SWAPagedAllocator, split_hybrid_budget
from sgl_jax.srt.sampling.sampling_params import SamplingParams


def test_budget_split_keeps_the_memory_of_one_pool():
    full, swa = split_hybrid_budget(4096, 1, 2, 0.25, 1)
    assert (full, swa) == (8192, 2048) and full * 1 + swa * 2 == 4096 * 3
    full, swa = split_hybrid_budget(1000, 3, 15, 0.8, 16)  # Gemma-3-270M's 3 full : 15 sliding layers
    assert full % 16 == 0 and swa % 16 == 0 and full * 3 + swa * 15 <= 1000 * 18
    with pytest.raises(ValueError, match="less than one page"):
        split_hybrid_budget(10, 1, 1, 0.05, 16)
    with pytest.raises(ValueError, match="ratio"):
        split_hybrid_budget(100, 1, 1, 0.0, 1)


def _owned_once(alloc: SWAPagedAllocator, held_full):
    """Every page of both pools is free or held, never both, never twice."""
    full = sorted(alloc.free_page_ids().tolist() + held_full)
    assert full == list(range(1, alloc.num_pages + 1))
    mapped = [int(alloc.full_to_swa[p]) for p in held_full if alloc.full_to_swa[p]]
    assert sorted(alloc.swa.free_page_ids().tolist() + mapped) == list(range(1, alloc.swa.num_pages + 1))
    assert all(alloc.full_to_swa[p] == 0 for p in alloc.free_page_ids())


def test_allocation_rolls_back_when_either_pool_is_short():
    alloc = SWAPagedAllocator(64, 16, 4)  # 16 full pages, 4 SWA pages
    pages = alloc.alloc_pages(4)
    assert pages is not None and alloc.available_pages() == 0 and alloc.full_available_pages() == 12
    assert alloc.alloc_pages(1) is None  # SWA pool empty: nothing taken from the full pool either
    assert alloc.full_available_pages() == 12
    assert alloc.free_swa(pages[:2]) == 8 and alloc.swa_available_pages() == 2
    assert alloc.free_swa(pages[:2]) == 0  # already gone: skipped
    assert alloc.has_swa(pages).tolist() == [False, False, True, True]
    assert alloc.swa_page_table(pages[None, :]).tolist()[0][:2] == [0, 0]
    slots = pages * 4 + 1
    assert (alloc.swa_slots(slots)[:2] == 1).all()  # page 0's slot: attention never reads it in the window
    alloc.free_pages(pages)
    assert alloc.available_pages() == 4 and alloc.full_available_pages() == 16
    with pytest.raises(ValueError, match="twice"):
        alloc.free_pages(pages[:1])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "free_swa"]), st.integers(0, 5)), max_size=60))
def test_every_page_owned_exactly_once(ops):
    alloc = SWAPagedAllocator(96, 40, 4)
    held = []  # full pages held by "requests"
    for op, n in ops:
        if op == "alloc":
            pages = alloc.alloc_pages(n)
            if pages is not None:
                held += pages.tolist()
        elif op == "free" and held:
            take, held = held[:n], held[n:]
            alloc.free_pages(np.array(take, np.int32))
        elif op == "free_swa" and held:
            alloc.free_swa(np.array(held[:n], np.int32))
        _owned_once(alloc, held)


@pytest.mark.parametrize("page_size", [1, 4])
def test_release_frees_only_what_left_the_window(page_size):
    window = 8
    pool = ReqToTokenPool(2, 256)
    alloc = SWAPagedAllocator(256, 256, page_size)
    req = Req("r", list(range(1, 41)), SamplingParams(max_new_tokens=8), eos_token_ids=[], seed=0)
    req.req_pool_idx = pool.alloc()
    row = pool.req_to_token[req.req_pool_idx]
    slots = alloc.alloc_token_slots(row, 0, 40)
    pool.write(req.req_pool_idx, 0, slots)
    req.kv_allocated_len = req.kv_committed_len = 40
    before = alloc.swa_available_size()
    freed = release_swa_out_of_window(req, pool, alloc, window)
    # next query at 40 sees positions > 32; whole pages below 33, less one page of slack, lose their SWA KV
    end = (33 // page_size - 1) * page_size
    assert freed == end and req.swa_evicted_len == end and alloc.swa_available_size() == before + end
    assert not alloc.has_swa(alloc.pages_of(row, end)).any()
    assert alloc.has_swa(alloc.pages_of(row[end:], 40 - end)).all()
    assert own_swa_pages(req, page_size) == -(-40 // page_size) - end // page_size
    assert release_swa_out_of_window(req, pool, alloc, window) == 0  # nothing new left the window
    req.cache_protected_len = 40  # a prefix the cache owns is never freed by the request
    req.swa_evicted_len = 0
    req.kv_committed_len = req.kv_allocated_len = 40
    assert release_swa_out_of_window(req, pool, alloc, window) == 0
