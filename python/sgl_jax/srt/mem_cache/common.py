"""The request-level KV operations every cache kind shares: allocation with eviction, and release."""

from __future__ import annotations

from typing import Optional

import numpy as np

from sgl_jax.srt.mem_cache.cache_manager import cache_finished_req
from sgl_jax.srt.mem_cache.swa_allocator import SWAPagedAllocator


def evict_for_pages(allocator, tree_cache, pages: int) -> bool:
    """Evict unlocked cached KV until `pages` new pages can be allocated (in both pools with hybrid SWA
    memory: full-pool eviction first, which frees SWA pages too, then SWA-only eviction for the rest).

    Returns: whether `pages` pages are available now.
    """
    ps, hybrid = allocator.page_size, isinstance(allocator, SWAPagedAllocator)
    full_free = allocator.full_available_pages() if hybrid else allocator.available_pages()
    if pages > full_free:
        tree_cache.evict((pages - full_free) * ps)
    if hybrid and pages > allocator.swa_available_pages() and tree_cache.keeps_swa:
        tree_cache.evict_swa((pages - allocator.swa_available_pages()) * ps)
    return pages <= allocator.available_pages()


def alloc_with_evict(allocator, tree_cache, row: np.ndarray, have: int, want: int) -> Optional[np.ndarray]:
    """KV slots for positions [have, want) of a sequence, evicting unlocked cached KV when pages run short.

    Returns None (nothing taken) if even eviction cannot free enough pages.
    """
    evict_for_pages(allocator, tree_cache, allocator.pages_needed(have, want))
    return allocator.alloc_token_slots(row, have, want)


def release_kv_cache(req, tree_cache, is_insert: bool = True) -> None:
    """Free everything `req` holds: its KV (handed to `tree_cache` by `cache_manager.cache_finished_req`,
    which lets the cache keep it or frees it), its prefix lock, its per-request rows, and its ReqToTokenPool slot
    (with its state slots). The only code
    path that does so -- for finished, aborted and retracted requests alike. A turn of a streaming session
    (``req.session_kv``) leaves its KV to the session instead (`session_kv.SessionKV.on_release`), and a
    session's KV is released here too when it closes.

    Idempotent: ``req.kv_released`` makes a second call a no-op.

    Args:
        req: a `Req` (``req_pool_idx``, ``kv_allocated_len``, ``kv_committed_len``, ``cache_protected_len``).
        tree_cache: the prefix cache (any `BasePrefixCache`; its ``req_to_token_pool`` holds the row).
        is_insert: let the cache keep the request's computed prefix for reuse (False for retract).
    """
    if req.kv_released or req.req_pool_idx is None:
        return
    tree_cache.req_to_token_pool.free_rows(req.req_pool_idx)  # (rows serve one turn: a session keeps none)
    session = getattr(req, "session_kv", None)
    if session is not None and session.on_release(req, tree_cache, is_insert):
        return  # a streaming session's turn: the session keeps the KV (or takes its row back)
    cache_finished_req(req, tree_cache, is_insert=is_insert)
    tree_cache.req_to_token_pool.free(req.req_pool_idx)
    req.req_pool_idx = None
    req.kv_allocated_len = req.kv_committed_len = req.cache_protected_len = req.swa_evicted_len = 0
    req.kv_released = True

