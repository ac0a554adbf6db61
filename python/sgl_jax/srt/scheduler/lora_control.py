"""The scheduler's LoRA adapters (--enable-lora): which are loaded, which device slot each running request reads,
and /load_lora_adapter, /unload_lora_adapter.

- A request names its adapter (``lora_path``); it gets the adapter's uid when it arrives (`uid_of`: 400 for an
  adapter that is not loaded), which also keys its prefixes in the radix cache (`Req.cache_namespace`): one
  adapter's KV is never another's, nor the base model's.
- At admission (`SchedulerLora.place`, called by the admission policy) the adapter gets a device slot: the one it
  is in, a free one, or the least recently used slot no running request reads, whose weights are then written
  (model_executor/lora_weights.py). When every slot is busy with other adapters the request waits.
- A load reads the PEFT files and registers the adapter (past --max-loaded-loras the least recently used idle,
  unpinned one is evicted); nothing is written to the device until a request uses it, but its layers are checked
  against the model's at once (400). An unload answers 409 while requests that name the adapter are queued or
  running, or hold KV computed under it (clients retry once they finish). A load reads the files in the scheduler's
  loop: serving pauses for that long (tens of ms for a local rank-16 adapter of a 135M model; a hub download
  longer).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, List, Optional

from sgl_jax.srt.errors import RequestError
from sgl_jax.srt.io_struct import LoadLoRAAdapterReqInput, LoRAUpdateOutput, UnloadLoRAAdapterReqInput
from sgl_jax.srt.lora.peft_adapter import load_peft_adapter
from sgl_jax.srt.lora.registry import LoraRegistry, LoraShape, parse_lora_paths
from sgl_jax.srt.lora.slots import AdapterSlots

logger = logging.getLogger(__name__)


class SchedulerLora:
    """LoRA state of a scheduler.

    Args:
        shape: the compiled slot shape (`LoraShape`).
        max_loaded: --max-loaded-loras (None: no limit).
        writer: what writes adapters into device slots: ``write(slot, LoraAdapter) -> seconds`` and
            ``check(LoraAdapter)`` (ValueError when the model's layers do not fit it; `LoraSlotWriter`).
        drop_namespace: uid -> frees an unloaded adapter's cached prefixes on every rank (`KVMemory.drop_namespace`).
        live_reqs: () -> every request that needs its adapter: queued, running, being prefilled, or holding KV
            computed under it (a scoring-cache handle, a streaming session between turns), on every rank.
        running_reqs: () -> the requests that read their slot in the next step (running or being prefilled).
        download_dir: --download-dir (hub adapters' cache).
    """

    def __init__(self, shape: LoraShape, max_loaded: Optional[int], writer, live_reqs: Callable[[], Iterable],
                 running_reqs: Callable[[], Iterable], download_dir: Optional[str] = None,
                 drop_namespace: Callable[[int], int] = lambda uid: 0):
        self.registry = LoraRegistry(shape, max_loaded)
        self.slots = AdapterSlots(shape.slots)
        self.writer = writer
        self.live_reqs = live_reqs
        self.running_reqs = running_reqs
        self.drop_namespace = drop_namespace
        self.download_dir = download_dir
        self.num_slot_writes = 0
        self._known_uids: set = set()  # uids registered at the last load or unload
        self.last_slot_write_ms: Optional[float] = None

    def load_initial(self, lora_paths: Optional[List[str]]) -> None:
        """Load the --lora-paths adapters. Raises what `load` would answer with as an error (start-up fails)."""
        for ref in parse_lora_paths(lora_paths):
            out = self.load(LoadLoRAAdapterReqInput(ref.lora_name, ref.lora_path, ref.pinned))
            if not out.success:
                raise ValueError(f"--lora-paths {ref.lora_name}={ref.lora_path}: {out.error_message}")

    # ------------------------------------------------------------ requests
    def in_use(self, name: str) -> bool:
        """Whether a queued or running request names adapter `name`."""
        return any(getattr(r, "lora_name", None) == name for r in self.live_reqs())

    def uid_of(self, name: str) -> int:
        """The uid of loaded adapter `name` (marks it used). Raises RequestError (400) naming it otherwise."""
        try:
            return self.registry.get(name).uid
        except KeyError:
            raise RequestError(f"LoRA adapter {name!r} is not loaded; loaded adapters: "
                               f"{sorted(self.registry.adapters)}") from None

    def place(self, req, busy_reqs: Iterable) -> bool:
        """Give `req` (with an adapter) a device slot, writing the adapter's weights there if it is new to the
        slot; `busy_reqs`: the requests of this admission round so far (their slots are busy too). Returns False
        when every slot is read by running requests of other adapters.

        Raises:
            RequestError: the adapter was unloaded or evicted since the request arrived.
        """
        loaded = self.registry.adapters.get(req.lora_name)
        if loaded is None or loaded.uid != req.cache_namespace:
            raise RequestError(f"LoRA adapter {req.lora_name!r} was unloaded before the request ran")
        busy = {r.lora_slot for r in list(self.running_reqs()) + list(busy_reqs) if r is not req}
        slot, new = self.slots.place(loaded.uid, busy)
        if slot is None:
            return False
        if new:
            try:
                seconds = self.writer.write(slot, loaded.adapter)
            except Exception:
                self.slots.drop(loaded.uid)  # (the slot holds no adapter now: the next request writes it again)
                raise
            self.num_slot_writes += 1
            self.last_slot_write_ms = round(1000 * seconds, 3)
            logger.info("LoRA adapter %s written into slot %d in %.1f ms", req.lora_name, slot, 1000 * seconds)
        req.lora_slot = slot
        return True

    # ------------------------------------------------------------ control
    def load(self, msg: LoadLoRAAdapterReqInput) -> LoRAUpdateOutput:
        """/load_lora_adapter: read the adapter and register it (400 with the reason when it cannot be)."""
        t0 = time.perf_counter()
        try:
            if not msg.lora_name:
                raise ValueError("lora_name must not be empty")
            if msg.lora_name in self.registry.adapters:
                raise ValueError(f"LoRA adapter {msg.lora_name!r} is already loaded; unload it first")
            adapter = load_peft_adapter(msg.lora_name, msg.lora_path, cache_dir=self.download_dir)
            self.registry.shape.check(adapter)  # (rank and targets first: their messages name the flag)
            self.writer.check(adapter)
            loaded, evicted = self.registry.add(adapter, msg.pinned, self.in_use)
        except Exception as e:  # any unreadable or unfit adapter is a 400 naming why, never a missing answer
            return LoRAUpdateOutput(False, f"{type(e).__name__}: {e}" if not isinstance(e, (ValueError, OSError))
                                    else str(e), self.registry.paths(), 400)
        for name_uid in evicted:
            logger.info("LoRA adapter %s evicted (--max-loaded-loras %d reached)", name_uid, self.registry.capacity)
        self._drop_stale_slots()
        seconds = time.perf_counter() - t0
        logger.info("LoRA adapter %s loaded from %s (rank %d, %s) in %.2f s", msg.lora_name, msg.lora_path,
                    loaded.adapter.rank, ", ".join(loaded.adapter.targets), seconds)
        return LoRAUpdateOutput(True, None, self.registry.paths(), 200, load_seconds=seconds)

    def unload(self, msg: UnloadLoRAAdapterReqInput) -> LoRAUpdateOutput:
        """/unload_lora_adapter: 400 for an adapter that is not loaded, 409 while requests use it."""
        if msg.lora_name not in self.registry.adapters:
            return LoRAUpdateOutput(False, f"LoRA adapter {msg.lora_name!r} is not loaded; loaded adapters: "
                                    f"{sorted(self.registry.adapters)}", self.registry.paths(), 400)
        if self.in_use(msg.lora_name):
            return LoRAUpdateOutput(False, f"LoRA adapter {msg.lora_name!r} is in use by queued or running requests "
                                    "(or KV a scoring-cache handle or streaming session holds); unload it once they "
                                    "finish", self.registry.paths(), 409)
        self.registry.remove(msg.lora_name)
        self._drop_stale_slots()
        logger.info("LoRA adapter %s unloaded", msg.lora_name)
        return LoRAUpdateOutput(True, None, self.registry.paths(), 200)

    def _drop_stale_slots(self) -> None:
        """Free the slots of adapters no longer registered (their weights stay until the slot is reused; no
        request reads them) and their cached prefixes."""
        live = {a.uid for a in self.registry.adapters.values()}
        for uid in self._known_uids - live:
            self.slots.drop(uid)
            self.drop_namespace(uid)
        self._known_uids = live

    def state(self) -> dict:
        """The internal-state entries: loaded adapters, occupied slots (slot -> adapter), slot writes so far and
        the last one's host-side time in ms (dispatch of the device writes; the device runs them before the next
        step)."""
        names = {a.uid: n for n, a in self.registry.adapters.items()}
        return {"lora_adapters": sorted(self.registry.adapters),
                "lora_slots": {str(s): names.get(u) for s, u in self.slots.occupied()},
                "lora_slot_writes": self.num_slot_writes, "lora_last_slot_write_ms": self.last_slot_write_ms}


def lora_uid(lora: Optional[SchedulerLora], name: str) -> int:
    """The uid of loaded LoRA adapter `name` (its requests' prefix-cache namespace). Raises RequestError (400) for
    an adapter that is not loaded, or on a server without --enable-lora (`lora` None)."""
    if lora is None:
        raise RequestError("lora_path: this server has no LoRA adapters (start it with --enable-lora)")
    return lora.uid_of(name)


def update_lora(lora: Optional[SchedulerLora], msg) -> LoRAUpdateOutput:
    """/load_lora_adapter (a LoadLoRAAdapterReqInput) or /unload_lora_adapter: `lora`'s answer, or 400 without
    --enable-lora."""
    if lora is None:
        return LoRAUpdateOutput(False, "LoRA is not enabled; start the server with --enable-lora", None, 400)
    return lora.load(msg) if isinstance(msg, LoadLoRAAdapterReqInput) else lora.unload(msg)
