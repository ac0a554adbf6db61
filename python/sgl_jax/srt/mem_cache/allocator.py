"""Paged KV slot allocator: a free list of pages; a token's slot is page * page_size + offset (host)."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from sgl_jax.srt.mem_cache.free_list import PageFreeList


class PagedTokenToKVPoolAllocator:
    """Hands out KV pages of `page_size` token slots.

    Page 0 is reserved: padding tokens of a bucketed batch write their K/V there and nothing reads it, so
    usable pages are 1..num_pages and the device buffers hold num_pages + 1 pages.

    Args:
        num_tokens: usable KV capacity in tokens (rounded down to whole pages).
        page_size: tokens per page.
    """

    def __init__(self, num_tokens: int, page_size: int):
        if num_tokens < page_size:
            raise ValueError(f"KV pool of {num_tokens} tokens is smaller than one page ({page_size})")
        self.page_size = page_size
        self.num_pages = num_tokens // page_size
        self._free = PageFreeList(np.arange(1, self.num_pages + 1, dtype=np.int32), self.num_pages + 1, "KV page")

    @property
    def size(self) -> int:
        """Usable capacity in tokens."""
        return self.num_pages * self.page_size

    def available_size(self) -> int:
        """Free capacity in tokens."""
        return len(self._free) * self.page_size

    def available_pages(self) -> int:
        return len(self._free)

    def free_page_ids(self) -> np.ndarray:
        """A copy of the free list, head first (for accounting checks)."""
        return self._free.ids()

    def alloc_pages(self, n: int) -> Optional[np.ndarray]:
        """n free pages (int32[n], the longest free first), or None if fewer are free (nothing is taken then)."""
        return self._free.take(n)

    def free_pages(self, pages: np.ndarray) -> None:
        """Return pages to the free list (at its tail). Raises ValueError on page 0, out-of-range, or double free."""
        pages = np.asarray(pages, dtype=np.int32)
        if pages.size == 0:
            return
        if pages.min() < 1 or pages.max() > self.num_pages:
            raise ValueError(f"freeing invalid KV pages {pages[(pages < 1) | (pages > self.num_pages)][:5]}")
        self._free.give(pages)

    def plant_double_free(self) -> None:
        """Test hook (fault_injection.DOUBLE_FREE_ENV): put the last free page on the free list once more, as a
        double free that got past `free_pages` would; the ownership checks must then report a page owned twice."""
        last = self._free.last()
        if last is not None:
            self._free.push_unchecked(last)

    def pages_needed(self, have_tokens: int, want_tokens: int) -> int:
        """New pages to grow a sequence's KV from have_tokens to want_tokens slots."""
        ps = self.page_size
        return max(0, math.ceil(want_tokens / ps) - math.ceil(have_tokens / ps))

    def alloc_token_slots(self, row: np.ndarray, have_tokens: int, want_tokens: int) -> Optional[np.ndarray]:
        """Slots for positions [have_tokens, want_tokens) of one sequence.

        Args:
            row: the sequence's ReqToTokenPool row (slots of positions < have_tokens are valid); a partly
                filled last page is continued before new pages are taken.
        Returns:
            int32[want_tokens - have_tokens] slots, or None when pages ran out (nothing taken then).
        """
        ps = self.page_size
        new_pages = self.alloc_pages(self.pages_needed(have_tokens, want_tokens))
        if new_pages is None:
            return None
        positions = np.arange(have_tokens, want_tokens, dtype=np.int64)
        have_pages = math.ceil(have_tokens / ps)
        page_idx = positions // ps
        if have_pages > 0:
            last_page = int(row[(have_pages - 1) * ps]) // ps
            pages = np.where(page_idx < have_pages, last_page, new_pages[np.maximum(page_idx - have_pages, 0)]
                             if len(new_pages) else last_page)
        else:
            pages = new_pages[page_idx]
        return (pages * ps + positions % ps).astype(np.int32)

    def alloc_decode_slots(self, prev_slots: np.ndarray, positions: np.ndarray,
                           starts_page: Optional[np.ndarray] = None) -> Optional[np.ndarray]:
        """One slot each for n sequences growing by one token (a decode step), in one call.

        Args:
            prev_slots: int32[n] each sequence's slot of position ``positions - 1`` (read only where that
                position shares the new one's page, i.e. ``positions % page_size != 0``).
            positions: int[n] the new token's position in each sequence.
            starts_page: bool[n] ``positions % page_size == 0`` when the caller has it.
        Returns:
            int32[n] slots, the same as `alloc_token_slots(row, p, p + 1)` per sequence gives; or None when pages
            ran out (nothing taken then).
        """
        ps = self.page_size
        if starts_page is None:
            starts_page = np.asarray(positions, np.int64) % ps == 0
        pages = self.alloc_pages(int(starts_page.sum()))
        if pages is None:
            return None
        slots = np.asarray(prev_slots, np.int64) + 1
        slots[starts_page] = pages.astype(np.int64) * ps
        return slots.astype(np.int32)

    def pages_of(self, row: np.ndarray, num_tokens: int) -> np.ndarray:
        """Pages holding positions [0, num_tokens) of a sequence's row (one entry per page)."""
        ps = self.page_size
        return (row[0:num_tokens:ps] // ps).astype(np.int32)
