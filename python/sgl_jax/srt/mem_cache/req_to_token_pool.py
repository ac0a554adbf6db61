"""ReqToTokenPool: for each running request slot, the KV cache slot of every token position (host)."""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from sgl_jax.srt.mem_cache.req_state import ReqStatePool


class ReqToTokenPool:
    """A [size, max_context_len] int32 table on the host; row r lists the KV slots of request slot r.

    Slots are handed out and returned by `alloc` / `free`; only `release_kv_cache` frees a request's slot. A
    request slot takes one slot of every per-request state pool (`req_state.ReqStatePool`: a linear-attention
    layer's recurrent state...) with it and gives them back with it: ``state_slots[k, r]`` is request slot r's
    slot of pool k (-1 while r is free).

    Args:
        size: number of request slots (concurrent requests).
        max_context_len: tokens per row.
        state_pools: the per-request state pools (none for a model whose state is all KV).
    """

    def __init__(self, size: int, max_context_len: int, state_pools: Sequence[ReqStatePool] = ()):
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = np.zeros((size, max_context_len), dtype=np.int32)
        self._free: List[int] = list(range(size))
        self.state_pools = tuple(state_pools)
        self.state_slots = np.full((len(self.state_pools), size), -1, np.int32)

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> Optional[int]:
        """A free request slot, with a slot of every state pool, or None when either runs out (nothing is taken
        then)."""
        if not self._free:
            return None
        idx = self._free[-1]
        taken = []
        for k, pool in enumerate(self.state_pools):
            slot = pool.alloc()
            if slot is None:
                for j, s in taken:
                    self.state_pools[j].free(s)
                return None
            taken.append((k, slot))
        for k, slot in taken:
            self.state_slots[k, idx] = slot
        return self._free.pop()

    def free(self, idx: int) -> None:
        """Return slot `idx` and its state slots. Raises ValueError on a double free."""
        if idx in self._free:
            raise ValueError(f"ReqToTokenPool slot {idx} freed twice")
        for k, pool in enumerate(self.state_pools):
            pool.free(int(self.state_slots[k, idx]))
            self.state_slots[k, idx] = -1
        self._free.append(idx)

    def write(self, idx: int, start: int, locs: np.ndarray) -> None:
        """Record KV slots `locs` for positions [start, start + len(locs)) of request slot `idx`."""
        self.req_to_token[idx, start:start + len(locs)] = locs
