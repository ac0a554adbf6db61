"""On a CPU device, the thread that launches steps keeps its core when XLA's threads wake (issue #69).

A CPU "device" is XLA's worker threads (its Eigen pool and the client's threads) on the same cores as the scheduler's
Python thread. When a launch wakes a worker, Linux lets the woken thread preempt the running one on that core; on a
machine with 2 cores that was often the launching thread itself, which then waited for part of the step it had just
dispatched (batch 1: the dispatch took 0.13 ms in some runs against 0.065 ms in others, reports/hot-loop-cpu-*).
``SCHED_BATCH`` (sched(7)) keeps a thread's share of the CPU but drops its wake-up preemption: the worker runs on the
other core, or once the launching thread blocks. The one-step loop (--num-continuous-decode-steps 1), whose host
work at small batches takes as long as the step, is the case this serves; a K-step loop's device work is the longer
side, and there the workers keep their preemption (with SCHED_BATCH its batch-1 launch was slower in 2 of 3 runs).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import List

logger = logging.getLogger(__name__)


def other_thread_ids() -> List[int]:
    """The native ids of this process's threads except the calling one (Linux: /proc/self/task; [] elsewhere)."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []
    me = threading.get_native_id()
    return [t for t in tids if t != me]


def yield_to_launcher(platform: str, num_steps: int) -> int:
    """Give every other thread of the process SCHED_BATCH when the device is the CPU (`platform`, JAX's name), the
    OS is Linux and decode launches one step at a time (`num_steps`, --num-continuous-decode-steps, is 1); call it
    from the thread that launches steps once XLA's threads exist (after warm-up). Threads started later keep the
    default policy. Returns how many threads were changed (0: not applicable, or none could be)."""
    if platform != "cpu" or num_steps != 1 or not sys.platform.startswith("linux"):
        return 0
    changed = 0
    for tid in other_thread_ids():
        try:
            if os.sched_getscheduler(tid) == os.SCHED_OTHER:
                os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
                changed += 1
        except OSError:  # (a thread that ended meanwhile, or a policy this process may not set)
            continue
    if changed:
        logger.info("CPU device: %d other threads of the process set to SCHED_BATCH (the step launcher keeps its "
                    "core when they wake)", changed)
    return changed
