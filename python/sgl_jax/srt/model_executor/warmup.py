"""Warm-up: compile every program serving runs before the first request (serving then compiles nothing).

Tracing is Python (one thread); XLA compiles, or loads from the persistent compilation cache, off the GIL: the next
program is traced while the previous ones compile, on as many threads as the host has cores (at least 2).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from typing import Callable, Dict, List, Optional, Tuple

from tqdm import tqdm

from sgl_jax.srt.model_executor.compile_stats import compile_counts, describe
from sgl_jax.srt.startup_phases import StartupPhases

logger = logging.getLogger(__name__)


def compile_programs(programs: List[Tuple[str, Callable[[], object]]], phases: Optional[StartupPhases] = None,
                     prefix: str = "") -> Dict[str, float]:
    """Compile every (name, thunk returning the lowered program) ahead of time (``jit(...).lower(...).compile()``:
    nothing runs), with a progress bar and one log line per program saying whether XLA compiled it or loaded it from
    the persistent compilation cache. Returns {"programs", "compiled", "loaded_from_cache", "seconds",
    "trace_seconds", "xla_seconds"}: wall seconds in all, seconds tracing and lowering (Python, one thread, while
    earlier programs compile), and the compile threads' seconds summed.

    With `phases`, two start-up phases: ``<prefix>tracing`` (the tracing seconds) and ``<prefix>compiling`` (the
    rest of the wall time: XLA compiling or loading after the last trace), the latter noted with the counts."""
    t0, start = time.time(), compile_counts()
    workers = max(2, min(8, os.cpu_count() or 2))
    traced, xla = [], []
    with tqdm(total=len(programs), desc="Compiling buckets", unit="shape") as bar, \
            concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compile") as pool:
        def compile_one(name, lowered, traced_s):
            t1, before = time.time(), compile_counts(this_thread=True)
            lowered.compile()
            xla.append(time.time() - t1)
            logger.info("Bucket %s: %s in %.1f s (traced in %.1f s)", name,
                        describe(compile_counts(this_thread=True) - before), time.time() - t1, traced_s)
            bar.update()
        futures = []
        for name, lower in programs:
            bar.set_postfix_str(name)
            t1 = time.time()
            lowered = lower()
            traced.append(time.time() - t1)
            futures.append(pool.submit(compile_one, name, lowered, traced[-1]))
        for f in futures:
            f.result()
    delta, wall = compile_counts() - start, time.time() - t0
    stats = {"programs": len(programs), "compiled": delta.compiled, "loaded_from_cache": delta.cache_hits,
             "seconds": round(wall, 2), "trace_seconds": round(sum(traced), 2), "xla_seconds": round(sum(xla), 2)}
    logger.info("Warm-up: %d programs in %.1f s (%d compiled, %d loaded from the compilation cache; tracing %.1f s, "
                "XLA %.1f s over %d threads)", len(programs), wall, delta.compiled, delta.cache_hits, sum(traced),
                sum(xla), workers)
    if phases is not None:
        phases.add(f"{prefix}tracing", sum(traced), f"{len(programs)} programs, one thread")
        phases.add(f"{prefix}compiling", max(0.0, wall - sum(traced)),
                   f"{delta.compiled} compiled, {delta.cache_hits} loaded from the compilation cache; XLA "
                   f"{sum(xla):.1f} s over {workers} threads")
    return stats
