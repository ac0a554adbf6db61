"""ChunkCache: the prefix cache used when radix caching is off -- nothing is shared or kept.

With hybrid SWA memory (`SWAPagedAllocator`) it is also the SWA cache for --disable-radix-cache: a request's
pages are freed from both pools (`free_slots`; a page whose SWA KV was already released loses only its full
page), and a running request's SWA KV that left the window is released by
`cache_manager.release_swa_out_of_window` (SGLang's ``SWAChunkCache``)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from sgl_jax.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.base_prefix_cache import BasePrefixCache, CacheNode, MatchResult, TokenIds
from sgl_jax.srt.mem_cache.req_to_token_pool import ReqToTokenPool


class ChunkCache(BasePrefixCache):
    """Never matches a prefix and keeps nothing inserted: a finished request's pages go straight back to
    the allocator (through `cache_manager.cache_finished_req`). Its node handle is always None.

    Args:
        req_to_token_pool: the request-slot table.
        allocator: the KV page allocator (request pages are freed to it); its page size is the cache's.
    """

    kind = "chunk"

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: PagedTokenToKVPoolAllocator):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = allocator.page_size

    @classmethod
    def create(cls, req_to_token_pool: ReqToTokenPool, allocator, page_size: int,
               sliding_window: Optional[int] = None) -> "ChunkCache":
        """Either pool layout; the page size is the allocator's."""
        return cls(req_to_token_pool, allocator)

    def match_prefix(self, token_ids: TokenIds, namespace: Optional[int] = None) -> MatchResult:
        """Always the empty match (no slots, no node)."""
        return MatchResult(device_indices=np.zeros((0,), np.int32))

    def prefix_match_len(self, token_ids: TokenIds, namespace: Optional[int] = None) -> int:
        """Always 0: nothing is shared."""
        return 0

    def insert(self, token_ids: TokenIds, kv_slots: np.ndarray, namespace: Optional[int] = None) -> int:
        """Keeps nothing: returns len(token_ids), so every slot stays the caller's to free."""
        assert len(token_ids) == len(kv_slots) and len(token_ids) % self.page_size == 0
        return len(token_ids)

    def free_slots(self, kv_slots: np.ndarray) -> None:
        """Return request-owned slots (consecutive positions from a page boundary) to the allocator."""
        self.allocator.free_pages(self.allocator.pages_of(kv_slots, len(kv_slots)))

    def inc_lock_ref(self, node: Optional[CacheNode]) -> int:
        """Nothing to protect: returns 0."""
        return 0

    def dec_lock_ref(self, node: Optional[CacheNode]) -> int:
        """Nothing to unprotect: returns 0."""
        return 0

    def evict(self, num_tokens: int) -> int:
        """Nothing cached: returns 0."""
        return 0

    def evictable_size(self) -> int:
        """Always 0."""
        return 0

    def protected_size(self) -> int:
        """Always 0."""
        return 0

    def reset(self) -> None:
        """Nothing to drop."""
        return None
