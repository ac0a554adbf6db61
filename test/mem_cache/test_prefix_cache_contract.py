"""The prefix-cache contract (base_prefix_cache.py) and the one Req-aware hand-off (cache_manager.py):
every cache kind implements the whole contract, no cache reads a request, and the same hand-off functions
drive RadixCache, ChunkCache and SWARadixCache (on the hybrid SWA pools)."""

import ast
import importlib
import inspect
import pkgutil

import numpy as np
import pytest

import sgl_jax.srt.mem_cache as mem_cache
from sgl_jax.srt.scheduler.schedule_batch import Req
from sgl_jax.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.base_prefix_cache import BasePrefixCache, CacheNode
from sgl_jax.srt.mem_cache.cache_manager import cache_unfinished_req, match_req
from sgl_jax.srt.mem_cache.chunk_cache import ChunkCache
from sgl_jax.srt.mem_cache.common import release_kv_cache
from sgl_jax.srt.mem_cache.hi_radix_cache import HiRadixCache, HostTier
from sgl_jax.srt.mem_cache.lfu_radix_cache import LFURadixCache
from sgl_jax.srt.mem_cache.radix_cache import RadixCache, TreeNode
from sgl_jax.srt.mem_cache.registry import CACHE_KINDS, cache_kind_for, create_prefix_cache
from sgl_jax.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sgl_jax.srt.mem_cache.swa_allocator import SWAPagedAllocator
from sgl_jax.srt.mem_cache.swa_radix_cache import SWARadixCache
from sgl_jax.srt.sampling.sampling_params import SamplingParams
from sgl_jax.srt.server_args import ServerArgs

CONTRACT = {"create", "match_prefix", "prefix_match_len", "insert", "free_slots", "inc_lock_ref", "dec_lock_ref",
            "evict", "evictable_size", "protected_size", "reset"}
SWA_METHODS = {"evict_swa", "swa_evictable_size", "swa_protected_size"}  # only a kind that keeps SWA KV has them
REQ_FIELDS = {"fill_ids", "req_pool_idx", "kv_committed_len", "kv_allocated_len", "cache_protected_len",
              "cacheable_len", "fixed_prefix", "prefix_indices", "kv_released"}


def make(kind, page_size):
    pool = ReqToTokenPool(4, 256)
    if kind == "swa_radix":  # window 8: the hand-off below keeps every request's window live
        alloc = SWAPagedAllocator(512, 256, page_size)
        return pool, alloc, SWARadixCache(pool, alloc, page_size, 8)
    alloc = PagedTokenToKVPoolAllocator(512, page_size)
    if kind == "hiradix":
        return pool, alloc, HiRadixCache.create(pool, alloc, page_size, host_tier=host_tier())
    cls = {"radix": RadixCache, "lfu_radix": LFURadixCache}.get(kind)
    cache = cls(pool, alloc, page_size) if cls is not None else ChunkCache(pool, alloc)
    return pool, alloc, cache


KINDS = ["radix", "lfu_radix", "chunk", "swa_radix", "hiradix"]


class SlotMover:
    """The host tier's copies (hi_radix_cache.KVMover) between two numpy arrays standing for the KV pools."""

    def __init__(self):
        self.device, self.host = np.zeros(520, np.int64), np.zeros(256, np.int64)

    def to_host(self, device_slots, host_slots):
        self.host[host_slots] = self.device[device_slots]

    def to_device(self, host_slots, device_slots):
        self.device[device_slots] = self.host[host_slots]


def host_tier() -> HostTier:
    return HostTier(256, SlotMover(), "write_through")


def test_every_contract_method_is_abstract_and_documented():
    assert BasePrefixCache.__abstractmethods__ == CONTRACT
    for name in CONTRACT:
        doc = inspect.getdoc(getattr(BasePrefixCache, name))
        assert doc and len(doc) > 20, name
    assert issubclass(TreeNode, CacheNode)


def test_kinds_come_from_the_registry():
    """Every kind is registered under its name and built by create_prefix_cache; the SWA methods exist exactly on
    the kinds that keep SWA KV; a kind that cannot serve a pool layout says so."""
    assert set(CACHE_KINDS) == set(KINDS)
    for kind in KINDS:
        pool, alloc, built = make(kind, 4)
        cache = create_prefix_cache(kind, pool, alloc, 4, 8, host_tier() if kind == "hiradix" else None)
        assert type(cache) is type(built) and cache.kind == kind
        assert all(hasattr(cache, m) for m in SWA_METHODS) == cache.keeps_swa == (kind == "swa_radix")
    flags = lambda disable, policy="lru": ServerArgs(disable_radix_cache=disable,  # noqa: E731
                                                     radix_eviction_policy=policy)
    assert cache_kind_for(flags(True), True) == "chunk" and cache_kind_for(flags(False), True) == "swa_radix"
    assert cache_kind_for(flags(False), False) == "radix"
    assert cache_kind_for(flags(False, "lfu"), False) == "lfu_radix"
    assert cache_kind_for(flags(False, "lfu"), True) == "swa_radix"  # (LFU is for one pool only)
    pool, alloc, _ = make("radix", 4)
    with pytest.raises(ValueError, match="hybrid SWA KV pool"):
        create_prefix_cache("swa_radix", pool, alloc, 4, 8)
    with pytest.raises(ValueError, match="unknown prefix cache kind 'lru'"):
        create_prefix_cache("lru", pool, alloc, 4, None)
    assert cache_kind_for(ServerArgs(enable_hierarchical_cache=True), False) == "hiradix"
    with pytest.raises(ValueError, match="needs a host tier"):
        create_prefix_cache("hiradix", pool, alloc, 4, None)
    with pytest.raises(ValueError, match="has no host tier"):
        create_prefix_cache("radix", pool, alloc, 4, None, host_tier())
    with pytest.raises(ValueError, match="hybrid SWA pool"):
        create_prefix_cache("hiradix", pool, SWAPagedAllocator(512, 256, 4), 4, 8, host_tier())


@pytest.mark.parametrize("kind", KINDS)
def test_every_cache_kind_implement_the_contract(kind):
    pool, alloc, cache = make(kind, 4)
    assert isinstance(cache, BasePrefixCache)
    assert cache.page_size == 4 and cache.req_to_token_pool is pool
    node = cache.match_prefix([1, 2, 3, 4, 5]).last_node
    assert node is None or isinstance(node, CacheNode)


def _cache_modules():
    for info in pkgutil.iter_modules(mem_cache.__path__):
        module = importlib.import_module(f"{mem_cache.__name__}.{info.name}")
        if any(inspect.isclass(v) and issubclass(v, BasePrefixCache) and v.__module__ == module.__name__
               for v in vars(module).values()):
            yield module


def test_no_prefix_cache_reads_a_request():
    """Only cache_manager (and release_kv_cache) touch a Req's KV fields; the caches see ids and slots."""
    modules = list(_cache_modules())
    assert {m.__name__.rsplit(".", 1)[1] for m in modules} >= {"base_prefix_cache", "radix_cache", "chunk_cache",
                                                               "swa_radix_cache"}
    for module in modules:
        tree = ast.parse(inspect.getsource(module))
        for node in ast.walk(tree):
            assert not (isinstance(node, ast.Attribute) and node.attr in REQ_FIELDS), (module.__name__, node.attr)
            assert not (isinstance(node, ast.Name) and node.id == "req"), module.__name__
            assert not (isinstance(node, ast.arg) and node.arg == "req"), module.__name__
            assert not (isinstance(node, ast.FunctionDef) and node.name.startswith("cache_")), module.__name__


def _admit(pool, alloc, cache, ids, committed):
    """A request admitted through `match_req`, its whole prompt allocated and `committed` positions written."""
    req = Req("r", ids, SamplingParams(max_new_tokens=4), eos_token_ids=[], seed=0)
    match, _ = match_req(req, cache)
    req.last_node = match.last_node
    req.req_pool_idx = pool.alloc()
    pool.write(req.req_pool_idx, 0, match.device_indices)
    req.cache_protected_len = match.length
    row = pool.req_to_token[req.req_pool_idx]
    pool.write(req.req_pool_idx, match.length, alloc.alloc_token_slots(row, match.length, len(ids)))
    req.kv_allocated_len, req.kv_committed_len = len(ids), committed
    return req


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("page_size", [1, 4])
def test_one_hand_off_drives_every_cache_kind(kind, page_size):
    pool, alloc, cache = make(kind, page_size)
    ids = list(range(40))
    req = _admit(pool, alloc, cache, ids, 22)  # a chunk of 22 computed
    row = pool.req_to_token[req.req_pool_idx]
    before = row.copy()
    cache_unfinished_req(req, cache)
    aligned = 22 // page_size * page_size
    if kind != "chunk":
        assert req.cache_protected_len == aligned and cache.protected_size() == aligned
        assert isinstance(req.last_node, TreeNode)
        np.testing.assert_array_equal(row[:aligned], cache.match_prefix(ids).device_indices)
    else:  # keeps nothing: the request and its row are untouched
        assert req.cache_protected_len == 0 and req.last_node is None
        np.testing.assert_array_equal(row, before)
    own = alloc.pages_needed(req.cache_protected_len, 40) * page_size
    assert alloc.available_size() + cache.evictable_size() + cache.protected_size() + own == alloc.size
    req.kv_committed_len = 40
    release_kv_cache(req, cache)
    assert cache.protected_size() == 0 and req.last_node is None
    assert alloc.available_size() + cache.evictable_size() == alloc.size
    assert cache.evictable_size() == (40 // page_size * page_size if kind != "chunk" else 0)
    second = _admit(pool, alloc, cache, ids + [1], 41)  # the prefix is shared only by the radix caches
    assert second.cache_protected_len == (40 // page_size * page_size if kind != "chunk" else 0)
    if kind == "swa_radix":  # the lock covers the whole path in the full pool, only the window in the SWA pool
        assert cache.protected_size() == 40 // page_size * page_size
        assert cache.swa_protected_size() == 40 // page_size * page_size - (40 // page_size * page_size - 8) \
            // page_size * page_size
    release_kv_cache(second, cache, is_insert=False)
    cache.reset()
    assert alloc.available_size() == alloc.size and pool.available_size() == pool.size
    if kind == "swa_radix":
        assert alloc.swa_available_size() == alloc.swa_size


@pytest.mark.parametrize("kind", KINDS)
def test_scoring_item_frees_only_its_own_pages(kind):
    """A prefill_extend item starts at its handle's query KV (cache_protected_len > 0, no lock): releasing
    it frees exactly the pages after that prefix, with either cache kind."""
    page_size = 4
    pool, alloc, cache = make(kind, page_size)
    handle = _admit(pool, alloc, cache, list(range(18)), 18)
    handle.cacheable_len = 0  # the handle owns its query's KV
    item = Req("item", list(range(18)) + [7] * 9, SamplingParams(max_new_tokens=0), eos_token_ids=[], seed=0)
    item.prefix_indices = pool.req_to_token[handle.req_pool_idx][:16].copy()
    item.fixed_prefix, item.cacheable_len = True, 0
    match, moved = match_req(item, cache)
    assert match.length == 16 and match.last_node is None and moved == 0
    item.req_pool_idx = pool.alloc()
    pool.write(item.req_pool_idx, 0, match.device_indices)
    item.cache_protected_len = 16
    row = pool.req_to_token[item.req_pool_idx]
    pool.write(item.req_pool_idx, 16, alloc.alloc_token_slots(row, 16, 27))
    item.kv_allocated_len = item.kv_committed_len = 27
    free_before = alloc.available_pages()
    release_kv_cache(item, cache)
    assert alloc.available_pages() == free_before + 3  # positions 16..26: three pages, the handle's stay
    assert cache.evictable_size() == cache.protected_size() == 0
    release_kv_cache(handle, cache)
    assert alloc.available_size() == alloc.size
