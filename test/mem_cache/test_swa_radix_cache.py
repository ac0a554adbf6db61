"""SWARadixCache on the hybrid pools: tombstones, usable matches, healing, the two evictions, window locks.
(The random-operation version of all of this is test_kv_lifecycle_properties.test_hybrid_swa_lifecycle.)"""

import numpy as np
import pytest

from sgl_jax.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sgl_jax.srt.mem_cache.swa_allocator import SWAPagedAllocator
from sgl_jax.srt.mem_cache.swa_radix_cache import SWARadixCache

PS, W = 4, 8


def make():
    alloc = SWAPagedAllocator(64 * PS, 32 * PS, PS)
    return alloc, SWARadixCache(ReqToTokenPool(4, 256), alloc, PS, W)


def cached(alloc, cache, tokens):
    """`tokens` inserted with fresh slots (both pools), as a finished request would leave them (its
    duplicates of an already cached prefix freed)."""
    slots = alloc.alloc_token_slots(np.zeros(len(tokens), np.int32), 0, len(tokens))
    cache.free_slots(slots[:cache.insert(np.asarray(tokens), slots)])


def tombstone_all_but_the_window(alloc, cache, toks):
    """Cache `toks`, then evict the SWA KV of everything outside the last window (a lock keeps that)."""
    cached(alloc, cache, toks)
    node = cache.match_prefix(toks).last_node
    cache.inc_lock_ref(node)
    cache.evict_swa(100)
    cache.dec_lock_ref(node)


def shape(cache, tokens):
    """(length, tombstone, full locks, SWA locks) of each node on the path of `tokens`."""
    return [(len(n.key), n.tombstone, n.lock_ref, n.swa_lock_ref)
            for n in cache._path(cache.match_prefix(tokens).last_node)]


def test_lock_protects_the_whole_path_but_only_the_window_of_swa():
    alloc, cache = make()
    toks = np.arange(32)
    cached(alloc, cache, toks)
    node = cache.match_prefix(toks).last_node
    assert cache.inc_lock_ref(node) == 32
    assert shape(cache, toks) == [(24, False, 1, 0), (8, False, 1, 1)]  # split at align_down(32 - W)
    assert (cache.protected_size(), cache.swa_protected_size(), cache.swa_evictable_size()) == (32, 8, 24)
    assert cache.evict(100) == 0  # everything full-locked
    assert cache.evict_swa(100) == 24  # outside the window: SWA only, the locked path stays
    assert shape(cache, toks) == [(24, True, 1, 0), (8, False, 1, 1)]
    assert alloc.swa_available_size() == alloc.swa_size - 8 and alloc.available_size() == alloc.size - 32
    cache.dec_lock_ref(node)
    assert (cache.protected_size(), cache.swa_protected_size(), cache.swa_evictable_size()) == (0, 0, 8)
    assert cache.evictable_size() == 32


def test_match_needs_live_swa_over_the_last_window():
    alloc, cache = make()
    toks = np.arange(32)
    tombstone_all_but_the_window(alloc, cache, toks)  # [0, 24) becomes a tombstone
    assert cache.match_prefix(toks).length == 32  # [24, 32) live: exactly W tokens
    assert cache.match_prefix(list(toks[:28]) + [99] * 8).length == 0  # only 4 live tokens before 28
    assert cache.match_prefix(toks[:20]).length == 0  # ends inside the tombstone
    for n in (4, 12, 20, 28, 32, 36):
        assert cache.prefix_match_len(toks[:n]) == cache.match_prefix(toks[:n]).length


def test_insert_heals_a_tombstone_with_the_callers_live_pages():
    alloc, cache = make()
    toks = np.arange(32)
    tombstone_all_but_the_window(alloc, cache, toks)
    swa_free = alloc.swa_available_size()
    dup = alloc.alloc_token_slots(np.zeros(32, np.int32), 0, 32)
    alloc.free_swa(alloc.pages_of(dup, 8))  # the caller's first two pages already lost their SWA KV
    assert cache.insert(toks, dup) == 32  # all cached: the caller keeps (and frees) its slots
    assert [(len(n.key), n.tombstone) for n in cache._path(cache.match_prefix(toks).last_node)] == \
        [(8, True), (16, False), (8, False)]
    cache.free_slots(dup)
    # the tombstone's [8, 24) took the caller's SWA pages; the caller's full pages went back
    assert alloc.swa_available_size() == swa_free - 16 + 0 and alloc.available_size() == alloc.size - 32
    assert cache.swa_evictable_size() == 24 and cache.match_prefix(toks[:20]).length == 20
    cache.reset()
    assert alloc.available_size() == alloc.size and alloc.swa_available_size() == alloc.swa_size


def test_evict_swa_deletes_unlocked_leaves_and_tombstones_internal_nodes():
    alloc, cache = make()
    cached(alloc, cache, np.arange(16))
    cached(alloc, cache, np.r_[np.arange(16), np.arange(100, 116)])  # a branch: [0,16) internal, two leaves
    cached(alloc, cache, np.r_[np.arange(16), np.arange(200, 208)])
    assert cache.evict_swa(100) == 16 + 16 + 8
    assert cache.nodes() == []  # leaves went from both pools, then the tombstone left as an unlocked leaf
    assert alloc.available_size() == alloc.size and alloc.swa_available_size() == alloc.swa_size


def test_full_eviction_frees_leaves_from_both_pools():
    alloc, cache = make()
    cached(alloc, cache, np.arange(16))
    assert cache.evict(1) == 16
    assert alloc.available_size() == alloc.size and alloc.swa_available_size() == alloc.swa_size
    assert cache.evictable_size() == cache.swa_evictable_size() == 0


def test_reset_refuses_while_locked():
    alloc, cache = make()
    cached(alloc, cache, np.arange(8))
    node = cache.match_prefix(np.arange(8)).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.dec_lock_ref(node)
    cache.reset()
    with pytest.raises(ValueError):
        SWARadixCache(ReqToTokenPool(1, 8), alloc, PS, 0)


def test_it_says_it_keeps_no_namespaces_and_refuses_one():
    """`keeps_namespaces` is what the scheduler asks before LoRA or a weight update with requests holding KV
    (scheduler.py, engine_control.py); it must match what the cache does with an adapter's namespace."""
    from sgl_jax.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sgl_jax.srt.mem_cache.radix_cache import RadixCache

    _, swa = make()
    assert not swa.keeps_namespaces
    with pytest.raises(ValueError, match="keeps no namespaces"):
        swa.match_prefix(np.arange(8), namespace=3)
    radix = RadixCache(ReqToTokenPool(4, 256), PagedTokenToKVPoolAllocator(64 * PS, PS), PS)
    assert radix.keeps_namespaces and radix.match_prefix(np.arange(8), namespace=3).device_indices.size == 0
