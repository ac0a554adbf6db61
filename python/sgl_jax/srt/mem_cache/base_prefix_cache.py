"""The contract every prefix cache implements (one class per cache kind: RadixCache, LFURadixCache, ChunkCache,
SWARadixCache, HiRadixCache).

A prefix cache maps token-id prefixes to the KV slots that hold their K/V. It deals in token ids and KV
slots only (int32 numpy arrays, lengths in tokens) and never reads a request: the Req-aware hand-off
(admission match, chunked-prefill insert, release) is `mem_cache/cache_manager.py`, one set of functions
for every cache kind, which calls nothing but the methods below.

- Every token-id argument comes with an optional ``namespace`` (a LoRA adapter's uid, None for the base model):
  prefixes are shared only within one namespace.
- match_prefix(token_ids) -> MatchResult: the longest cached, page-aligned prefix, its KV slots and the
  node handle to lock. May reorganize the cache (split a node, touch LRU times).
- prefix_match_len(token_ids) -> int: the length match_prefix would give, read-only (no node split, no
  LRU update): what cache-aware DP rank assignment compares.
- insert(token_ids, kv_slots) -> int: offer a page-aligned prefix and its slots; returns how many leading
  tokens' slots the cache did not take (already cached, or all of them for a cache that keeps nothing);
  the caller still owns, and frees, those.
- free_slots(kv_slots): give request-owned slots back to the pool(s) this cache allocates from.
- inc_lock_ref / dec_lock_ref(node): protect / unprotect a matched path from eviction (returns the tokens
  that moved between evictable and protected).
- evict(num_tokens) -> int: free at least num_tokens of unlocked cached KV if possible.
- evictable_size(): tokens cached and unlocked; protected_size(): tokens cached and locked.
- reset(): drop everything cached (only when no request holds a lock).
- retire(tag) -> list (optional; RadixCache): make everything cached unmatchable (new weights), moving what
  requests still lock into retired namespaces (`retired_namespace`) and returning their keys.
- load_back(token_ids) -> int (optional; HiRadixCache): copy the part of the prefix that a host tier keeps
  back to the device before `match_prefix` (returns the tokens loaded); `cache_manager.match_req` calls it.
- record_hit(node): a finished request reused the path to `node` (once per request; a no-op but for kinds that
  count frequency).
- create(req_to_token_pool, allocator, page_size, sliding_window): the factory the registry calls
  (`registry.CACHE_KINDS`); ``kind`` is the name it is listed under.
- keeps_swa: whether the cache also keeps SWA-pool KV (hybrid SWA memory); such a cache adds evict_swa,
  swa_evictable_size and swa_protected_size (SWARadixCache). The others hold full-pool pages only, so the SWA
  pool's cached share is 0 for them (`kv_memory.KVMemory` asks).
- page_size: tokens per KV page; matches and inserts are whole pages. req_to_token_pool: the request-slot
  table whose rows the hand-off reads (the cache itself never does).

Accounting invariant (checked when idle): allocator free + evictable + protected == total; while requests
run, their own positions [cache_protected_len, kv_allocated_len) make up the difference. With hybrid SWA
memory the same holds for the SWA pool with swa_evictable / swa_protected of a cache that keeps SWA KV (and the
requests' own pages that still hold SWA KV).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Optional, Sequence, Union

import numpy as np

from sgl_jax.srt.mem_cache.req_to_token_pool import ReqToTokenPool

TokenIds = Union[Sequence[int], np.ndarray]


def retired_namespace(tag, namespace):
    """The namespace key where `retire` moves the locked prefixes of `namespace` (a LoRA uid or None): no new
    request names it, so nothing in it is matched again but by the requests that computed it."""
    return ("retired", tag, namespace)


def is_retired(namespace) -> bool:
    """Whether `namespace` is a retired one (`retired_namespace`)."""
    return isinstance(namespace, tuple) and namespace[:1] == ("retired",)


def live_namespace(namespace):
    """The namespace a retired key came from (a retracted holder goes back to it); `namespace` itself otherwise."""
    return namespace[2] if is_retired(namespace) else namespace


class CacheNode:
    """Handle to a cached prefix: returned in `MatchResult.last_node`, passed back to `inc_lock_ref` /
    `dec_lock_ref`. Opaque outside its cache (RadixCache's `TreeNode` is one); None means "the empty
    prefix" (nothing to lock) for every cache kind."""

    __slots__ = ()


@dataclasses.dataclass
class MatchResult:
    """A matched prefix.

    Attributes:
        device_indices: int32[n] KV slots of the matched prefix (n a multiple of the page size).
        last_node: the handle whose path covers exactly the match (lock it to keep the slots), or None.
    """

    device_indices: np.ndarray
    last_node: Optional[CacheNode] = None

    @property
    def length(self) -> int:
        """Matched tokens."""
        return len(self.device_indices)


class BasePrefixCache(abc.ABC):
    """The prefix-cache contract (see the module docstring).

    Attributes (set by each subclass's constructor):
        page_size: tokens per KV page; every length the cache matches or inserts is a multiple of it.
        req_to_token_pool: the request-slot table of the requests this cache serves; only the hand-off
            (`cache_manager`) reads it.
    """

    page_size: int
    req_to_token_pool: ReqToTokenPool
    kind: str = ""  # its name in registry.CACHE_KINDS
    keeps_swa: bool = False
    # whether prefixes are kept apart by namespace (LoRA adapters) and `retire` keeps the locked ones in retired
    # namespaces; False: only the base namespace (swa_radix), so LoRA and a weight update with requests holding KV
    # are refused by the scheduler
    keeps_namespaces: bool = True

    @classmethod
    @abc.abstractmethod
    def create(cls, req_to_token_pool: ReqToTokenPool, allocator, page_size: int,
               sliding_window: Optional[int]) -> "BasePrefixCache":
        """Build the cache for a rank (the registry's factory).

        Raises:
            ValueError: this kind cannot serve `allocator` / `sliding_window`.
        """

    @abc.abstractmethod
    def match_prefix(self, token_ids: TokenIds, namespace: Optional[int] = None) -> MatchResult:
        """The longest cached prefix of `token_ids` (int32 token ids), truncated to whole pages.

        Args:
            token_ids: [L] token ids.
            namespace: prefixes are shared only within one namespace (a LoRA adapter's uid; None: the base
                model's), so one adapter's KV never serves another's request.
        Returns:
            MatchResult with int32[n] slots (n <= L, n % page_size == 0) and the node to lock (None when
            the cache keeps nothing). The match is not locked: call `inc_lock_ref` before any eviction.
        """

    @abc.abstractmethod
    def prefix_match_len(self, token_ids: TokenIds, namespace: Optional[int] = None) -> int:
        """Tokens `match_prefix(token_ids, namespace)` would match, without changing the cache (0: it shares nothing)."""

    @abc.abstractmethod
    def insert(self, token_ids: TokenIds, kv_slots: np.ndarray, namespace: Optional[int] = None) -> int:
        """Offer `token_ids` and the KV slots holding their K/V to the cache.

        Args:
            token_ids: [L] token ids, L a multiple of page_size.
            kv_slots: int32[L] KV slots of those tokens, owned by the caller.
            namespace: as `match_prefix`'s.
        Returns:
            k: the cache took ownership of ``kv_slots[k:]``; ``kv_slots[:k]`` stay the caller's (a prefix
            that was already cached, whose duplicate slots the caller frees, or all L for a cache that keeps
            nothing).
        Raises:
            AssertionError: lengths differ or L is not whole pages.
        """

    @abc.abstractmethod
    def free_slots(self, kv_slots: np.ndarray) -> None:
        """Return request-owned KV slots to the pool(s) this cache allocates from.

        Args:
            kv_slots: int32[n] slots of consecutive positions of one sequence, starting on a page boundary;
                every page they touch is freed (a partly used last page included).
        Raises:
            ValueError: a page is invalid or already free (from the allocator).
        """

    @abc.abstractmethod
    def inc_lock_ref(self, node: Optional[CacheNode]) -> int:
        """Protect the path to `node` from eviction (None: no-op).

        Returns: tokens that moved from evictable to protected.
        """

    @abc.abstractmethod
    def dec_lock_ref(self, node: Optional[CacheNode]) -> int:
        """Undo one `inc_lock_ref(node)` (None: no-op).

        Returns: tokens that moved from protected back to evictable.
        Raises:
            AssertionError: more unlocks than locks.
        """

    @abc.abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free unlocked cached KV, least recently used first, until `num_tokens` tokens are freed or
        nothing evictable is left.

        Returns: tokens freed (may exceed num_tokens by part of a node, or fall short).
        """

    @abc.abstractmethod
    def evictable_size(self) -> int:
        """Tokens cached and unlocked (the allocator can get them back by `evict`)."""

    @abc.abstractmethod
    def protected_size(self) -> int:
        """Tokens cached and locked by running requests."""

    def record_hit(self, node: Optional[CacheNode]) -> None:
        """A finished request reused the cached path root..`node` (called once per request by the hand-off,
        `cache_manager.cache_finished_req`, before it unlocks). Frequency-aware kinds count it (LFURadixCache);
        the others ignore it."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Free everything cached and start empty.

        Raises:
            RuntimeError: a request still holds a lock.
        """
