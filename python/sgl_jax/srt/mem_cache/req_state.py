"""Per-request state beyond KV: fixed-size device state that a request carries from step to step, one slot per
request in a pool of its own (a linear-attention layer's recurrent and convolution states: Qwen3-Next's Gated
DeltaNet; SGLang's ``MambaPool`` beside its ``HybridReqToTokenPool``).

A request takes a slot of every state pool when it takes its request slot (`ReqToTokenPool.alloc`) and gives
them back when that slot is freed, on the one release path (`common.release_kv_cache`). So a retracted request
computes its state again from its tokens, and a streaming session's turn, which keeps the session's row, keeps its
state. `KVMemory` reports each pool (``<name>_state_slots_total / _free / _in_use``) and checks that every slot
has one owner (the free list, or one held request slot: `kv_invariants.req_state_problems`).

This module holds the host bookkeeping only (JAX-free); the device buffers, [slots, ...] per pool, are the model
runner's, indexed by `ReqToTokenPool.state_slots`.
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
