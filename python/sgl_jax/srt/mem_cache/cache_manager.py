"""The Req-aware hand-off between requests and a prefix cache, one set of functions for every cache kind.

Prefix caches (`base_prefix_cache.BasePrefixCache`) see only token ids and KV slots; these functions are
the only code that reads a request's KV fields on a cache's behalf and call nothing but the contract's
methods, so RadixCache, ChunkCache and any later cache kind share them.

Ownership of one request's row in the ReqToTokenPool: positions [0, cache_protected_len) belong to the
cache (locked through ``req.last_node``); positions [cache_protected_len, kv_allocated_len) belong to the
request until `cache_unfinished_req` / `cache_finished_req` hand them to the cache or free them.

Fields read: ``fill_ids``, ``req_pool_idx``, ``kv_committed_len``, ``kv_allocated_len``,
``cache_protected_len``, ``last_node``, ``cacheable_len``, ``fixed_prefix``, ``prefix_indices``,
``max_prefix_len()``, ``session_kv``, ``kv_private``, ``swa_keep``, ``swa_evicted_hi``. Fields written: ``last_node``, ``cache_protected_len`` (and the request's row).
"""

from __future__ import annotations

from typing import Optional, Tuple

from sgl_jax.srt.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult


def cacheable_len(req) -> int:
    """Positions of `req` whose KV may be shared: all computed ones, or fewer when the request says so
    (a packed multi-item sequence shares only its query; a scoring item shares nothing)."""
    limit = getattr(req, "cacheable_len", None)
    return req.kv_committed_len if limit is None else min(req.kv_committed_len, limit)


def namespace_of(req) -> Optional[int]:
    """The prefix-cache namespace of `req`'s KV: its LoRA adapter's uid (None: the base model)."""
    return getattr(req, "cache_namespace", None)


def match_req(req, tree_cache: BasePrefixCache) -> Tuple[MatchResult, int]:
    """Match and lock the cached prefix a waiting request may reuse.

    A prefill_extend item (``req.fixed_prefix``) reuses its scoring handle's query KV
    (``req.prefix_indices``), which the handle owns and keeps: nothing is matched or locked. A later turn
    of a streaming session (``req.session_kv`` holding KV) reuses the session's KV, which the session keeps
    locked: its prefix is the session's computed positions (`session_kv.SessionKV.prefix_len`); the row is
    lent to the request at admission (`ScheduleBatch.prepare_for_extend`). A cache with a host tier
    (``load_back``: HiRadixCache) first copies the part of the prefix it keeps on host back to the device, so
    the match covers it (loaded, not recomputed).

    Returns:
        (match, moved): the match, already locked (undo with ``tree_cache.dec_lock_ref(match.last_node)``
        if the request is not admitted), and the tokens the lock moved from evictable to protected.
    """
    if req.fixed_prefix:
        return MatchResult(req.prefix_indices, None), 0
    session = getattr(req, "session_kv", None)
    if session is not None and session.has_kv():  # a streaming session's turn: its own KV, already locked
        h = session.holder
        n = session.prefix_len(req)
        return MatchResult(tree_cache.req_to_token_pool.req_to_token[h.req_pool_idx, :n].copy(), None), 0
    key, namespace = req.fill_ids[:req.max_prefix_len()], namespace_of(req)
    load_back = getattr(tree_cache, "load_back", None)
    if load_back is not None:  # a host tier: the part of the prefix kept on host comes back to the device first
        load_back(key, namespace)
    match = tree_cache.match_prefix(key, namespace)
    return match, tree_cache.inc_lock_ref(match.last_node)


def _free_row_range(tree_cache: BasePrefixCache, row, start: int, end: int) -> None:
    """Free the request-owned pages covering positions [start, end) (start is page-aligned)."""
    if end > start:
        tree_cache.free_slots(row[start:end])


def cache_unfinished_req(req, tree_cache: BasePrefixCache) -> None:
    """Hand a running request's computed, page-aligned prefix to the cache (chunked prefill) and re-lock.

    Afterwards the row's positions [0, cache_protected_len) hold the cache's slots (the request's duplicates
    of an already cached part are freed) and the request keeps only its unaligned tail. A cache that keeps
    nothing (ChunkCache) leaves the request and its row as they were, and so does a streaming session's
    later turn (``req.kv_private``: its cached prefix stays turn 1's).

    Args:
        req: a running `Req` whose KV positions [0, kv_committed_len) are written.
        tree_cache: the request's prefix cache (its ``req_to_token_pool`` holds the request's row).
    """
    if getattr(req, "kv_private", False):
        return  # a streaming session's later turn: its KV stays the session's (session_kv.py)
    row = tree_cache.req_to_token_pool.req_to_token[req.req_pool_idx]
    protected = req.cache_protected_len
    n = cacheable_len(req) // tree_cache.page_size * tree_cache.page_size
    if n <= protected:
        return
    tokens = req.fill_ids[:n]
    existed = tree_cache.insert(tokens, row[:n], namespace_of(req))
    match = tree_cache.match_prefix(tokens, namespace_of(req))
    if match.length != n:  # the cache kept nothing: the request still owns all its positions
        assert match.length == 0 and existed == n, "the prefix cache kept part of an inserted prefix"
        return
    _free_row_range(tree_cache, row, protected, existed)  # duplicates of cached pages
    row[:n] = match.device_indices
    tree_cache.inc_lock_ref(match.last_node)
    tree_cache.dec_lock_ref(req.last_node)
    req.last_node = match.last_node
    req.cache_protected_len = n


def cache_finished_req(req, tree_cache: BasePrefixCache, is_insert: bool = True) -> None:
    """Hand a finished (or retracted, with is_insert=False) request's KV over to the cache.

    Its computed, page-aligned cacheable prefix is inserted; duplicates of already cached pages, the
    unaligned tail, over-allocated slots and whatever the cache did not take are freed; its lock is
    released. Positions below ``cache_protected_len`` are never freed here (the cache's, or a scoring
    handle's for a prefill_extend item). Called only by `common.release_kv_cache`, which then frees the
    request's ReqToTokenPool slot.

    Args:
        req: a `Req` holding a row (``req_pool_idx`` set).
        tree_cache: the request's prefix cache.
        is_insert: offer the computed prefix to the cache (False: free every request-owned position).
    """
    row = tree_cache.req_to_token_pool.req_to_token[req.req_pool_idx]
    protected = req.cache_protected_len
    if is_insert:
        n = max(cacheable_len(req) // tree_cache.page_size * tree_cache.page_size, protected)
        existed = tree_cache.insert(req.fill_ids[:n], row[:n], namespace_of(req)) if n > protected else n
        _free_row_range(tree_cache, row, protected, existed)
        _free_row_range(tree_cache, row, n, req.kv_allocated_len)
    else:
        _free_row_range(tree_cache, row, protected, req.kv_allocated_len)
    if is_insert:
        tree_cache.record_hit(req.last_node)  # (the prefix it reused; once per finished request)
    tree_cache.dec_lock_ref(req.last_node)
    req.last_node = None


def own_swa_pages(req, page_size: int) -> int:
    """SWA pages `req` owns now: its own KV pages (past the prefix cache's) not yet freed by SWA release
    (below ``swa_evicted_len``, and for a session's turn above its kept window up to ``swa_evicted_hi``)."""
    if req.req_pool_idx is None:
        return 0
    start = max(req.swa_evicted_len, -(-req.cache_protected_len // page_size) * page_size)
    keep = getattr(req, "swa_keep", None)
    freed_above = max(0, req.swa_evicted_hi - keep[1]) // page_size if keep else 0
    return max(0, -(-req.kv_allocated_len // page_size) - start // page_size - freed_above)


def release_swa_out_of_window(req, req_to_token_pool, allocator, window: int) -> int:
    """Free the SWA pages of `req`'s own KV that no future query of it can see (hybrid SWA memory).

    The next query is at position >= ``kv_committed_len`` and a sliding-window layer lets it see positions
    > query - window, so positions < kv_committed_len - window + 1 are dead for SWA layers. Whole pages below
    that, minus one page of slack, that the request owns (from ``cache_protected_len``; the prefix cache
    owns the rest) lose their SWA page; their full KV stays. Called after each step of a decoding or
    chunk-prefilled request (SGLang's ``_evict_swa``).

    Args:
        req: a running `Req` (``req_pool_idx``, ``kv_committed_len``, ``cache_protected_len``,
            ``swa_evicted_len``, updated here; a streaming session's turn: ``swa_keep`` = (lo, hi), page-aligned
            positions whose SWA KV stays -- the session's window, needed if the turn is aborted -- and
            ``swa_evicted_hi``, how far the pages from ``hi`` on are freed).
        req_to_token_pool: the request-slot table; allocator: a `SWAPagedAllocator`.
        window: the model's sliding window in tokens.
    Returns:
        SWA tokens freed.
    """
    ps = allocator.page_size
    dead = req.kv_committed_len - window + 1
    end = max(0, (dead // ps - 1) * ps)  # whole pages before the one holding `dead`, less one page of slack
    start = max(req.swa_evicted_len, -(-req.cache_protected_len // ps) * ps)
    if req.req_pool_idx is None:
        return 0
    row = req_to_token_pool.req_to_token[req.req_pool_idx]
    keep = getattr(req, "swa_keep", None)  # a session turn: pages [lo, hi) keep the session's window
    freed, below = 0, end if keep is None else min(end, keep[0])
    if below > start:
        freed += allocator.free_swa(allocator.pages_of(row[start:], below - start))
        req.swa_evicted_len = below
    if keep is not None:
        above = max(keep[1], req.swa_evicted_hi, start)
        if end > above:
            freed += allocator.free_swa(allocator.pages_of(row[above:], end - above))
            req.swa_evicted_hi = end
    return freed
