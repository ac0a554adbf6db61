"""Process-wide counts of XLA compilations and persistent-compilation-cache hits, read from JAX's monitoring
events (``jax.monitoring``), so warm-up can say per bucket whether a program was compiled or loaded from the
cache, and serving can prove it compiled nothing.

Events followed (jax/_src/dispatch.py and compiler.py): ``/jax/core/compile/backend_compile_duration`` is
recorded once per program handed to the backend (a persistent-cache hit included);
``/jax/compilation_cache/cache_hits`` once per program read back from the cache directory. A program found in
jit's in-memory caches records neither.
"""

from __future__ import annotations

import dataclasses
import threading

import jax.monitoring

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass(frozen=True)
class CompileCounts:
    """Counts since the process started: ``programs`` handed to the backend (compiled or loaded),
    ``cache_hits`` of them loaded from the persistent cache, ``seconds`` spent in those backend calls."""

    programs: int = 0
    cache_hits: int = 0
    seconds: float = 0.0

    @property
    def compiled(self) -> int:
        """Programs XLA really compiled (not loaded from the persistent cache)."""
        return self.programs - self.cache_hits

    def __add__(self, other: "CompileCounts") -> "CompileCounts":
        return CompileCounts(self.programs + other.programs, self.cache_hits + other.cache_hits,
                             self.seconds + other.seconds)

    def __sub__(self, other: "CompileCounts") -> "CompileCounts":
        return CompileCounts(self.programs - other.programs, self.cache_hits - other.cache_hits,
                             self.seconds - other.seconds)


_lock = threading.Lock()
_counts = CompileCounts()
_local = threading.local()  # the calling thread's own counts (JAX records the events in the compiling thread)
_registered = False


def _add(inc: CompileCounts) -> None:
    global _counts
    with _lock:
        _counts = _counts + inc
    _local.counts = getattr(_local, "counts", CompileCounts()) + inc


def _on_event(event: str, **_) -> None:
    if event == CACHE_HIT_EVENT:
        _add(CompileCounts(cache_hits=1))


def _on_duration(event: str, seconds: float, **_) -> None:
    if event == BACKEND_COMPILE_EVENT:
        _add(CompileCounts(programs=1, seconds=seconds))


def compile_counts(this_thread: bool = False) -> CompileCounts:
    """The counts so far in the process (or only the calling thread's, with `this_thread`). Listening starts at
    the first call: call it before the compilations to count."""
    global _registered
    with _lock:
        if not _registered:
            jax.monitoring.register_event_listener(_on_event)
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _registered = True
        return getattr(_local, "counts", CompileCounts()) if this_thread else _counts


def describe(delta: CompileCounts) -> str:
    """'compiled' / 'loaded from cache' / 'in memory' (nothing reached the backend) for one program's delta."""
    if delta.programs == 0:
        return "in memory"
    if delta.compiled == 0:
        return "loaded from cache"
    return "compiled" if delta.cache_hits == 0 else f"compiled ({delta.cache_hits} of {delta.programs} cached)"
