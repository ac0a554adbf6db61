"""Warm-up: compile every program serving runs before the first request (serving then compiles nothing).

Tracing is Python (one thread); XLA compiles, or loads from the persistent compilation cache, off the GIL: the next
program is traced while the previous ones compile, on as many threads as the host has cores (at least 2). A step
program whose serialized executable is stored (program_cache.py) is loaded on those threads without being traced.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from typing import Callable, Dict, List, Optional, Tuple

from tqdm import tqdm

from sgl_jax.srt.model_executor.compile_stats import compile_counts, describe
from sgl_jax.srt.model_executor.program_cache import ProgramCache, ProgramCall, forget_cache_hit, last_cache_hit
from sgl_jax.srt.startup_phases import StartupPhases

logger = logging.getLogger(__name__)


def as_lowered(item):
    """What a warm-up thunk returned (a ``jax.stages.Lowered`` or a `ProgramCall`) as a ``jax.stages.Lowered``
    (tracing a `ProgramCall`)."""
    return item.lower() if isinstance(item, ProgramCall) else item


def compile_programs(programs: List[Tuple[str, Callable[[], object]]], phases: Optional[StartupPhases] = None,
                     prefix: str = "", cache: Optional[ProgramCache] = None) -> Dict[str, float]:
    """Compile every (name, thunk) ahead of time (``jit(...).lower(...).compile()``: nothing runs), with a progress
    bar and one log line per program saying whether XLA compiled it, loaded it from the persistent compilation cache,
    or loaded its serialized executable. A thunk returns the lowered program, or a `ProgramCall` of a step program:
    with `cache` (program_cache.ProgramCache), a call whose executable is stored is loaded
    without tracing, and one traced here is stored (compiled by XLA, or read back from JAX's persistent cache: then
    from JAX's own entry, `ProgramCache.store`); either way the
    call's program runs that executable from then on. Returns {"programs", "compiled", "loaded_from_cache",
    "executables_loaded", "executables_loaded_ahead", "seconds", "trace_seconds", "xla_seconds"}:
    "loaded_from_cache" counts both kinds of load; "executables_loaded_ahead" those of "executables_loaded" that
    program_cache.start_prefetch had loaded before warm-up asked;
    wall seconds in all, seconds tracing and lowering (Python, one thread, while earlier programs compile), and the
    compile (or load) threads' seconds summed.

    With `phases`, two start-up phases: ``<prefix>tracing`` (the tracing seconds) and ``<prefix>compiling`` (the
    rest of the wall time: XLA compiling or loading after the last trace), the latter noted with the counts."""
    t0, start, ahead = time.time(), compile_counts(), cache.loaded_ahead if cache is not None else 0
    workers = max(2, min(8, os.cpu_count() or 2))
    traced, xla, loaded = [], [], []
    with tqdm(total=len(programs), desc="Compiling buckets", unit="shape") as bar, \
            concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compile") as pool:
        def compile_one(name, lowered, traced_s, call=None, key=None):
            t1, before = time.time(), compile_counts(this_thread=True)
            forget_cache_hit()
            compiled = lowered.compile()
            xla.append(time.time() - t1)
            counts = compile_counts(this_thread=True) - before
            if call is not None:
                call.use(compiled)
                # what XLA compiled here is serialized; what JAX's cache answered is stored from JAX's own entry
                # (re-serialized it lacks the functions XLA's CPU loader linked: program_cache's docstring)
                if key is not None and counts.cache_hits == 0:
                    cache.store(key, compiled)
                elif key is not None and counts.cache_hits == 1 and (jax_key := last_cache_hit()) is not None:
                    cache.store(key, compiled, jax_cache_key=jax_key)
            logger.info("Bucket %s: %s in %.1f s (traced in %.1f s)", name, describe(counts), time.time() - t1,
                        traced_s)
            bar.update()

        def load_one(name, call, key):
            t1 = time.time()
            compiled = cache.load(key)
            if compiled is None:  # (unreadable: traced and compiled after all, here on the compile thread)
                return compile_one(name, call.lower(), 0.0, call, key)
            call.use(compiled)
            loaded.append(time.time() - t1)
            logger.info("Bucket %s: loaded its serialized executable in %.2f s", name, loaded[-1])
            bar.update()

        futures = []
        for name, lower in programs:
            bar.set_postfix_str(name)
            t1 = time.time()
            item = lower()
            key = cache.key(name, item) if cache is not None and isinstance(item, ProgramCall) else None
            if key is not None and cache.has(key):
                futures.append(pool.submit(load_one, name, item, key))
                continue
            lowered = as_lowered(item)
            traced.append(time.time() - t1)
            futures.append(pool.submit(compile_one, name, lowered, traced[-1],
                                       item if isinstance(item, ProgramCall) else None, key))
        for f in futures:
            f.result()
    delta, wall = compile_counts() - start, time.time() - t0
    hits = delta.cache_hits + len(loaded)
    stats = {"programs": len(programs), "compiled": delta.compiled, "loaded_from_cache": hits,
             "executables_loaded": len(loaded),
             "executables_loaded_ahead": cache.loaded_ahead - ahead if cache is not None else 0,
             "seconds": round(wall, 2), "trace_seconds": round(sum(traced), 2),
             "xla_seconds": round(sum(xla) + sum(loaded), 2)}
    logger.info("Warm-up: %d programs in %.1f s (%d compiled, %d loaded from the compilation cache, %d serialized "
                "executables loaded; tracing %.1f s, XLA %.1f s over %d threads)", len(programs), wall,
                delta.compiled, delta.cache_hits, len(loaded), sum(traced), sum(xla) + sum(loaded), workers)
    if phases is not None:
        phases.add(f"{prefix}tracing", sum(traced), f"{len(programs) - len(loaded)} programs, one thread")
        phases.add(f"{prefix}compiling", max(0.0, wall - sum(traced)),
                   f"{delta.compiled} compiled, {delta.cache_hits} loaded from the compilation cache, {len(loaded)} "
                   f"serialized executables loaded; XLA {sum(xla) + sum(loaded):.1f} s over {workers} threads")
    return stats
