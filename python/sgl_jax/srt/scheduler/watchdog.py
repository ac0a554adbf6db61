"""The scheduler's watchdog: takes the server down when one step makes no progress for too long.

SGLang's ``--watchdog-timeout``: what is timed is one scheduler step (building a batch's arrays, its forward
and sampling), never a request. A long prompt prefilled in many chunks is many short steps and cannot trip
it; only a step stuck in the device, a collective that waits for a dead host or a deadlock does. Then the
watchdog logs the step and every thread's stack and exits the scheduler process with status 1, which the
server process sees (its ChildWatcher) and answers by stopping, non-zero.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from typing import Optional

logger = logging.getLogger(__name__)

WATCHDOG_EXIT_CODE = 1


class StepWatchdog:
    """Watch the running step from a daemon thread.

    Args:
        timeout_s: seconds one step may run (--watchdog-timeout); 0 or less: off (nothing is started).
    """

    def __init__(self, timeout_s: float):
        self.timeout_s = float(timeout_s)
        self._started_at: Optional[float] = None  # time.monotonic() of the running step's start
        self._what = ""
        self._step = 0
        if self.timeout_s > 0:
            threading.Thread(target=self._watch, daemon=True, name="scheduler-watchdog").start()

    def step_started(self, step: int, what) -> None:
        """Step `step` (1-based) starts; `what` describes it for the log (modes and sizes): a string, or a callable
        giving it (called only if the step is logged)."""
        self._step, self._what = step, what
        self._started_at = time.monotonic()

    def step_finished(self) -> None:
        self._started_at = None

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 4)
        while True:
            time.sleep(poll)
            started = self._started_at
            if started is None:
                continue
            elapsed = time.monotonic() - started
            if elapsed > self.timeout_s:
                logger.error("Watchdog: scheduler step %d (%s) has run for %.1f s > --watchdog-timeout %g s; the "
                             "scheduler is stuck: exiting (thread stacks follow)", self._step,
                             self._what() if callable(self._what) else self._what,
                             elapsed, self.timeout_s)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                logging.shutdown()
                os._exit(WATCHDOG_EXIT_CODE)
