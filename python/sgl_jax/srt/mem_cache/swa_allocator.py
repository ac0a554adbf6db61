"""Hybrid KV allocator for sliding-window models: a full pool and a smaller SWA pool, paged alike (host).

Full-attention layers keep every token's KV; sliding-window (SWA) layers only need the last ``window``
tokens. The SWA layers therefore get their own KV buffers with fewer pages, and each full page that still
holds live SWA KV is mapped to one SWA page (``full_to_swa``). A sequence's ReqToTokenPool row keeps full
slots only; SWA layers read their page table through the mapping (`swa_page_table`, `swa_slots`).

A page is allocated in both pools at once (and given back to both if either runs short). Once a page's
tokens have left every query's window its SWA page can be freed alone (`free_swa`), leaving the full page
(the mapping then points at page 0, the padding sink, which attention never reads inside the window).

This is SGLang's `SWATokenToKVPoolAllocator` design, at page granularity.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from sgl_jax.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator


def split_hybrid_budget(total_tokens: int, num_full_layers: int, num_swa_layers: int, ratio: float,
                        page_size: int) -> tuple:
    """(full_tokens, swa_tokens) that fit the memory of one pool of `total_tokens` for every layer.

    The budget is ``total_tokens * num_layers`` token-layers of KV; the SWA pool holds ``ratio`` times the full
    pool's tokens (``--swa-full-tokens-ratio``, SGLang's split), so
    ``full * num_full_layers + full * ratio * num_swa_layers == total_tokens * num_layers``.
    Both are rounded down to whole pages.

    Raises:
        ValueError: ratio <= 0, or the budget leaves less than one page in either pool.
    """
    if ratio <= 0:
        raise ValueError(f"--swa-full-tokens-ratio must be > 0, got {ratio}")
    layers = num_full_layers + num_swa_layers
    full = int(total_tokens * layers / (num_full_layers + ratio * num_swa_layers))
    swa = int(full * ratio)
    full, swa = full // page_size * page_size, swa // page_size * page_size
    if min(full, swa) < page_size:
        raise ValueError(f"a KV budget of {total_tokens} tokens leaves {full} full and {swa} SWA tokens, less "
                         f"than one page ({page_size}); raise --max-total-tokens or --swa-full-tokens-ratio")
    return full, swa


class SWAPagedAllocator(PagedTokenToKVPoolAllocator):
    """The full pool (this allocator's own pages) plus an SWA pool and the page mapping between them.

    Page ids handed out and taken back are full-pool pages, so every caller that works with full slots
    (ReqToTokenPool rows, prefix caches) is unchanged; only SWA release and the SWA page table use the mapping.

    Args:
        full_tokens: usable full-pool capacity in tokens.
        swa_tokens: usable SWA-pool capacity in tokens.
        page_size: tokens per page (both pools).
    """

    def __init__(self, full_tokens: int, swa_tokens: int, page_size: int):
        super().__init__(full_tokens, page_size)
        self.swa = PagedTokenToKVPoolAllocator(swa_tokens, page_size)
        self.full_to_swa = np.zeros(self.num_pages + 1, np.int32)  # 0: no SWA page (or page 0 itself)

    # ---- sizes
    @property
    def swa_size(self) -> int:
        """Usable SWA capacity in tokens."""
        return self.swa.size

    def swa_available_size(self) -> int:
        """Free SWA capacity in tokens."""
        return self.swa.available_size()

    def swa_available_pages(self) -> int:
        return self.swa.available_pages()

    def available_pages(self) -> int:
        """Pages that can be allocated now: a new page needs one in each pool. (``available_size`` stays the
        full pool's free tokens; see swa_available_size.)"""
        return min(super().available_pages(), self.swa.available_pages())

    def full_available_pages(self) -> int:
        return super().available_pages()

    # ---- allocation
    def alloc_pages(self, n: int) -> Optional[np.ndarray]:
        """n full pages, each with a fresh SWA page mapped to it, or None (nothing taken) if either pool has
        fewer than n free."""
        if n > super().available_pages() or n > self.swa.available_pages():
            return None
        full = super().alloc_pages(n)
        self.full_to_swa[full] = self.swa.alloc_pages(n)
        return full

    def free_pages(self, pages: np.ndarray) -> None:
        """Free full pages and the SWA pages still mapped to them. Raises ValueError on a bad or double free."""
        pages = np.asarray(pages, dtype=np.int32)
        if pages.size == 0:
            return
        super().free_pages(pages)
        self.free_swa(pages)

    def free_swa(self, pages: np.ndarray) -> int:
        """Free only the SWA pages mapped to full `pages` (those already freed are skipped); returns the SWA
        tokens freed."""
        pages = np.asarray(pages, dtype=np.int32)
        if pages.size == 0:
            return 0
        swa = self.full_to_swa[pages]
        live = swa[swa > 0]
        self.swa.free_pages(live)
        self.full_to_swa[pages] = 0
        return len(live) * self.page_size

    def move_swa(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Move the SWA pages mapped to full pages `src` onto full pages `dst` (same length), which have none:
        used when a cached prefix whose SWA KV was evicted (`dst`) gets the SWA KV of a request's duplicate
        pages of the same tokens (`src`), which are then freed as full pages only.

        Raises:
            ValueError: lengths differ, a `src` page has no SWA page, or a `dst` page already has one.
        """
        src, dst = np.asarray(src, dtype=np.int32), np.asarray(dst, dtype=np.int32)
        if src.shape != dst.shape or not self.has_swa(src).all() or self.has_swa(dst).any():
            raise ValueError("move_swa needs equally many source pages with SWA pages and targets without")
        self.full_to_swa[dst] = self.full_to_swa[src]
        self.full_to_swa[src] = 0

    def has_swa(self, pages: np.ndarray) -> np.ndarray:
        """bool per full page: it still has its SWA page."""
        return self.full_to_swa[np.asarray(pages, dtype=np.int32)] > 0

    # ---- what SWA layers read
    def swa_page_table(self, page_indices: np.ndarray) -> np.ndarray:
        """Full page ids (any shape) -> the SWA page ids SWA layers read (0 where the SWA KV is gone)."""
        return self.full_to_swa[page_indices]

    def swa_slots(self, slots: np.ndarray) -> np.ndarray:
        """Full KV slots (any shape) -> SWA slots (page 0's slots where the page has no SWA page)."""
        ps = self.page_size
        return (self.full_to_swa[slots // ps] * ps + slots % ps).astype(np.int32)
