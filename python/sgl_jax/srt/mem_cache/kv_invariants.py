"""Exact page-ownership check of one rank's KV pools (the strict accounting check, run after every step when
``SGL_JAX_CHECK_KV_INVARIANTS=1``; SGLang's ``SGLANG_CHECK_KV_PAGE_INVARIANTS`` plays the same role).

Every usable full page is owned exactly once: by the free list, by one prefix-cache node, or by one holder of
KV (a running or chunk-prefilled request, a scoring-cache handle, a streaming session between turns) through
positions [cache_protected_len, kv_allocated_len) of its ReqToTokenPool row. With hybrid SWA memory every SWA page is
either free or mapped from exactly one full page that is not free. Each holder also keeps
``cache_protected_len`` page-aligned and ``kv_committed_len <= kv_allocated_len``.
"""

from __future__ import annotations

from typing import Iterable, List

import numpy as np

from sgl_jax.srt.mem_cache.swa_allocator import SWAPagedAllocator


def cached_pages(tree_cache) -> np.ndarray:
    """Full pages held by a prefix cache's nodes (none for a cache without a tree, e.g. ChunkCache)."""
    nodes = getattr(tree_cache, "nodes", None)
    if nodes is None:
        return np.zeros(0, np.int32)
    ps = tree_cache.page_size
    vals = [np.asarray(n.value)[::ps] // ps for n in nodes()]
    return np.concatenate(vals).astype(np.int32) if vals else np.zeros(0, np.int32)


def check_kv_invariants(allocator, tree_cache, pool, holders: Iterable) -> List[str]:
    """The violated invariants (an empty list when the accounting is exact).

    Args:
        allocator: the rank's allocator; tree_cache: its prefix cache; pool: its ReqToTokenPool.
        holders: every object holding a row (running requests, scoring-cache handles, session holders:
            ``req_pool_idx``, ``cache_protected_len``, ``kv_committed_len``, ``kv_allocated_len``).
    """
    ps = allocator.page_size
    problems: List[str] = []
    owned = [allocator.free_page_ids(), cached_pages(tree_cache)]
    rows = set()
    for h in holders:
        if h.req_pool_idx is None:
            continue
        if h.req_pool_idx in rows:
            problems.append(f"request slot {h.req_pool_idx} held twice")
        rows.add(h.req_pool_idx)
        if h.cache_protected_len % ps:
            problems.append(f"{getattr(h, 'rid', h)}: cache_protected_len {h.cache_protected_len} is not a "
                            f"multiple of page_size {ps}")
        if not h.cache_protected_len <= h.kv_committed_len <= h.kv_allocated_len:
            problems.append(f"{getattr(h, 'rid', h)}: cache_protected_len {h.cache_protected_len}, "
                            f"kv_committed_len {h.kv_committed_len}, kv_allocated_len {h.kv_allocated_len} "
                            "out of order")
        start = -(-h.cache_protected_len // ps) * ps
        owned.append(pool.req_to_token[h.req_pool_idx, start:h.kv_allocated_len:ps] // ps)
    free_slots = set(pool._free)
    if rows & free_slots:
        problems.append(f"request slots {sorted(rows & free_slots)} are held and free")
    if len(free_slots) + len(rows) != pool.size:
        problems.append(f"request slots: {len(free_slots)} free + {len(rows)} held != {pool.size}")
    pages = np.concatenate(owned).astype(np.int64)
    counts = np.bincount(pages, minlength=allocator.num_pages + 1)[1:allocator.num_pages + 1]
    if len(pages) and (pages.min() < 1 or pages.max() > allocator.num_pages):
        problems.append("a page id outside [1, num_pages] is owned")
    if (counts > 1).any():
        problems.append(f"pages owned twice: {(np.nonzero(counts > 1)[0] + 1)[:8].tolist()}")
    if (counts == 0).any():
        problems.append(f"pages owned by nobody (leaked): {(np.nonzero(counts == 0)[0] + 1)[:8].tolist()}")
    if isinstance(allocator, SWAPagedAllocator):
        mapped = allocator.full_to_swa[1:]
        live = mapped[mapped > 0]
        swa_free = allocator.swa.free_page_ids()
        if len(np.unique(live)) != len(live):
            problems.append("an SWA page is mapped from two full pages")
        if np.intersect1d(live, swa_free).size:
            problems.append("an SWA page is mapped and free")
        if len(live) + len(swa_free) != allocator.swa.num_pages:
            problems.append(f"SWA pages: {len(live)} mapped + {len(swa_free)} free != {allocator.swa.num_pages}")
        full_free = allocator.free_page_ids()
        if (allocator.full_to_swa[full_free] > 0).any():
            problems.append("a free full page still maps an SWA page")
    return problems
