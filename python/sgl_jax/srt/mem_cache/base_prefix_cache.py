"""The contract every prefix cache implements (RadixCache, ChunkCache).

- match_prefix(token_ids) -> MatchResult: the longest cached prefix (page-aligned) and its KV slots.
- prefix_match_len(token_ids) -> int: the length match_prefix would give, without touching the cache
  (no node split, no LRU update): what cache-aware DP rank assignment compares.
- cache_finished_req(req, is_insert): take over (insert) or free the request's KV; called only by
  `release_kv_cache`.
- cache_unfinished_req(req): make a still-running request's KV shareable (chunked prefill).
- inc_lock_ref / dec_lock_ref(node): protect / unprotect a matched path from eviction (returns the
  tokens that changed between evictable and protected).
- evict(num_tokens): free at least num_tokens of unlocked cached KV if possible.
- evictable_size(): tokens cached and unlocked; protected_size(): tokens cached and locked.
- reset(): drop everything cached (only when no request is running).

Accounting invariant (checked when idle): allocator free + evictable + protected == total.
"""

from __future__ import annotations

import abc
import dataclasses

import numpy as np


@dataclasses.dataclass
class MatchResult:
    """device_indices: int32[n] KV slots of the matched prefix; last_node: the cache node to lock."""

    device_indices: np.ndarray
    last_node: object = None

    @property
    def length(self) -> int:
        return len(self.device_indices)


class BasePrefixCache(abc.ABC):
    @abc.abstractmethod
    def match_prefix(self, token_ids) -> MatchResult: ...

    @abc.abstractmethod
    def cache_finished_req(self, req, is_insert: bool = True) -> None: ...

    @abc.abstractmethod
    def cache_unfinished_req(self, req) -> None: ...

    def prefix_match_len(self, token_ids) -> int:
        """Tokens of `token_ids` match_prefix would return, read-only (0: a cache that shares nothing)."""
        return 0

    def inc_lock_ref(self, node) -> int:
        """Protect node's path from eviction; returns tokens that moved from evictable to protected."""
        return 0

    def dec_lock_ref(self, node) -> int:
        """Undo one inc_lock_ref; returns tokens that became evictable again."""
        return 0

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        return None
