"""A streaming session's KV (mem_cache/session_kv.py) through the real pools, no model: pages 1, 4 and 16,
RadixCache and hybrid SWA memory with SWARadixCache (window 8).

Turn 1 shares a page-unaligned prefix with a cached request; each turn is admitted through PrefillAdder and
ScheduleBatch (the session's row is lent at admission), decodes with SWA release, and ends as the scheduler
ends it (release_kv_cache). After every step the exact page-ownership check holds (every page free, cached or
held once; cache_protected_len page-aligned), and:
- a finished turn's KV stays with the session (its slot too); the next turn's prefix is the whole committed
  history and cache_protected_len stays turn 1's tree prefix;
- an aborted or retracted turn frees only its own KV: the session's lengths are as before, and with SWA
  memory the window before the session's end still has live SWA KV (after decoding past several windows),
  while the turn's own SWA KV past that window was released as it went (about two windows at most); between
  turns a session holds about one window of SWA KV;
- closing releases everything through release_kv_cache: free + cached == total, every slot free.
"""

import numpy as np
import pytest

from sgl_jax.srt.scheduler.schedule_batch import FinishReason, Req, ScheduleBatch, finish_abort
from sgl_jax.srt.scheduler.admission import PrefillAdder
from sgl_jax.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.cache_manager import cache_unfinished_req, release_swa_out_of_window
from sgl_jax.srt.mem_cache.common import release_kv_cache
from sgl_jax.srt.mem_cache.kv_invariants import check_kv_invariants
from sgl_jax.srt.mem_cache.kv_memory import KVMemory
from sgl_jax.srt.mem_cache.radix_cache import RadixCache
from sgl_jax.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sgl_jax.srt.mem_cache.session_kv import SessionKV
from sgl_jax.srt.mem_cache.swa_allocator import SWAPagedAllocator
from sgl_jax.srt.mem_cache.swa_radix_cache import SWARadixCache
from sgl_jax.srt.model_executor.buckets import ShapeBuckets
from sgl_jax.srt.forward_batch import ForwardMode
from sgl_jax.srt.sampling.sampling_params import SamplingParams

W = 8


class Sim:
    """The scheduler's KV steps on real pools (the forward pass only marks K/V as written)."""

    def __init__(self, page_size: int, swa: bool):
        self.ps, self.window = page_size, (W if swa else None)
        self.pool = ReqToTokenPool(4, 512)
        if swa:
            self.alloc = SWAPagedAllocator(64 * 16, 24 * 16, page_size)
            self.cache = SWARadixCache(self.pool, self.alloc, page_size, W)
        else:
            self.alloc = PagedTokenToKVPoolAllocator(64 * 16, page_size)
            self.cache = RadixCache(self.pool, self.alloc, page_size)
        self.buckets = ShapeBuckets((64, 256), (1, 8))
        self.memory = KVMemory(self.pool, self.alloc, self.cache, sliding_window=self.window)
        self.kv = self.memory.new_session_kv()
        self.n = 0

    def req(self, ids, session=True, max_new=64) -> Req:
        self.n += 1
        r = Req(f"r{self.n}", ids, SamplingParams(max_new_tokens=max_new), eos_token_ids=[], seed=0)
        r.session_kv = self.kv if session else None
        return r

    def holders(self, *running):
        return [r for r in running if r.req_pool_idx is not None] + ([self.kv.holder] if self.kv.has_kv() else [])

    def check(self, *running):
        problems = check_kv_invariants(self.alloc, self.cache, self.pool, self.holders(*running))
        assert not problems, problems

    def admit(self, req, chunk=48) -> int:
        """Admit and prefill `req` (chunk by chunk); returns the prefix it reused."""
        prefix = None
        while True:
            adder = PrefillAdder(self.buckets, self.memory, [], max_prefill_tokens=256, chunk_size=chunk,
                                 free_req_slots=self.pool.available_size(), free_running=4, new_token_ratio=0.1)
            assert (adder.add_chunked(req) if req.req_pool_idx is not None else adder.add(req))
            if prefix is None:
                prefix = len(req.prefix_indices)
            ScheduleBatch([req], ForwardMode.EXTEND).prepare_for_extend(self.memory)
            req.kv_committed_len = req.kv_allocated_len
            self.swa_release(req)
            if req.kv_committed_len < req.seqlen:
                cache_unfinished_req(req, self.cache)
                self.check(req)
                continue
            req.output_ids.append(11)
            self.check(req)
            return prefix

    def decode(self, req, steps: int) -> None:
        for i in range(steps):
            assert ScheduleBatch([req], ForwardMode.DECODE).prepare_for_decode(self.memory)
            req.kv_committed_len = req.kv_allocated_len
            req.output_ids.append(20 + i % 7)
            self.swa_release(req)
            self.check(req)

    def swa_release(self, req) -> None:
        if self.window:
            release_swa_out_of_window(req, self.pool, self.alloc, W)

    def session_state(self) -> tuple:
        h = self.kv.holder
        return h.req_pool_idx, h.kv_committed_len, h.kv_allocated_len, h.cache_protected_len, h.last_node

    def live_swa_pages(self, req) -> int:
        """Pages of `req`'s own KV (past its cached prefix) that still have SWA KV."""
        row = self.pool.req_to_token[req.req_pool_idx]
        pages = row[req.cache_protected_len:req.kv_allocated_len:self.ps] // self.ps
        return int(self.alloc.has_swa(pages).sum())

    def window_is_live(self) -> bool:
        """SWA KV of the positions the session's next query sees (its last W - 1 computed positions)."""
        h = self.kv.holder
        row = self.pool.req_to_token[h.req_pool_idx]
        start = max(0, h.kv_committed_len - W + 1)
        pages = row[start:h.kv_committed_len] // self.ps
        return bool(self.alloc.has_swa(pages).all())


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("swa", [False, True], ids=["radix", "swa-radix"])
def test_session_kv_turns_abort_retract_close(page_size, swa):
    sim = Sim(page_size, swa)
    base = list(range(100, 137))  # 37 tokens: page-unaligned
    plain = sim.req(base + [1, 2, 3], session=False)
    sim.admit(plain)
    sim.decode(plain, 3)
    plain.finished_reason = FinishReason("length", length=4)
    release_kv_cache(plain, sim.cache)
    sim.check()

    # turn 1: through the prefix cache (its lock is kept), chunk-prefilled, decoded, finished -> held
    t1 = sim.req(base + list(range(500, 560)))
    matched = sim.admit(t1)  # (SWA: only where the window is live; the plain request released part of it)
    assert matched == 37 // page_size * page_size or (swa and matched % page_size == 0)
    sim.decode(t1, 5)
    t1.finished_reason = FinishReason("length", length=6)
    release_kv_cache(t1, sim.cache)
    assert sim.kv.holder is t1 and sim.kv.has_kv() and t1.req_pool_idx is not None
    protected = t1.cache_protected_len
    assert protected % page_size == 0 and protected >= matched
    assert sim.pool.available_size() == sim.pool.size - 1
    sim.check()
    held = sim.kv.held_tokens(page_size)
    assert held == -(-t1.kv_allocated_len // page_size) * page_size - protected

    # turn 2, aborted after decoding past several windows: the session is as turn 1 left it
    before = sim.session_state()
    t2 = sim.req(t1.fill_ids + list(range(600, 611)))
    assert sim.admit(t2) == t1.kv_committed_len  # the whole history but its last token
    sim.decode(t2, 4 * W + 3)
    if swa:  # the turn's own SWA KV past the session's window is released as it decodes
        assert sim.live_swa_pages(t2) <= 2 * -(-W // page_size) + 3
    t2.finished_reason = finish_abort("client went away")
    release_kv_cache(t2, sim.cache)
    assert sim.session_state() == before and t2.req_pool_idx is None
    assert sim.kv.held_tokens(page_size) == held
    if swa:
        assert sim.window_is_live()
    sim.check()

    # turn 2 again, retracted mid-decode (is_insert False), re-admitted, finished
    t2 = sim.req(t1.fill_ids + list(range(700, 709)))
    sim.admit(t2)
    sim.decode(t2, 2 * W)
    release_kv_cache(t2, sim.cache, is_insert=False)
    t2.reset_for_retract()
    assert sim.session_state() == before
    if swa:
        assert sim.window_is_live()
    sim.check()
    assert sim.admit(t2) == t1.kv_committed_len
    sim.decode(t2, 3)
    t2.finished_reason = FinishReason("length", length=len(t2.output_ids))
    release_kv_cache(t2, sim.cache)
    assert sim.kv.holder is t2 and t2.cache_protected_len == protected  # still turn 1's tree prefix
    if swa:  # between turns the session keeps about one window of SWA KV
        assert sim.live_swa_pages(t2) <= -(-W // page_size) + 2
        assert sim.window_is_live()
    sim.check()

    # turn 3 reuses everything; close releases all of it through release_kv_cache
    t3 = sim.req(t2.fill_ids + [5, 6, 7])
    assert sim.admit(t3) == t2.kv_committed_len
    t3.finished_reason = FinishReason("length", length=1)
    release_kv_cache(t3, sim.cache)
    sim.kv.release(sim.cache)
    assert not sim.kv.has_kv()
    sim.check()
    assert sim.pool.available_size() == sim.pool.size and sim.cache.protected_size() == 0
    assert sim.alloc.available_size() + sim.cache.evictable_size() == sim.alloc.size
    if swa:
        assert sim.alloc.swa_available_size() + sim.cache.swa_evictable_size() == sim.alloc.swa_size


def test_aborted_turn_one_releases_everything():
    sim = Sim(4, True)
    t1 = sim.req(list(range(100, 150)))
    sim.admit(t1)
    sim.decode(t1, 3)
    t1.finished_reason = finish_abort("aborted")
    release_kv_cache(t1, sim.cache)
    assert sim.kv.holder is None and sim.pool.available_size() == sim.pool.size
    sim.check()
    assert sim.kv.history_ids() == []


def test_trim_to_a_shorter_prompt():
    """A turn whose prompt adds nothing (a turn 1 without output, the next turn without new ids) reuses all
    but the last position, which it recomputes."""
    sim = Sim(4, False)
    t1 = sim.req(list(range(100, 131)), max_new=0)
    sim.admit(t1)
    t1.output_ids.clear()
    t1.finished_reason = FinishReason("length", length=0)
    release_kv_cache(t1, sim.cache)
    assert t1.kv_committed_len == 31
    t2 = sim.req(list(t1.fill_ids))
    assert sim.admit(t2) == 30
    sim.check(t2)
    assert np.array_equal(sim.pool.req_to_token[t2.req_pool_idx, :30], t2.prefix_indices)
