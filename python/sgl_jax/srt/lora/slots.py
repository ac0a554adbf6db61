"""Device slots of LoRA adapters: which adapter's weights sit in which of the ``--max-loras-per-batch`` slots.

Pure bookkeeping (no JAX): the scheduler asks `AdapterSlots.place` for a slot when it admits a request with an
adapter, passing the slots its running requests use; an adapter already in a slot keeps it, else a free slot is
taken, else the least recently used slot that no running request uses is evicted (SGLang's LoRA memory pool with
``--lora-eviction-policy lru``). The caller writes the adapter's weights into a slot it is told is new.

Slot ids are 0..n-1; a token whose request has no adapter reads slot -1 (no update).
"""

from __future__ import annotations

import itertools
from typing import Dict, Iterable, List, Optional, Tuple


class AdapterSlots:
    """LRU table of `num_slots` device slots keyed by adapter uid (an id that changes on every load, so a
    reloaded adapter of the same name never finds the old weights).

    Args:
        num_slots: ``--max-loras-per-batch``.
    """

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.slot_of: Dict[int, int] = {}  # adapter uid -> slot
        self._used_at: Dict[int, int] = {}  # slot -> last use (a counter)
        self._clock = itertools.count(1)

    def place(self, uid: int, busy: Iterable[int]) -> Tuple[Optional[int], bool]:
        """The slot adapter `uid` runs in, with `busy` (slots running requests read) left alone.

        Returns:
            (slot, new): new is True when the slot must be (re)written with the adapter's weights; (None, False)
            when every slot is busy with other adapters (the request waits).
        """
        now = next(self._clock)
        if uid in self.slot_of:
            slot = self.slot_of[uid]
            self._used_at[slot] = now
            return slot, False
        busy = set(busy)
        owners = {s: u for u, s in self.slot_of.items()}
        free = [s for s in range(self.num_slots) if s not in owners]
        if free:
            slot = free[0]
        else:
            idle = [s for s in owners if s not in busy]
            if not idle:
                return None, False
            slot = min(idle, key=lambda s: self._used_at.get(s, 0))
            del self.slot_of[owners[slot]]
        self.slot_of[uid] = slot
        self._used_at[slot] = now
        return slot, True

    def drop(self, uid: int) -> Optional[int]:
        """Forget adapter `uid` (unloaded); returns the slot it had (now free), or None."""
        slot = self.slot_of.pop(uid, None)
        if slot is not None:
            self._used_at.pop(slot, None)
        return slot

    def occupied(self) -> List[Tuple[int, int]]:
        """(slot, uid) of every occupied slot, by slot."""
        return sorted((s, u) for u, s in self.slot_of.items())
