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
        """Free the request's pages: every position from cache_protected_len (0, except for a scoring item
        that reads a scoring handle's query KV, which the handle owns)."""
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        start = req.cache_protected_len
        self.allocator.free_pages(self.allocator.pages_of(row[start:], req.kv_allocated_len - start))
        req.last_node = None

    def cache_unfinished_req(self, req) -> None:
        return None
