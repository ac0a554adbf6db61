"""Property tests of the KV lifecycle (hypothesis state machine), no model: every cache kind (radix, lfu_radix,
chunk, swa_radix, chunk over the hybrid SWA allocator, and hiradix: radix with a host tier that evicted prefixes
go to and are loaded back from at admission) x page sizes 1, 4 and 16, each rank's KV memory built as
a server builds it (`KVMemory.create` from a `KVCacheSpec` and the cache flags, the kind from the registry).

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
must agree after every step -- the prefix locks included (each node's lock_ref is the number of live requests
whose locked prefix runs through it). Every configuration runs >= 10,000 counted operations, with derandomized
(fixed) examples; an operation counts only when it changes the state (a prefill that admits nothing, an eviction
that frees nothing and a double release, a no-op by contract, run but do not count).
"""

import types

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from sgl_jax.srt.scheduler.schedule_batch import Req, ScheduleBatch
from sgl_jax.srt.scheduler.admission import PrefillAdder
from sgl_jax.srt.mem_cache.hi_radix_cache import HostTier
from sgl_jax.srt.mem_cache.kv_memory import KVCacheSpec, KVMemory
from sgl_jax.srt.model_executor.buckets import ShapeBuckets
from sgl_jax.srt.forward_batch import ForwardMode
from sgl_jax.srt.sampling.sampling_params import SamplingParams

# A few shared "system prompts" so that requests really share prefixes.
BASES = [list(range(100, 100 + n)) for n in (0, 20, 37, 70)]


# configuration -> (cache kind, hybrid SWA memory, the cache flags that select the kind)
KINDS = {"radix": ("radix", False, dict(disable_radix_cache=False, radix_eviction_policy="lru")),
         "lfu_radix": ("lfu_radix", False, dict(disable_radix_cache=False, radix_eviction_policy="lfu")),
         "chunk": ("chunk", False, dict(disable_radix_cache=True)),
         "swa_radix": ("swa_radix", True, dict(disable_radix_cache=False)),
         "chunk_swa": ("chunk", True, dict(disable_radix_cache=True)),
         "hiradix": ("hiradix", False, dict(disable_radix_cache=False, enable_hierarchical_cache=True))}
HOST_TOKENS = 12 * 16  # the host tier's pool (hiradix): half the device pool, so that it evicts too


class ArrayMover:
    """The host tier's copies (hi_radix_cache.KVMover) between two numpy arrays standing for the KV pools."""

    def __init__(self, device_tokens: int):
        self.device, self.host = np.zeros(device_tokens + 16, np.int64), np.zeros(HOST_TOKENS, np.int64)

    def to_host(self, device_slots, host_slots):
        self.host[host_slots] = self.device[device_slots]

    def to_device(self, host_slots, device_slots):
        self.device[device_slots] = self.host[host_slots]


def new_memory(config: str, page_size: int, window: int) -> KVMemory:
    """The KV memory of configuration `config` (a KINDS key), built as a server builds it: 6 request slots, a full pool
    of 24 pages of 16 tokens (and, hybrid, an SWA pool of 9 such pages, sliding window `window`), tight enough that
    eviction, SWA eviction and retract happen."""
    kind, hybrid, flags = KINDS[config]
    spec = KVCacheSpec(page_size, (24 * 16, 9 * 16) if hybrid else (24 * 16,), (0, 1) if hybrid else (0,),
                       window if hybrid else None)
    tier = HostTier(HOST_TOKENS, ArrayMover(24 * 16), "write_back") if kind == "hiradix" else None
    memory = KVMemory.create(spec, num_request_slots=6, context_len=512, server_args=types.SimpleNamespace(**flags),
                             swa_release=True, host_tier=tier)
    assert memory.cache_kind == kind and memory.hybrid == hybrid
    return memory


class KVLifecycle(RuleBasedStateMachine):
    """The KV lifecycle of one configuration (the class attributes, set by `lifecycle_machine`): config (a KINDS
    key), ps (page size), window (the sliding window of a hybrid configuration, else 0), radix (a tree cache), ops
    (a list that gets one entry per operation that changed the state)."""

    config, ps, window, radix, ops = "radix", 1, 0, True, None

    def __init__(self):
        super().__init__()
        self.memory = new_memory(self.config, self.ps, self.window)
        self.pool, self.alloc, self.cache = self.memory.req_to_token_pool, self.memory.allocator, \
            self.memory.tree_cache
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

    @precondition(lambda self: self.waiting or self.chunked)
    @rule(chunk=st.sampled_from([None, 16, 48]), ratio=st.sampled_from([0.1, 0.7, 1.0]))
    def prefill(self, chunk, ratio):
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
            return  # (admitted nothing: not counted)
        self._op()
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
        before = self._sizes()
        self.memory.release(self.released[i % len(self.released)])  # a no-op by contract: not counted
        assert self._sizes() == before

    def _sizes(self):
        return (self.alloc.available_size(), self.cache.evictable_size(), self.cache.protected_size(),
                self.pool.available_size())

    @precondition(lambda self: self.cache.evictable_size())
    @rule(n=st.integers(0, 200))
    def evict(self, n):
        if self.cache.evict(n):  # (counted when it freed something)
            self._op()

    @precondition(lambda self: self.window and self.radix and self.cache.swa_evictable_size())
    @rule(n=st.integers(0, 200))
    def evict_swa(self, n):
        if self.cache.evict_swa(n):
            self._op()

    def _op(self):
        self.ops.append(1)

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
        for node in (self.cache.nodes() if self.radix else []):
            if node.value is None:  # (hiradix: a node on host only holds no device page)
                continue
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
        if not self.radix:
            return
        for req in self.running + self.chunked:
            n = req.cache_protected_len
            assert n % self.ps == 0
            match = self.cache.match_prefix(req.fill_ids[:n])
            assert match.length == n
            np.testing.assert_array_equal(self.pool.req_to_token[req.req_pool_idx][:n], match.device_indices)

    @invariant()
    def swa_pages_have_one_owner(self):
        if not self.window:
            return
        a, ps = self.alloc, self.ps
        live_reqs = self.running + self.chunked
        full_free = a.free_page_ids()
        assert not a.has_swa(full_free).any(), "a free full page still maps an SWA page"
        mapped, tree_swa = [], 0
        for node in (self.cache.nodes() if self.radix else []):
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
            window_pages = row[max(0, req.kv_committed_len - self.window + 1):req.kv_committed_len] // ps
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
        if self.config == "hiradix":  # the host tier's pool is exact too (idle_problems checks it)
            acc = self.memory.accounting()
            assert acc["host_kv_tokens_free"] + acc["host_kv_tokens_cached"] == acc["host_kv_tokens_total"]
            HOST_HITS.append(acc["host_hit_tokens"])
        if self.window:
            acc = self.memory.accounting()
            assert acc["swa_tokens_protected"] == 0
            assert acc["swa_tokens_free"] + acc["swa_tokens_evictable"] == acc["swa_tokens_total"]
            self.cache.reset()
            assert self.alloc.swa_available_size() == self.alloc.swa_size
            assert self.alloc.available_size() == self.alloc.size


def lifecycle_machine(config: str, page_size: int, window: int, ops: list):
    """The KVLifecycle state machine class of configuration `config` (a KINDS key; `window`: the sliding window of a
    hybrid one); `ops` (a list) gets one entry per operation that changed the state."""
    return type(f"KVLifecycle_{config}_page{page_size}", (KVLifecycle,),
                dict(config=config, ps=page_size, window=window if KINDS[config][1] else 0,
                     radix=KINDS[config][0] != "chunk", ops=ops))


MIN_OPS = 10_000  # counted operations per configuration, at least
WINDOW = {1: 8, 4: 8, 16: 16}  # page size -> the sliding window of the hybrid configurations

# (hiradix is radix with a host tier: pages 1 and 4 drive its own paths; page 16 adds nothing radix's does not)
CONFIGS = [(config, page_size) for config in KINDS for page_size in (1, 4, 16)
           if not (config == "hiradix" and page_size == 16)]
HOST_HITS = []  # tokens hiradix machines loaded back from the host tier (one entry per example)


@pytest.mark.parametrize("config,page_size", CONFIGS, ids=[f"{c}-page{p}" for c, p in CONFIGS])
def test_kv_lifecycle(config, page_size):
    """Every cache kind (radix, lfu_radix, chunk; hybrid SWA pools: swa_radix, chunk) x page sizes 1, 4, 16, driven
    through KVMemory: >= MIN_OPS counted random operations, the invariants after each."""
    ops = []
    machine = lifecycle_machine(config, page_size, WINDOW[page_size], ops)
    run_state_machine_as_test(machine, settings=settings(max_examples=100, stateful_step_count=200, deadline=None,
                                                          derandomize=True, suppress_health_check=list(HealthCheck)))
    assert len(ops) >= MIN_OPS, f"only {len(ops)} operations ran"
    if config == "hiradix":
        assert sum(HOST_HITS) > 0, "no prefix was loaded back from the host tier"
        HOST_HITS.clear()
