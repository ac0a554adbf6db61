"""ChunkCache: the prefix cache used when radix caching is off -- nothing is shared or kept."""

from __future__ import annotations

import numpy as np

from sgl_jax.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult
from sgl_jax.srt.mem_cache.req_to_token_pool import ReqToTokenPool


class ChunkCache(BasePrefixCache):
    """Never matches a prefix; a finished request's pages go straight back to the allocator."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: PagedTokenToKVPoolAllocator):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator

    def match_prefix(self, token_ids) -> MatchResult:
        return MatchResult(device_indices=np.zeros((0,), np.int32))

    def cache_finished_req(self, req, is_insert: bool = True) -> None:
        """Free all the request's pages (it owns every position: cache_protected_len is always 0)."""
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        self.allocator.free_pages(self.allocator.pages_of(row, req.kv_allocated_len))
        req.last_node = None

    def cache_unfinished_req(self, req) -> None:
        return None
