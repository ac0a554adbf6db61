"""The prefix-cache kinds, by name (mini-sglang's ``@register`` registry): each kind's module registers a factory
with `register_cache`; `KVMemory` builds its rank's cache with `create_prefix_cache`.

Kinds: "radix" (RadixCache, prefix sharing, LRU eviction), "lfu_radix" (LFURadixCache: LFU eviction), "swa_radix"
(SWARadixCache: radix over a full + SWA pool), "chunk" (ChunkCache: nothing shared, either pool layout). A new kind is a module with a `BasePrefixCache` subclass and
a `register_cache` line, plus its case in `cache_kind_for` (and the flag that selects it in server_args.py).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

# name -> factory(req_to_token_pool, allocator, page_size, sliding_window) -> BasePrefixCache
_FACTORIES: Dict[str, Callable] = {}


def register_cache(name: str):
    """Class decorator: register a prefix-cache kind under `name`. The class is built as
    ``cls.create(req_to_token_pool, allocator, page_size, sliding_window)`` (a classmethod of the contract).

    Raises:
        ValueError: `name` is taken.
    """
    def deco(cls):
        if name in _FACTORIES:
            raise ValueError(f"prefix cache kind {name!r} is registered twice")
        _FACTORIES[name] = cls.create
        cls.kind = name
        return cls
    return deco


def cache_kinds() -> Dict[str, Callable]:
    """The registered kinds (name -> factory); importing the cache modules registers them."""
    from sgl_jax.srt.mem_cache import chunk_cache, lfu_radix_cache, radix_cache, swa_radix_cache  # noqa: F401

    return dict(_FACTORIES)


def cache_kind_for(server_args, hybrid_swa: bool) -> str:
    """The kind a rank uses, from the flags (`server_args`: a ServerArgs, or anything with its cache fields):
    "chunk" with --disable-radix-cache, else "swa_radix" when the KV has a separate SWA pool (hybrid SWA memory),
    else "lfu_radix" with --radix-eviction-policy lfu, else "radix"."""
    if server_args.disable_radix_cache:
        return "chunk"
    if hybrid_swa:
        return "swa_radix"
    return "lfu_radix" if getattr(server_args, "radix_eviction_policy", "lru") == "lfu" else "radix"


def create_prefix_cache(kind: str, req_to_token_pool, allocator, page_size: int,
                        sliding_window: Optional[int] = None):
    """A new prefix cache of kind `kind` over a rank's request slots and allocator.

    Raises:
        ValueError: an unknown kind, or a kind that cannot serve this allocator (e.g. "swa_radix" without a
            hybrid allocator and a sliding window).
    """
    kinds = cache_kinds()
    if kind not in kinds:
        raise ValueError(f"unknown prefix cache kind {kind!r}; registered: {sorted(kinds)}")
    return kinds[kind](req_to_token_pool, allocator, page_size, sliding_window)
