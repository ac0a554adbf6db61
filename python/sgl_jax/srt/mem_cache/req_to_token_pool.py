"""ReqToTokenPool: for each running request slot, the KV cache slot of every token position (host)."""

from __future__ import annotations

from typing import List, Optional

import numpy as np


class ReqToTokenPool:
    """A [size, max_context_len] int32 table on the host; row r lists the KV slots of request slot r.

    Slots are handed out and returned by `alloc` / `free`; only `release_kv_cache` frees a request's slot.

    Args:
        size: number of request slots (concurrent requests).
        max_context_len: tokens per row.
    """

    def __init__(self, size: int, max_context_len: int):
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = np.zeros((size, max_context_len), dtype=np.int32)
        self._free: List[int] = list(range(size))

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> Optional[int]:
        """A free request slot, or None when all are taken."""
        return self._free.pop() if self._free else None

    def free(self, idx: int) -> None:
        """Return slot `idx`. Raises ValueError on a double free."""
        if idx in self._free:
            raise ValueError(f"ReqToTokenPool slot {idx} freed twice")
        self._free.append(idx)

    def write(self, idx: int, start: int, locs: np.ndarray) -> None:
        """Record KV slots `locs` for positions [start, start + len(locs)) of request slot `idx`."""
        self.req_to_token[idx, start:start + len(locs)] = locs
