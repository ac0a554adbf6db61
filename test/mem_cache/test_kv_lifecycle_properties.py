"""Property tests of the KV lifecycle (hypothesis state machine), page sizes 1, 4 and 16, no model.

Random sequences of admission (prefix match + lock + allocation, through PrefillAdder and ScheduleBatch),
chunked prefill steps, decode steps, finishing, retracting, double releases and evictions run against the
real ReqToTokenPool, allocator, RadixCache / ChunkCache and release_kv_cache. After every step:
- every page is owned exactly once: by the free list, by one tree node, or by one live request;
- free + evictable + protected + requests' own tokens == total (the idle invariant, generalized);
- a live request's row starts with the tree's slots for its protected prefix.

Hybrid SWA memory (SWAPagedAllocator with SWARadixCache or ChunkCache, window W): the same operations plus
SWA release after every step (as the scheduler does) and SWA-only eviction (tombstones; a later insert
heals them), and after every step additionally:
- every SWA page is owned exactly once: by the SWA free list or through the mapping of one full page that a
  live tree node or a live request owns (free full pages and tombstones map to none);
- swa free + swa_evictable + swa_protected + requests' own live SWA tokens == swa total;
- every live request can read its window: positions [committed - W + 1, committed) have live SWA KV;
- SWA locks sit only on live nodes.

The operations go through the rank's `KVMemory` (its admission budget, allocation, SWA release and release
path), whose exact page-ownership check (`check_invariants`, what SGL_JAX_CHECK_KV_INVARIANTS runs in a server)
must agree after every step. Every configuration -- page sizes, one pool or hybrid, radix or chunk cache --
runs >= 10,000 counted operations, with derandomized (fixed) examples.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from sgl_jax.srt.scheduler.schedule_batch import Req, ScheduleBatch
from sgl_jax.srt.scheduler.admission import PrefillAdder
from sgl_jax.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.chunk_cache import ChunkCache
from sgl_jax.srt.mem_cache.kv_memory import KVMemory
from sgl_jax.srt.mem_cache.lfu_radix_cache import LFURadixCache
from sgl_jax.srt.mem_cache.radix_cache import RadixCache
from sgl_jax.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sgl_jax.srt.mem_cache.swa_allocator import SWAPagedAllocator
from sgl_jax.srt.mem_cache.swa_radix_cache import SWARadixCache
from sgl_jax.srt.model_executor.buckets import ShapeBuckets
from sgl_jax.srt.forward_batch import ForwardMode
from sgl_jax.srt.sampling.sampling_params import SamplingParams

# A few shared "system prompts" so that requests really share prefixes.
BASES = [list(range(100, 100 + n)) for n in (0, 20, 37, 70)]


def lifecycle_machine(page_size: int, radix: bool, window: int = 0, ops: list = None, lfu: bool = False):
    """The state machine class; `window` > 0: hybrid SWA memory with that sliding window; `lfu`: the radix cache
    evicts least frequently used first (LFURadixCache); `ops` (a list) gets one entry per operation run."""

    class KVLifecycle(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.ps = page_size
            self.pool = ReqToTokenPool(6, 512)
            if window:  # tight in both pools: eviction, SWA eviction and retract happen
                self.alloc = SWAPagedAllocator(24 * 16, 9 * 16, page_size)
                self.cache = SWARadixCache(self.pool, self.alloc, page_size, window) if radix else \
                    ChunkCache(self.pool, self.alloc)
            else:
                self.alloc = PagedTokenToKVPoolAllocator(24 * 16, page_size)  # tight: eviction and retract happen
                radix_cls = LFURadixCache if lfu else RadixCache
                self.cache = radix_cls(self.pool, self.alloc, page_size) if radix else ChunkCache(self.pool, self.alloc)
            self.memory = KVMemory(self.pool, self.alloc, self.cache, sliding_window=window or None)
            self.buckets = ShapeBuckets((64, 256), (1, 8))
            self.running = []  # fully prefilled requests
            self.chunked = []  # requests between chunks
            self.waiting = []
            self.released = []
            self.n = 0

        # ---------------------------------------------------------------- operations
        @rule(base=st.integers(0, len(BASES) - 1), suffix=st.lists(st.integers(0, 30), min_size=1, max_size=40),
              max_new=st.integers(1, 30))
        def new_request(self, base, suffix, max_new):
            self._op()
            self.n += 1
            self.waiting.append(Req(f"r{self.n}", BASES[base] + suffix, SamplingParams(max_new_tokens=max_new),
                                    eos_token_ids=[], seed=0))

        @rule(chunk=st.sampled_from([None, 16, 48]), ratio=st.sampled_from([0.1, 0.7, 1.0]))
        def prefill(self, chunk, ratio):
            self._op()
            adder = PrefillAdder(self.buckets, self.memory, self.running, max_prefill_tokens=256,
                                 chunk_size=chunk if not self.chunked else (chunk or 48),
                                 free_req_slots=min(self.pool.available_size(), 6 - len(self.running) - len(self.chunked)),
                                 new_token_ratio=ratio)
            if self.chunked and not adder.add_chunked(self.chunked[0]):
                return
            for req in self.waiting:
                if not adder.add(req):
                    break
            if not adder.can_run:
                return
            self.waiting = [r for r in self.waiting if r not in adder.can_run]
            ScheduleBatch(adder.can_run, ForwardMode.EXTEND).prepare_for_extend(self.memory)
            self.chunked = []
            for req in adder.can_run:  # the "forward pass": K/V of the extended tokens are now written
                req.kv_committed_len = req.kv_allocated_len
                if req.kv_committed_len < req.seqlen:
                    self.memory.cache_unfinished(req)
                    self.chunked.append(req)
                else:
                    req.output_ids.append(7)
                    self.running.append(req)
            self._release_swa(adder.can_run)

        @precondition(lambda self: self.running)
        @rule()
        def decode(self):
            self._op()
            batch = ScheduleBatch(self.running, ForwardMode.DECODE)
            while self.running and not batch.prepare_for_decode(self.memory):
                self._retract(self.running[-1])
            for req in self.running:
                req.kv_committed_len = req.kv_allocated_len
                req.output_ids.append(len(req.output_ids) % 5)
            self._release_swa(self.running)

        @precondition(lambda self: self.running)
        @rule(i=st.integers(0, 100), insert=st.booleans())
        def finish(self, i, insert):
            self._op()
            req = self.running.pop(i % len(self.running))
            self.memory.release(req, is_insert=insert)
            self.released.append(req)

        @precondition(lambda self: self.running)
        @rule(i=st.integers(0, 100))
        def abort_after_allocating(self, i):
            """Slots for a decode step are taken, then the request ends before the step commits them."""
            self._op()
            req = self.running[i % len(self.running)]
            if ScheduleBatch([req], ForwardMode.DECODE).prepare_for_decode(self.memory):
                assert req.kv_allocated_len == req.kv_committed_len + 1
            self.running.remove(req)
            self.memory.release(req)
            self.released.append(req)

        @precondition(lambda self: self.running)
        @rule(i=st.integers(0, 100))
        def retract(self, i):
            self._op()
            self._retract(self.running[i % len(self.running)])

        def _retract(self, req):
            self.running.remove(req)
            self.memory.release(req, is_insert=False)
            req.reset_for_retract()
            self.waiting.insert(0, req)

        @precondition(lambda self: self.released)
        @rule(i=st.integers(0, 100))
        def double_release(self, i):
            self._op()
            self.memory.release(self.released[i % len(self.released)])  # must be a no-op

        @rule(n=st.integers(0, 200))
        def evict(self, n):
            self._op()
            self.cache.evict(n)

        @precondition(lambda self: window and radix)
        @rule(n=st.integers(0, 200))
        def evict_swa(self, n):
            self._op()
            self.cache.evict_swa(n)

        def _op(self):
            if ops is not None:
                ops.append(1)

        def _release_swa(self, reqs):
            """What the scheduler does after each step: free SWA KV that left the window."""
            self.memory.after_step([r for r in reqs if r.req_pool_idx is not None])

        # ---------------------------------------------------------------- invariants
        def _own_pages(self, req):
            row = self.pool.req_to_token[req.req_pool_idx]
            return row[req.cache_protected_len:req.kv_allocated_len:self.ps] // self.ps

        @invariant()
        def every_page_has_one_owner(self):
            owners = [self.alloc.free_page_ids()]
            tree_tokens = 0
            for node in (self.cache.nodes() if radix else []):
                owners.append(node.value[::self.ps] // self.ps)
                tree_tokens += len(node.key)
            live = self.running + self.chunked
            owners += [self._own_pages(r) for r in live]
            pages = np.concatenate(owners)
            assert len(pages) == len(np.unique(pages)), "a page is owned twice"
            assert sorted(pages.tolist()) == list(range(1, self.alloc.num_pages + 1)), "a page was lost"
            own_tokens = sum(len(self._own_pages(r)) for r in live) * self.ps
            total = self.alloc.available_size() + self.cache.evictable_size() + self.cache.protected_size()
            assert total + own_tokens == self.alloc.size
            assert self.cache.evictable_size() + self.cache.protected_size() == tree_tokens
            assert self.pool.available_size() == self.pool.size - len(live)

        @invariant()
        def the_exact_check_agrees(self):
            problems = self.memory.check_invariants(self.running + self.chunked)
            assert not problems, problems

        @invariant()
        def rows_start_with_the_cached_prefix(self):
            if not radix:
                return
            for req in self.running + self.chunked:
                n = req.cache_protected_len
                assert n % self.ps == 0
                match = self.cache.match_prefix(req.fill_ids[:n])
                assert match.length == n
                np.testing.assert_array_equal(self.pool.req_to_token[req.req_pool_idx][:n], match.device_indices)

        @invariant()
        def swa_pages_have_one_owner(self):
            if not window:
                return
            a, ps = self.alloc, self.ps
            live_reqs = self.running + self.chunked
            full_free = a.free_page_ids()
            assert not a.has_swa(full_free).any(), "a free full page still maps an SWA page"
            mapped, tree_swa = [], 0
            for node in (self.cache.nodes() if radix else []):
                has = a.has_swa(node.value[::ps] // ps)
                assert has.all() if not node.tombstone else not has.any(), "a node is part tombstone"
                assert node.swa_lock_ref == 0 or not node.tombstone, "an SWA lock on a tombstone"
                if not node.tombstone:
                    mapped.append(a.full_to_swa[node.value[::ps] // ps])
                    tree_swa += len(node.key)
            own_swa = 0
            for req in live_reqs:
                pages = self._own_pages(req)
                mapped.append(a.full_to_swa[pages[a.has_swa(pages)]])
                own_swa += int(a.has_swa(pages).sum()) * ps
                row = self.pool.req_to_token[req.req_pool_idx]
                window_pages = row[max(0, req.kv_committed_len - window + 1):req.kv_committed_len] // ps
                assert a.has_swa(window_pages).all(), f"{req.rid} lost SWA KV inside its window"
            swa_pages = np.concatenate(mapped + [a.swa.free_page_ids()])
            assert sorted(swa_pages.tolist()) == list(range(1, a.swa.num_pages + 1)), "an SWA page lost or shared"
            acc = self.memory.accounting()
            assert acc["swa_tokens_cached"] == tree_swa
            assert a.swa_available_size() + tree_swa + own_swa == a.swa_size

        def teardown(self):
            for req in self.running + self.chunked:
                self.memory.release(req)
            assert self.cache.protected_size() == 0
            assert self.alloc.available_size() + self.cache.evictable_size() == self.alloc.size
            assert not self.memory.idle_problems([])
            if window:
                acc = self.memory.accounting()
                assert acc["swa_tokens_protected"] == 0
                assert acc["swa_tokens_free"] + acc["swa_tokens_evictable"] == acc["swa_tokens_total"]
                self.cache.reset()
                assert self.alloc.swa_available_size() == self.alloc.swa_size
                assert self.alloc.available_size() == self.alloc.size

    return KVLifecycle


MIN_OPS = 10_000  # random operations per configuration, at least

CONFIGS = [(1, True, 0, False), (16, True, 0, False), (4, True, 0, True), (1, False, 0, False), (16, False, 0, False),
           (1, True, 8, False), (4, True, 8, False), (16, True, 16, False), (4, False, 8, False)]


@pytest.mark.parametrize("page_size,radix,window,lfu", CONFIGS,
                         ids=["radix-page1", "radix-page16", "lfu-radix-page4", "chunk-page1", "chunk-page16",
                              "swa-radix-page1", "swa-radix-page4", "swa-radix-page16", "swa-chunk-page4"])
def test_kv_lifecycle(page_size, radix, window, lfu):
    """Every pool layout and cache kind (one pool: RadixCache / ChunkCache; hybrid SWA pools: SWARadixCache /
    ChunkCache), driven through KVMemory: >= MIN_OPS random operations, the invariants after each."""
    ops = []
    machine = lifecycle_machine(page_size, radix, window, ops, lfu)
    run_state_machine_as_test(machine, settings=settings(max_examples=150, stateful_step_count=100, deadline=None,
                                                          derandomize=True, suppress_health_check=list(HealthCheck)))
    assert len(ops) >= MIN_OPS, f"only {len(ops)} operations ran"
