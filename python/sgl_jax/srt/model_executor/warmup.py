"""Warm-up: compile every program serving runs before the first request (serving then compiles nothing).

Tracing is Python (one thread); XLA compiles, or loads from the persistent compilation cache, off the GIL: the next
program is traced while the previous ones compile, on as many threads as the host has cores (at least 2).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from typing import Callable, Dict, List, Tuple

from tqdm import tqdm

from sgl_jax.srt.model_executor.compile_stats import compile_counts, describe

logger = logging.getLogger(__name__)


def compile_programs(programs: List[Tuple[str, Callable[[], object]]]) -> Dict[str, float]:
    """Compile every (name, thunk returning the lowered program) ahead of time (``jit(...).lower(...).compile()``:
    nothing runs), with a progress bar and one log line per program saying whether XLA compiled it or loaded it from
    the persistent compilation cache. Returns {"programs", "compiled", "loaded_from_cache", "seconds"}."""
    t0, start = time.time(), compile_counts()
    workers = max(2, min(8, os.cpu_count() or 2))
    with tqdm(total=len(programs), desc="Compiling buckets", unit="shape") as bar, \
            concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compile") as pool:
        def compile_one(name, lowered, traced_s):
            t1, before = time.time(), compile_counts(this_thread=True)
            lowered.compile()
            logger.info("Bucket %s: %s in %.1f s (traced in %.1f s)", name,
                        describe(compile_counts(this_thread=True) - before), time.time() - t1, traced_s)
            bar.update()
        futures = []
        for name, lower in programs:
            bar.set_postfix_str(name)
            t1 = time.time()
            lowered = lower()
            futures.append(pool.submit(compile_one, name, lowered, time.time() - t1))
        for f in futures:
            f.result()
    delta = compile_counts() - start
    stats = {"programs": len(programs), "compiled": delta.compiled, "loaded_from_cache": delta.cache_hits,
             "seconds": round(time.time() - t0, 2)}
    logger.info("Warm-up: %d programs in %.1f s (%d compiled, %d loaded from the compilation cache)",
                len(programs), time.time() - t0, delta.compiled, delta.cache_hits)
    return stats
