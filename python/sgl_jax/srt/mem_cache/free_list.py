"""A free list of page ids: a FIFO queue in a ring buffer (host only), shared by the device KV allocator and the
host tier's pages.

Pages are taken at the head and given back at the tail, so `take` and `give` cost O(pages they move), not O(pool):
re-concatenating the list at every free took 20 ms per finished request in an 8.4M-page pool."""

from __future__ import annotations

from typing import Optional

import numpy as np

# Up to this many rows (a step's requests, a decode step's pages), the host's per-step bookkeeping writes scalars one
# by one instead of indexing numpy arrays with index arrays: numpy's index iterator costs more than a few scalar stores
# (issue #69). Read by `PageFreeList.take`, KVMemory's decode allocation and ScheduleBatch.build_decode_rows.
FEW_ROWS = 8


class PageFreeList:
    """Free page ids (int32), oldest free first, with a per-page free flag that catches a double free.

    Args:
        pages: int[n] the page ids free at the start, in the order they are handed out.
        id_limit: one past the largest page id the list may hold (the free flag's length).
        what: the pages' name in error messages ("KV page", "host KV page").
    """

    def __init__(self, pages: np.ndarray, id_limit: int, what: str = "page"):
        pages = np.asarray(pages, np.int32)
        self.what = what
        # free pages are _ring[(_head + i) % len(_ring)] for i < _count; one spare place for `push_unchecked`
        self._ring = np.zeros(len(pages) + 1, np.int32)
        self._ring[:len(pages)] = pages
        self._head, self._count = 0, len(pages)
        self._is_free = np.zeros(id_limit, bool)
        self._is_free[pages] = True

    def __len__(self) -> int:
        """Free pages."""
        return self._count

    def _span(self, start: int, n: int) -> np.ndarray:
        """Ring positions start, start + 1, ... (n of them, wrapping)."""
        return (start + np.arange(n, dtype=np.int64)) % len(self._ring)

    def ids(self) -> np.ndarray:
        """A copy of the free pages, head (next handed out) first: int32[len(self)] (for accounting checks)."""
        end = self._head + self._count
        if end <= len(self._ring):
            return self._ring[self._head:end].copy()
        return np.concatenate([self._ring[self._head:], self._ring[:end - len(self._ring)]])

    def take(self, n: int) -> Optional[np.ndarray]:
        """The n pages at the head (int32[n]), marked taken; None (nothing taken) when fewer than n are free."""
        if n > self._count:
            return None
        end = self._head + n
        if end <= len(self._ring):
            pages = self._ring[self._head:end].copy()
        else:
            pages = self._ring[self._span(self._head, n)]
        self._head, self._count = end % len(self._ring), self._count - n
        if n <= FEW_ROWS:  # (a decode step's few pages)
            for page in pages.tolist():
                self._is_free[page] = False
        else:
            self._is_free[pages] = False
        return pages

    def give(self, pages: np.ndarray) -> None:
        """Put taken pages back at the tail. Raises ValueError (naming `what`) on a page given twice or already free
        (nothing is given back then). The caller checks the ids' range."""
        pages = np.asarray(pages, np.int32)
        if len(np.unique(pages)) != len(pages) or self._is_free[pages].any():
            raise ValueError(f"{self.what} freed twice")
        self._is_free[pages] = True
        self.push_unchecked(pages)

    def push_unchecked(self, pages: np.ndarray) -> None:
        """Append pages at the tail without the double-free check or the free flags (`give`'s second half; a test's
        planted fault uses it alone). Raises ValueError when the ring has no room."""
        if self._count + len(pages) > len(self._ring):
            raise ValueError(f"{self.what} free list full")
        tail = (self._head + self._count) % len(self._ring)
        if tail + len(pages) <= len(self._ring):
            self._ring[tail:tail + len(pages)] = pages
        else:
            self._ring[self._span(tail, len(pages))] = pages
        self._count += len(pages)

    def last(self) -> Optional[np.ndarray]:
        """The tail page as int32[1] (None when empty)."""
        if not self._count:
            return None
        return self._ring[[(self._head + self._count - 1) % len(self._ring)]]
