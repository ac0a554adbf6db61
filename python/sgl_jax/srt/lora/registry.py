"""The loaded LoRA adapters of a server (host side): names, where they came from, their weights, and
``--max-loaded-loras``.

`LoraRegistry` is pure bookkeeping over `LoraAdapter`s (peft_adapter.py): adding checks an adapter against the
slot shape the server compiled (`LoraShape`: rank and targets), and when the registry is full the least recently
used adapter that no request uses and that is not pinned is evicted to make room (SGLang's behaviour past
``--max-loaded-loras``). `parse_lora_paths` reads ``--lora-paths``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from sgl_jax.srt.lora.peft_adapter import LoraAdapter


@dataclasses.dataclass(frozen=True)
class LoraRef:
    """An adapter named on the command line or in /load_lora_adapter: ``lora_name``, ``lora_path`` (a directory
    or a hub id) and ``pinned`` (never evicted to make room; SGLang's LoRARef)."""

    lora_name: str
    lora_path: str
    pinned: bool = False


def parse_lora_paths(entries: Optional[Sequence[str]]) -> List[LoraRef]:
    """``--lora-paths`` entries in SGLang's three forms: ``name=path``, a bare ``path`` (named by itself), or a
    JSON object ``{"lora_name": ..., "lora_path": ..., "pinned": ...}``.

    Raises:
        ValueError: an empty name or path, a malformed JSON entry, or a name given twice (each named).
    """
    refs: List[LoraRef] = []
    for entry in entries or ():
        entry = str(entry).strip()
        if entry.startswith("{"):
            try:
                obj = json.loads(entry)
                ref = LoraRef(str(obj["lora_name"]), str(obj["lora_path"]), bool(obj.get("pinned", False)))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-paths: {entry!r} is not a JSON object with lora_name and lora_path ({e})")
        elif "=" in entry:
            name, path = entry.split("=", 1)
            ref = LoraRef(name.strip(), path.strip())
        else:
            ref = LoraRef(entry, entry)
        if not ref.lora_name or not ref.lora_path:
            raise ValueError(f"--lora-paths: {entry!r} needs a name and a path (name=path)")
        if any(r.lora_name == ref.lora_name for r in refs):
            raise ValueError(f"--lora-paths: the name {ref.lora_name!r} is given twice")
        refs.append(ref)
    return refs


@dataclasses.dataclass(frozen=True)
class LoraShape:
    """The compiled shape of the adapter slots: `slots` (``--max-loras-per-batch``), `rank` (``--max-lora-rank``:
    every slot is padded to it) and `targets` (the `LORA_MODULES` the layers carry slots for)."""

    slots: int
    rank: int
    targets: Tuple[str, ...]

    def check(self, adapter: LoraAdapter) -> None:
        """Raises ValueError naming why `adapter` does not fit the slots: a larger rank or another target."""
        if adapter.rank > self.rank:
            raise ValueError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, more than --max-lora-rank "
                             f"{self.rank}")
        extra = [t for t in adapter.targets if t not in self.targets]
        if extra:
            raise ValueError(f"LoRA adapter {adapter.name!r} targets {extra}, which --lora-target-modules "
                             f"{list(self.targets)} does not include")


@dataclasses.dataclass
class Loaded:
    """A registered adapter: its weights, its uid (new on every load), whether it is pinned."""

    adapter: LoraAdapter
    uid: int
    pinned: bool = False


class LoraRegistry:
    """The adapters a server has loaded, at most `capacity` (``--max-loaded-loras``; None: no limit).

    Args:
        shape: the slots' `LoraShape` (every adapter is checked against it).
        capacity: the most adapters held at once.
    """

    def __init__(self, shape: LoraShape, capacity: Optional[int] = None):
        self.shape = shape
        self.capacity = capacity
        self.adapters: Dict[str, Loaded] = {}  # name -> Loaded, least recently used first
        self._uids = itertools.count(1)

    def get(self, name: str) -> Loaded:
        """The adapter called `name`, marked as just used. Raises KeyError when none is."""
        loaded = self.adapters.pop(name)
        self.adapters[name] = loaded
        return loaded

    def add(self, adapter: LoraAdapter, pinned: bool, in_use: Callable[[str], bool]) -> Tuple[Loaded, List[str]]:
        """Register `adapter`; returns it and the names evicted to make room (least recently used first, never
        one `in_use` says requests use, never a pinned one).

        Raises:
            ValueError: the name is taken, the adapter does not fit `shape`, or the registry is full of adapters
                that are pinned or in use.
        """
        if adapter.name in self.adapters:
            raise ValueError(f"LoRA adapter {adapter.name!r} is already loaded; unload it first")
        self.shape.check(adapter)
        evicted = []
        if self.capacity is not None and len(self.adapters) >= self.capacity:
            victim = next((n for n, a in self.adapters.items() if not a.pinned and not in_use(n)), None)
            if victim is None:
                raise ValueError(f"--max-loaded-loras {self.capacity} adapters are loaded and each is pinned or in "
                                 f"use; unload one first")
            del self.adapters[victim]
            evicted.append(victim)
        loaded = Loaded(adapter, next(self._uids), pinned)
        self.adapters[adapter.name] = loaded
        return loaded, evicted

    def remove(self, name: str) -> Loaded:
        """Unregister `name`. Raises KeyError when it is not loaded."""
        return self.adapters.pop(name)

    def paths(self) -> Dict[str, str]:
        """name -> path of every loaded adapter (SGLang's ``loaded_adapters``)."""
        return {n: a.adapter.path for n, a in self.adapters.items()}


def resolve_lora_shape(server_args) -> Optional[LoraShape]:
    """The slot shape of a server: None without ``--enable-lora`` (or ``--lora-paths``, which implies it); else
    ``--max-loras-per-batch`` slots of rank ``--max-lora-rank`` for ``--lora-target-modules``, the last two
    inferred from the ``--lora-paths`` adapters' configs when not given (SGLang's rule).

    Raises:
        ValueError: no adapter to infer them from and a flag missing; a bad ``--lora-paths`` or target name.
    """
    from sgl_jax.srt.lora.peft_adapter import LORA_MODULES, adapter_shape, normalize_target_modules

    refs = parse_lora_paths(server_args.lora_paths)
    if not (server_args.enable_lora or refs):
        return None
    rank, targets = server_args.max_lora_rank, normalize_target_modules(server_args.lora_target_modules)
    if (rank is None or not targets) and not refs:
        raise ValueError("--enable-lora without --lora-paths needs --max-lora-rank and --lora-target-modules (the "
                         "shape of the adapter slots, fixed at start-up)")
    shapes = [adapter_shape(r.lora_path, cache_dir=server_args.download_dir) for r in refs]
    if rank is None:
        rank = max(s[0] for s in shapes)
    if not targets:
        inferred = {t for _, ts in shapes for t in ts}
        targets = tuple(m for m in LORA_MODULES if m in inferred)
    return LoraShape(slots=int(server_args.max_loras_per_batch), rank=int(rank), targets=tuple(targets))
