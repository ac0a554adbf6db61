"""HiRadixCache (mem_cache/hi_radix_cache.py) without a model: a hypothesis state machine over requests that load
back, match, lock, insert and release, over eviction of the device pool (to the host pool or out of the tree), and
over retirement, for each write policy and page sizes 1 and 4, with a small host pool that must evict too.

Each KV slot holds a stand-in for K/V: a hash of the token prefix that ends at its position (real KV depends
on exactly that), written when a request "computes" it and copied between the pools by a numpy mover. After
every step:
- every device page is owned once (free list, one tree node, or one live request) and free + evictable +
  protected + the live requests' own tokens == total;
- every host page is owned once (free list or one node's host copy) and free + used == total;
- a node on host has a host copy and only nodes on host below it; every node's device and host slots hold the
  KV of its own prefix (what loading back must restore);
- a request admitted after `load_back` reads, on the device, the KV of its own prefix for every matched token.
"""

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from sgl_jax.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.hi_radix_cache import WRITE_POLICIES, HiRadixCache
from sgl_jax.srt.mem_cache.kv_invariants import cached_pages, host_problems, lock_problems
from sgl_jax.srt.mem_cache.req_to_token_pool import ReqToTokenPool

DEVICE_TOKENS, HOST_TOKENS = 48, 64


def kv_of(tokens) -> np.ndarray:
    """The stand-in KV of each position of `tokens`: a hash of the prefix ending there."""
    out, h = [], 17
    for t in tokens:
        h = (h * 1_000_003 + int(t) + 1) % 2_147_483_629
        out.append(h)
    return np.asarray(out, np.int64)


class NumpyMover:
    def __init__(self, device: np.ndarray, host: np.ndarray):
        self.device, self.host = device, host

    def to_host(self, device_slots, host_slots):
        self.host[host_slots] = self.device[device_slots]

    def to_device(self, host_slots, device_slots):
        self.device[device_slots] = self.host[host_slots]


def make_machine(page_size: int, policy: str):
    class HiCacheMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.ps = page_size
            self.alloc = PagedTokenToKVPoolAllocator(DEVICE_TOKENS, page_size)
            self.device = np.full(DEVICE_TOKENS + page_size, -1, np.int64)
            self.host = np.full(HOST_TOKENS, -1, np.int64)
            self.cache = HiRadixCache(ReqToTokenPool(4, 64), self.alloc, page_size, HOST_TOKENS,
                                      NumpyMover(self.device, self.host), policy)
            self.live = []  # (tokens, last_node, own slots)

        def _pages(self, slots):
            return (np.asarray(slots)[::self.ps] // self.ps).astype(np.int32)

        @rule(prefix=st.integers(0, 3), tail=st.lists(st.integers(0, 3), max_size=12 // page_size * page_size),
              hold=st.booleans())
        def request(self, prefix, tail, hold):
            """Admit a request (load back, match, lock, check its KV), compute the rest, insert it; keep it live
            (locked, owning its slots) or release it at once."""
            tokens = [prefix] * (2 * self.ps) + list(tail)
            n = len(tokens) // self.ps * self.ps
            tokens = tokens[:n]
            self.cache.load_back(tokens)
            m = self.cache.match_prefix(tokens)
            assert (self.device[m.device_indices] == kv_of(tokens)[:m.length]).all(), "wrong KV matched"
            self.cache.inc_lock_ref(m.last_node)
            need = (n - m.length) // self.ps
            pages = self.alloc.alloc_pages(need)
            if pages is None:
                self.cache.evict((need - self.alloc.available_pages()) * self.ps)
                pages = self.alloc.alloc_pages(need)
            if pages is None:
                self.cache.dec_lock_ref(m.last_node)
                return
            own = (pages[:, None] * self.ps + np.arange(self.ps)).reshape(-1).astype(np.int32)
            self.device[own] = kv_of(tokens)[m.length:]
            if hold:
                self.live.append((tokens, m.last_node, own, m.device_indices))
            else:
                self._finish(tokens, m.last_node, own, m.device_indices)

        def _finish(self, tokens, last_node, own, matched):
            row = np.concatenate([matched, own]).astype(np.int32)
            existed = self.cache.insert(tokens, row)
            if existed > len(matched):
                self.cache.free_slots(row[len(matched):existed])
            self.cache.dec_lock_ref(last_node)

        @rule(data=st.data())
        def release(self, data):
            if self.live:
                i = data.draw(st.integers(0, len(self.live) - 1))
                self._finish(*self.live.pop(i))

        @rule(tokens=st.integers(1, DEVICE_TOKENS))
        def evict(self, tokens):
            self.cache.evict(tokens)

        @rule()
        def retire(self):
            """New weights: nothing cached matches again; live requests finish into their retired namespace."""
            if self.live:
                return  # (the scheduler's holders are covered by test_radix_cache's retire test)
            self.cache.retire(1)
            for key in list(self.cache._namespaces):
                self.cache.evict_namespace(key)
            assert self.cache.nodes() == [] and self.cache.host_used_size() == 0

        @invariant()
        def pools_exact(self):
            c = self.cache
            owners = np.zeros(self.alloc.num_pages + 1, int)
            np.add.at(owners, self.alloc.free_page_ids(), 1)
            host_owners = np.zeros(c.host.num_pages, int)
            np.add.at(host_owners, c.host.free_list.ids(), 1)
            for node in c.nodes():
                tokens = self._path_tokens(node)
                kv = kv_of(tokens)[len(tokens) - len(node.key):]
                if node.value is not None:
                    np.add.at(owners, self._pages(node.value), 1)
                    assert (self.device[node.value] == kv).all(), "a device node holds another prefix's KV"
                else:
                    assert node.host_value is not None, "a node on neither pool"
                    assert all(ch.value is None for ch in node.children.values()), "a device node below a host one"
                if node.host_value is not None:
                    np.add.at(host_owners, self._pages(node.host_value), 1)
                    assert (self.host[node.host_value] == kv).all(), "a host copy holds another prefix's KV"
            own = 0
            for _, _, slots, _ in self.live:
                np.add.at(owners, self._pages(slots), 1)
                own += len(slots)
            assert (owners[1:] == 1).all() and owners[0] == 0, "a device page owned twice or leaked"
            assert (host_owners == 1).all(), "a host page owned twice or leaked"
            assert (self.alloc.available_size() + c.evictable_size() + c.protected_size() + own
                    == self.alloc.size)
            assert c.host_available_size() + c.host_used_size() == c.host_size()
            # the server's own checks (kv_invariants.py, run by the idle check) agree
            holders = [SimpleNamespace(rid=i, last_node=live[1]) for i, live in enumerate(self.live)]
            assert lock_problems(c, holders) == [] and host_problems(c) == []
            assert len(cached_pages(c)) * self.ps == c.evictable_size() + c.protected_size()

        def _path_tokens(self, node):
            parts = []
            while node is not None and node is not self.cache.root:
                parts.append(node.key)
                node = node.parent
            return np.concatenate(parts[::-1]) if parts else np.zeros(0, np.int32)

        def teardown(self):
            while self.live:
                self._finish(*self.live.pop())
            self.cache.reset()
            assert self.alloc.available_size() == self.alloc.size
            assert self.cache.host_available_size() == self.cache.host_size()

    return HiCacheMachine


@pytest.mark.parametrize("policy", WRITE_POLICIES)
@pytest.mark.parametrize("page_size", [1, 4])
def test_hi_radix_cache_state_machine(page_size, policy):
    run_state_machine_as_test(make_machine(page_size, policy), settings=settings(
        max_examples=60, stateful_step_count=40, deadline=None, derandomize=True,
        suppress_health_check=list(HealthCheck)))


def test_evicted_prefix_is_loaded_back_not_recomputed():
    """write_back: a prefix pushed out of the device pool is matched from the host (load_back returns its
    length and counts it), with its own KV."""
    alloc = PagedTokenToKVPoolAllocator(16, 1)
    device, host = np.full(17, -1, np.int64), np.full(32, -1, np.int64)
    cache = HiRadixCache(ReqToTokenPool(2, 32), alloc, 1, 32, NumpyMover(device, host), "write_back")
    a = list(range(1, 13))
    slots = alloc.alloc_pages(12)
    device[slots] = kv_of(a)
    assert cache.insert(a, slots) == 0
    assert cache.evict(12) == 12 and cache.match_prefix(a).length == 0
    assert cache.host_used_size() == 12 and alloc.available_size() == 16
    assert cache.host_match_len(a + [99]) == 12
    assert cache.load_back(a + [99]) == 12 and cache.num_host_hit_tokens == 12
    m = cache.match_prefix(a + [99])
    assert m.length == 12 and (device[m.device_indices] == kv_of(a)).all()


def test_host_checks_catch_planted_faults():
    """The idle check's host-tier invariants (kv_invariants.host_problems, lock_problems' device-only sizes) report a
    leaked host page, a host page owned twice and a node on host with no copy; clean otherwise."""
    def cache_with_host_prefix():
        alloc = PagedTokenToKVPoolAllocator(16, 1)
        device, host = np.full(17, -1, np.int64), np.full(32, -1, np.int64)
        cache = HiRadixCache(ReqToTokenPool(2, 32), alloc, 1, 32, NumpyMover(device, host), "write_back")
        slots = alloc.alloc_pages(8)
        cache.insert(list(range(1, 9)), slots)
        cache.evict(8)
        return cache

    clean = cache_with_host_prefix()
    assert host_problems(clean) == [] and lock_problems(clean, []) == []
    leaked = cache_with_host_prefix()
    leaked.host.free_list.take(1)  # a free host page taken off the free list and owned by nobody
    assert any("leaked" in p for p in host_problems(leaked))
    twice = cache_with_host_prefix()
    node = twice.nodes()[0]
    twice.host.free_list.push_unchecked(node.host_value[:1] // twice.host.page_size)  # a node's page also free
    assert any("owned twice" in p for p in host_problems(twice))
    lost = cache_with_host_prefix()
    node = lost.nodes()[0]
    lost.host.free(node.host_value)
    lost._host_used -= len(node.host_value)
    node.host_value = None  # on host with no host copy
    assert any("without a host copy" in p for p in host_problems(lost))
    counted = cache_with_host_prefix()
    counted._evictable += 8  # the host node's tokens counted as device-cached
    assert any("prefix cache sizes" in p for p in lock_problems(counted, []))
