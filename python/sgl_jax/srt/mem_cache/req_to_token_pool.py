"""ReqToTokenPool: for each running request slot, the KV cache slot of every token position (host)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from sgl_jax.srt.mem_cache.req_state import ReqRowsPool, ReqStatePool

_NO_PAGES = np.zeros(0, np.int32)


class ReqToTokenPool:
    """A [size, max_context_len] int32 table on the host; row r lists the KV slots of request slot r.

    Slots are handed out and returned by `alloc` / `free`; only `release_kv_cache` frees a request's slot. A
    request slot takes one slot of every per-request state pool (`req_state.ReqStatePool`: a linear-attention
    layer's recurrent state...) with it and gives them back with it: ``state_slots[k, r]`` is request slot r's
    slot of pool k (-1 while r is free). A taken request slot may also hold pages of the per-request row pools
    (`req_state.ReqRowsPool`: a vision tower's embeddings), taken by `alloc_rows` and given back by `free_rows` or
    with the slot: ``row_pages[k][r]`` (int32 page ids) and ``row_counts[k, r]`` (rows).

    Args:
        size: number of request slots (concurrent requests).
        max_context_len: tokens per row.
        state_pools: the per-request state pools (none for a model whose state is all KV).
        row_pools: the per-request row pools (none for a model without variable-size state).
    """

    def __init__(self, size: int, max_context_len: int, state_pools: Sequence[ReqStatePool] = (),
                 row_pools: Sequence[ReqRowsPool] = ()):
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = np.zeros((size, max_context_len), dtype=np.int32)
        self._free: List[int] = list(range(size))
        self.state_pools = tuple(state_pools)
        self.state_slots = np.full((len(self.state_pools), size), -1, np.int32)
        self.row_pools = tuple(row_pools)
        self.row_pages: List[List[np.ndarray]] = [[_NO_PAGES] * size for _ in self.row_pools]
        self.row_counts = np.zeros((len(self.row_pools), size), np.int32)

    def available_size(self) -> int:
        return len(self._free)

    def free_slot_ids(self) -> List[int]:
        """A copy of the free request slots (for accounting checks)."""
        return list(self._free)

    def alloc(self) -> Optional[int]:
        """A free request slot, with a slot of every state pool, or None when either runs out (nothing is taken
        then)."""
        if not self._free:
            return None
        slots = _take_all([(pool.alloc, pool.free) for pool in self.state_pools])
        if slots is None:
            return None
        idx = self._free.pop()
        self.state_slots[:, idx] = slots
        return idx

    def free(self, idx: int) -> None:
        """Return slot `idx` and its state slots. Raises ValueError on a double free."""
        if idx in self._free:
            raise ValueError(f"ReqToTokenPool slot {idx} freed twice")
        self.free_rows(idx)
        for k, pool in enumerate(self.state_pools):
            pool.free(int(self.state_slots[k, idx]))
            self.state_slots[k, idx] = -1
        self._free.append(idx)

    def write(self, idx: int, start: int, locs: np.ndarray) -> None:
        """Record KV slots `locs` for positions [start, start + len(locs)) of request slot `idx`."""
        self.req_to_token[idx, start:start + len(locs)] = locs

    def alloc_rows(self, idx: int, rows_needed: Dict[str, int]) -> bool:
        """Give taken request slot `idx` the pages of ``rows_needed[name]`` rows of each row pool named there (pools
        it does not name: none). False, with nothing taken, when a pool has too few free pages. Raises ValueError
        when `idx` holds rows already or a name is no row pool's."""
        self.row_pages_needed(rows_needed)  # (the names checked)
        if self.row_counts[:, idx].any():
            raise ValueError(f"request slot {idx} holds rows already")
        wanted = [(k, pool, int(rows_needed.get(pool.name, 0))) for k, pool in enumerate(self.row_pools)]
        wanted = [(k, pool, rows) for k, pool, rows in wanted if rows > 0]
        pages = _take_all([(functools.partial(pool.alloc, rows), pool.free) for _, pool, rows in wanted])
        if pages is None:
            return False
        for (k, _, rows), taken in zip(wanted, pages):
            self.row_pages[k][idx], self.row_counts[k, idx] = taken, rows
        return True

    def row_pages_needed(self, rows_needed: Dict[str, int]) -> Dict[str, int]:
        """The pages ``rows_needed`` ({row pool name: rows}) takes in each row pool it names.

        Raises:
            ValueError: a name is no row pool's (the message names it and the pools there are)."""
        pools = {p.name: p.spec for p in self.row_pools}
        unknown = set(rows_needed) - set(pools)
        if unknown:
            raise ValueError(f"this model has no per-request rows named {', '.join(map(repr, sorted(unknown)))} "
                             f"(it has {sorted(pools)})")
        return {name: pools[name].pages(int(rows)) for name, rows in rows_needed.items()}

    def free_rows(self, idx: int) -> None:
        """Give back the row pages request slot `idx` holds (none: nothing to do)."""
        for k, pool in enumerate(self.row_pools):
            if self.row_counts[k, idx]:
                pool.free(self.row_pages[k][idx])
                self.row_pages[k][idx], self.row_counts[k, idx] = _NO_PAGES, 0

    def row_ids(self, k: int, idx: int) -> np.ndarray:
        """The device rows (int32[row_counts[k, idx]]) of request slot `idx` in row pool k, in order: row j is
        ``page[j // page_rows] * page_rows + j % page_rows`` (where its model writes and reads its j-th row)."""
        pr = self.row_pools[k].spec.page_rows
        n = int(self.row_counts[k, idx])
        j = np.arange(n, dtype=np.int32)
        return self.row_pages[k][idx][j // pr] * pr + j % pr


def _take_all(takes: Sequence[Tuple[Callable[[], Any], Callable[[Any], None]]]) -> Optional[list]:
    """Take from several pools, all or nothing: call each ``take`` in turn and return their results; when one
    returns None, give back what the ones before it took (each result to its ``give``) and return None."""
    got = []
    for take, give in takes:
        x = take()
        if x is None:
            for (_, give_back), y in zip(takes, got):
                give_back(y)
            return None
        got.append(x)
    return got
