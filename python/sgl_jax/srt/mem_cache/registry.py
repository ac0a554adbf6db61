"""The prefix-cache kinds, by name: one table (`CACHE_KINDS`, mini-sglang's registry as plain data) from which
`KVMemory` builds its rank's cache with `create_prefix_cache`.

Kinds: "radix" (RadixCache, prefix sharing, LRU eviction), "lfu_radix" (LFURadixCache: LFU eviction), "swa_radix"
(SWARadixCache: radix over a full + SWA pool), "hiradix" (HiRadixCache: radix with a host-memory tier for evicted
prefixes), "chunk" (ChunkCache: nothing shared, either pool layout). A new kind
is a module with a `BasePrefixCache` subclass (its ``kind`` the name), its row in `CACHE_KINDS` and its case in
`cache_kind_for`, plus the flag that selects it in server_args.py.
"""

from __future__ import annotations

from typing import Dict, Optional, Type

from sgl_jax.srt.mem_cache.base_prefix_cache import BasePrefixCache
from sgl_jax.srt.mem_cache.chunk_cache import ChunkCache
from sgl_jax.srt.mem_cache.hi_radix_cache import HiRadixCache, HostTier
from sgl_jax.srt.mem_cache.lfu_radix_cache import LFURadixCache
from sgl_jax.srt.mem_cache.radix_cache import RadixCache
from sgl_jax.srt.mem_cache.swa_radix_cache import SWARadixCache

# name -> class; each is built as ``cls.create(req_to_token_pool, allocator, page_size, sliding_window)``
CACHE_KINDS: Dict[str, Type[BasePrefixCache]] = {
    cls.kind: cls for cls in (RadixCache, LFURadixCache, SWARadixCache, HiRadixCache, ChunkCache)}


def cache_kind_for(server_args, hybrid_swa: bool) -> str:
    """The kind a rank uses, from the flags (`server_args`: a ServerArgs, or anything with its cache fields):
    "chunk" with --disable-radix-cache, else "hiradix" with --enable-hierarchical-cache (its KV is one pool:
    `kv_memory.kv_spec_for`), else "swa_radix" when the KV has a separate SWA pool (hybrid SWA memory), else
    "lfu_radix" with --radix-eviction-policy lfu, else "radix"."""
    if server_args.disable_radix_cache:
        return "chunk"
    if getattr(server_args, "enable_hierarchical_cache", False):
        return "hiradix"
    if hybrid_swa:
        return "swa_radix"
    return "lfu_radix" if getattr(server_args, "radix_eviction_policy", "lru") == "lfu" else "radix"


def create_prefix_cache(kind: str, req_to_token_pool, allocator, page_size: int,
                        sliding_window: Optional[int] = None, host_tier: Optional[HostTier] = None) -> BasePrefixCache:
    """A new prefix cache of kind `kind` over a rank's request slots and allocator (and, for "hiradix", the
    rank's host tier; the other kinds keep nothing on the host and take none).

    Raises:
        ValueError: an unknown kind, a kind that cannot serve this allocator (e.g. "swa_radix" without a hybrid
            allocator and a sliding window), "hiradix" without a host tier, or a host tier for another kind.
    """
    if kind not in CACHE_KINDS:
        raise ValueError(f"unknown prefix cache kind {kind!r}; registered: {sorted(CACHE_KINDS)}")
    if kind == HiRadixCache.kind:
        return HiRadixCache.create(req_to_token_pool, allocator, page_size, sliding_window, host_tier)
    if host_tier is not None:
        raise ValueError(f"the {kind!r} prefix cache has no host tier")
    return CACHE_KINDS[kind].create(req_to_token_pool, allocator, page_size, sliding_window)
