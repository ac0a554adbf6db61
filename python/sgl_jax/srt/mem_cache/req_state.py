"""Per-request state beyond KV, in two shapes:

- **state slots** (`ReqStatePool`): fixed-size device state that a request carries from step to step, one slot per
  request in a pool of its own (a linear-attention layer's recurrent and convolution states: Qwen3-Next's Gated
  DeltaNet; SGLang's ``MambaPool`` beside its ``HybridReqToTokenPool``);
- **rows** (`ReqRowsPool`): a variable number of rows per request, taken in pages of `ReqRowsSpec.page_rows` rows
  (a vision tower's embeddings of a request's image tokens, which its prefill chunks read: SGLang keeps them with
  the request's multimodal inputs until its prefill is done).

A request takes a slot of every state pool when it takes its request slot (`ReqToTokenPool.alloc`) and gives
them back when that slot is freed, on the one release path (`common.release_kv_cache`). So a retracted request
computes its state again from its tokens, and a streaming session's turn, which keeps the session's row, keeps its
state. `KVMemory` reports each pool (``<name>_state_slots_total / _free / _in_use``) and checks that every slot
has one owner (the free list, or one held request slot: `kv_invariants.req_state_problems`).

A request that needs rows (``Req.rows_needed``, rows per pool name) takes them when it takes its request slot for
an extend (`KVMemory.allocate_extend`; admission, `KVBudget.reserve`, only admits it when they are free) and gives
them back on the same release path, a streaming session's turn included (the next turn brings its own). `KVMemory`
reports each pool in pages (``<name>_pages_total / _free / _in_use``) and checks that every page has one owner
(`kv_invariants.req_row_problems`).

This module holds the host bookkeeping only (JAX-free); the device buffers, [slots, ...] or [pages x page_rows,
...] per pool, are the model runner's, indexed by `ReqToTokenPool.state_slots` and `ReqToTokenPool.row_ids`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from sgl_jax.srt.mem_cache.free_list import PageFreeList


@dataclasses.dataclass(frozen=True)
class ReqStateSpec:
    """One kind of per-request state: `name` (its accounting keys' prefix: "recurrent" gives
    ``recurrent_state_slots_total``) and `bytes_per_request`, its device bytes per request on one device (what the
    memory budget sets aside for each request slot). Models declare theirs as ``(name, bytes)`` pairs
    (``ModelConfig.req_states``)."""

    name: str
    bytes_per_request: int


class ReqStatePool:
    """The slots of one kind of per-request state on one rank.

    Args:
        spec: the state's `ReqStateSpec`.
        num_slots: slots (at least the rank's request slots: each running request holds one).
    """

    def __init__(self, spec: ReqStateSpec, num_slots: int):
        self.spec = spec
        self.size = num_slots
        self._free = PageFreeList(np.arange(num_slots, dtype=np.int32), num_slots, f"{spec.name} state slot")

    @property
    def name(self) -> str:
        return self.spec.name

    def available_size(self) -> int:
        """Free slots."""
        return len(self._free)

    def free_slot_ids(self) -> np.ndarray:
        """A copy of the free slots (int32), next handed out first (for accounting checks)."""
        return self._free.ids()

    def alloc(self) -> Optional[int]:
        """A free slot, or None when all are taken."""
        slots = self._free.take(1)
        return None if slots is None else int(slots[0])

    def free(self, slot: int) -> None:
        """Give `slot` back. Raises ValueError when it is free already."""
        self._free.give(np.array([slot], np.int32))

    def plant_leak(self) -> None:
        """Test hook (fault_injection.LEAK_STATE_ENV): take a free slot and drop it, as a release that forgot it
        would; the ownership checks must then report a slot owned by nobody."""
        self._free.take(1)


@dataclasses.dataclass(frozen=True)
class ReqRowsSpec:
    """One kind of variable-size per-request state: `name` (its accounting keys' prefix: "vision_embedding" gives
    ``vision_embedding_pages_total``), `bytes_per_row` (device bytes of one row on one device: hidden size x dtype
    bytes for an embedding), `rows_per_request` (the rows the memory budget sets aside per request slot on average;
    one request may take more while others take fewer) and `page_rows` (rows per page, the unit of ownership).
    Models declare theirs as ``(name, bytes_per_row, rows_per_request)`` (``ModelConfig.req_rows``)."""

    name: str
    bytes_per_row: int
    rows_per_request: int
    page_rows: int = 16

    def pages(self, rows: int) -> int:
        """Pages that hold `rows` rows."""
        return -(-rows // self.page_rows)


class ReqRowsPool:
    """The row pages of one kind of variable-size per-request state on one rank.

    Args:
        spec: the state's `ReqRowsSpec`.
        num_pages: pages in the pool (its device buffer has ``num_pages * spec.page_rows`` rows).
    """

    def __init__(self, spec: ReqRowsSpec, num_pages: int):
        self.spec = spec
        self.size = num_pages
        self._free = PageFreeList(np.arange(num_pages, dtype=np.int32), num_pages, f"{spec.name} page")

    @property
    def name(self) -> str:
        return self.spec.name

    def available_size(self) -> int:
        """Free pages."""
        return len(self._free)

    def free_page_ids(self) -> np.ndarray:
        """A copy of the free pages (int32), next handed out first (for accounting checks)."""
        return self._free.ids()

    def alloc(self, rows: int) -> Optional[np.ndarray]:
        """The pages (int32[spec.pages(rows)]) that hold `rows` rows, or None (nothing taken) when too few are
        free."""
        return self._free.take(self.spec.pages(rows))

    def free(self, pages: np.ndarray) -> None:
        """Give `pages` back. Raises ValueError when one is free already (nothing is given back then)."""
        self._free.give(pages)

    def plant_leak(self) -> None:
        """Test hook (fault_injection.LEAK_ROWS_ENV): take a free page and drop it, as a release that forgot it
        would; the ownership checks must then report a page owned by nobody."""
        self._free.take(1)


def reserve_bytes(req_states, req_rows, num_request_slots: int) -> int:
    """Device bytes on one device that the per-request state of `num_request_slots` request slots takes, set aside
    before the KV pool is sized: a slot per request slot of each state (`req_states`: (name, bytes per request)
    pairs) and ``rows_per_request`` rows, in whole pages, per request slot of each row pool (`req_rows`: (name,
    bytes per row, rows per request) triples; ``ModelConfig.req_states / req_rows``)."""
    total = sum(int(size) for _, size in req_states) * num_request_slots
    for name, size, rows in req_rows:
        spec = ReqRowsSpec(name, int(size), int(rows))
        total += spec.pages(spec.rows_per_request) * spec.page_rows * spec.bytes_per_row * num_request_slots
    return total
