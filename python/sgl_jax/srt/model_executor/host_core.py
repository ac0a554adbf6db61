"""On a CPU device: one core left to the scheduler's thread while XLA's threads run a small decode step.

On a CPU backend the "device" is XLA's worker threads, on the same cores as the Python thread that builds and
dispatches the next step. A small batch's step is host-bound: the Python thread's work is longer than the step's,
and every time XLA's threads take its core the next launch waits. Measured on 2 cores (tiny Llama, overlapped decode,
bench_one_batch, alternating runs): the iteration at batch 1 went from 0.28-0.30 to 0.22-0.24 ms with XLA's threads
kept off one core; at batch 16 and 64, where the step is device-bound, that was 13% and 30% slower, because XLA had
one core fewer. So `HostCoreTuner` chooses per decode shape, from the steps it launches.

Only where XLA's threads run changes (``os.sched_setaffinity`` of the process's own threads; no privilege needed):
XLA keeps its thread count, so its work partitioning and the numbers it computes are unchanged, and Python's threads
(and the processes they start) keep every core. The same idea as vLLM's CPU backend, which reserves cores for its
engine thread (``VLLM_CPU_NUM_OF_RESERVED_CPU``), decided here per shape.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Dict, Hashable, List, Optional

import numpy as np

from sgl_jax.srt.server_args import HOST_CORE_MODES

logger = logging.getLogger(__name__)

def supported() -> bool:
    """Whether this process can place its threads: Linux (``os.sched_setaffinity`` and /proc/self/task) with at least
    two cores allowed."""
    return hasattr(os, "sched_setaffinity") and os.path.isdir("/proc/self/task") and len(os.sched_getaffinity(0)) >= 2


def native_worker_threads() -> List[int]:
    """Thread ids of this process that Python's `threading` did not start: XLA's (its Eigen pool and its client's),
    and other libraries' native threads (ZMQ's I/O thread)."""
    python = {t.native_id for t in threading.enumerate()}
    return [int(t) for t in os.listdir("/proc/self/task") if int(t) not in python]


class ThreadPlacement:
    """Which cores the process's native worker threads may run on (`native_worker_threads`).

    `reserve` keeps them off the lowest allowed core, which the Python threads (the one launching steps) then have to
    themselves; `release` gives them every allowed core again. Python threads are never moved, so a process or thread
    they start gets every core. Threads are listed again at each change.
    """

    def __init__(self):
        self.cores = frozenset(os.sched_getaffinity(0))
        self.host_core = min(self.cores)
        self.reserved = False

    def _set(self, cores: set) -> None:
        for tid in native_worker_threads():
            try:
                os.sched_setaffinity(tid, cores)
            except (ProcessLookupError, PermissionError):  # (the thread ended meanwhile)
                pass

    def reserve(self) -> None:
        if not self.reserved:
            self._set(set(self.cores - {self.host_core}))
            self.reserved = True

    def release(self) -> None:
        if self.reserved:
            self._set(set(self.cores))
            self.reserved = False


@dataclasses.dataclass
class _Trial:
    """Launch-to-launch intervals (seconds) of one decode shape under each placement (False: shared, True:
    reserved), and the placement chosen once both have `n` of them."""

    n: int
    shared: List[float] = dataclasses.field(default_factory=list)
    reserved: List[float] = dataclasses.field(default_factory=list)
    waits: List[float] = dataclasses.field(default_factory=list)  # shared: the share of an interval spent waiting
    choice: Optional[bool] = None

    def next_placement(self) -> bool:
        if self.choice is not None:
            return self.choice
        return len(self.shared) >= self.n  # shared first, then reserved

    def add(self, reserved: bool, interval_s: float, wait_s: float) -> bool:
        """Record an interval and the device wait of the step resolved last (seconds); True when this one made the
        choice."""
        if self.choice is not None:
            return False
        if not reserved:
            self.shared.append(interval_s)
            self.waits.append(wait_s / interval_s)
            if len(self.shared) == self.n and np.median(self.waits) > HostCoreTuner.DEVICE_BOUND:
                self.choice = False  # the host waits for the device: XLA needs every core
                return True
        else:
            self.reserved.append(interval_s)
        if len(self.shared) >= self.n and len(self.reserved) >= self.n:
            # reserving must win clearly: a tie keeps every core for XLA (the batch may grow)
            self.choice = bool(np.median(self.reserved) < (1.0 - HostCoreTuner.MARGIN) * np.median(self.shared))
            return True
        return False


class HostCoreTuner:
    """Chooses, per decode shape, whether the launching thread keeps a core of its own (`ThreadPlacement`).

    Mode "on": always reserved for decode steps; "off": never; "auto": each shape (a hashable key: rows, K and
    whether the step launched while the previous one was still running) runs its first `trial` launch-to-launch
    intervals with every core shared, the next `trial` reserved, then keeps the placement whose median interval is
    shorter (reserved only when shorter by `MARGIN`). An interval counts only between two launches of the same shape
    with no change of placement at the first. A shape whose shared launches spent more than `DEVICE_BOUND` of their
    interval waiting for the device is device-bound: it stays shared without trying the other. Any other step (extend, verify: `before_launch(None)`) runs shared.

    Raises:
        ValueError: an unknown mode.
    """

    MARGIN = 0.03
    DEVICE_BOUND = 0.1

    def __init__(self, placement: ThreadPlacement, mode: str = "auto", trial: int = 8):
        if mode not in HOST_CORE_MODES:
            raise ValueError(f"host core mode must be one of {list(HOST_CORE_MODES)}, got {mode!r}")
        self.placement, self.mode, self.trial = placement, mode, trial
        self.trials: Dict[Hashable, _Trial] = {}
        self._last_key: Optional[Hashable] = None
        self._last_t: Optional[float] = None
        self._moved = False

    def before_launch(self, key: Optional[Hashable], wait_s: float = 0.0) -> None:
        """Call right before dispatching a step: `key` its decode shape, or None for any other step; `wait_s` the
        seconds the host last waited for a step's tokens (`StepTimes.wait_s` of the step resolved last)."""
        now = time.perf_counter()
        if key is None or self.mode == "off":
            want = False
        elif self.mode == "on":
            want = True
        else:
            trial = self.trials.get(key)
            if trial is None:
                trial = self.trials[key] = _Trial(self.trial)
            if key == self._last_key and not self._moved and trial.add(self.placement.reserved, now - self._last_t,
                                                                                 wait_s):
                logger.info("Decode shape %s: %s (median launch interval %.3f ms shared, %.0f%% of it waiting "
                            "for the device; %s)", key, f"XLA's threads leave core {self.placement.host_core} to the "
                            "scheduler" if trial.choice else "XLA's threads run on every core",
                            1e3 * np.median(trial.shared), 100 * np.median(trial.waits),
                            f"{1e3 * np.median(trial.reserved):.3f} ms with a core left" if trial.reserved
                            else "device-bound: the other placement not tried")
            want = trial.next_placement()
        self._moved = want != self.placement.reserved
        if self._moved:
            self.placement.reserve() if want else self.placement.release()
        self._last_key, self._last_t = key, time.perf_counter()

    def release(self) -> None:
        """Every core shared now (the next decode launch places its threads again)."""
        self.placement.release()
        self._last_key, self._moved = None, True
