"""release_kv_cache: the one path that frees a request's KV cache and its ReqToTokenPool slot."""

from __future__ import annotations


def release_kv_cache(req, tree_cache, is_insert: bool = True) -> None:
    """Free everything `req` holds: its KV (handed to `tree_cache`, which keeps or frees it) and its slot.

    Used for finished, aborted and retracted requests alike. Idempotent: a second call is a no-op.

    Args:
        req: a `Req` with ``req_pool_idx`` and ``kv_allocated_len`` set by the scheduler.
        tree_cache: the prefix cache (`ChunkCache` or a radix cache).
        is_insert: let the cache keep the request's KV for reuse (False for retract).
    """
    if req.req_pool_idx is None:
        return
    if req.kv_allocated_len > 0:
        tree_cache.cache_finished_req(req, is_insert=is_insert)
    tree_cache.req_to_token_pool.free(req.req_pool_idx)
    req.req_pool_idx = None
    req.kv_allocated_len = 0
    req.kv_committed_len = 0
