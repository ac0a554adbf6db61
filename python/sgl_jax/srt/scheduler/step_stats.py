"""Where the scheduler loop's time goes, step by step: the host's own work, the waits on the device, the step rate.

Each loop iteration that launches a step is split into the time it was blocked reading a step's tokens (the device
finishing that step, then the device-to-host copy: `PendingStep.resolve`) and the rest, the host's work (taking in
requests, scheduling, building and dispatching the step, applying results, sending outputs). When the loop keeps
the device busy, the host's share hides behind the device's and the waits carry the device's time; when host time
per step exceeds the device's, the waits go to zero and the step rate is the host's.

Kept as Prometheus histograms (cumulative bucket counts and sums, rendered by metrics/collector.py at scrape time
from /get_server_info's ``step_stats``): ``sglang:scheduler_step_host_seconds``,
``sglang:scheduler_step_device_wait_seconds`` and ``sglang:scheduler_steps_per_second`` (the launch rate over each
window of at least WINDOW_S seconds in which steps ran).
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from typing import List, Optional, Tuple

STEP_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05,
                        0.1, 0.25, 0.5, 1.0, 2.5, float("inf"))
STEPS_PER_SECOND_BUCKETS = (1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 200.0, 400.0, 700.0, 1000.0, 1500.0, 2500.0, 5000.0,
                            float("inf"))
WINDOW_S = 1.0


@dataclasses.dataclass
class Histogram:
    """Bucket counts of observations (not cumulative; ``bounds`` are the buckets' upper bounds, the last +inf) and
    their sum, as a Prometheus histogram keeps them."""

    bounds: Tuple[float, ...]
    counts: List[int] = dataclasses.field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self):
        self.counts = self.counts or [0] * len(self.bounds)

    def observe(self, x: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, x)] += 1
        self.sum += x

    @property
    def count(self) -> int:
        return sum(self.counts)

    def to_json(self) -> dict:
        return {"buckets": list(self.bounds), "counts": list(self.counts), "sum": self.sum}


class StepStats:
    """The histograms of the module docstring. `iteration_started` at the top of a loop iteration, `waited` for
    each step's tokens read, `iteration_ended` after it (observed only if it launched a step: `launched`).

    Args:
        clock: seconds (time.perf_counter by default).
    """

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.host = Histogram(STEP_SECONDS_BUCKETS)
        self.device_wait = Histogram(STEP_SECONDS_BUCKETS)
        self.steps_per_second = Histogram(STEPS_PER_SECOND_BUCKETS)
        self._start: Optional[float] = None
        self._wait = 0.0
        self._launches = self._launches_before = 0
        self._window: Optional[Tuple[float, int]] = None  # (start, launches then)
        self._last_launch: Optional[float] = None

    def iteration_started(self) -> None:
        self._start, self._wait, self._launches_before = self.clock(), 0.0, self._launches

    def waited(self, seconds: float) -> None:
        """The loop was blocked `seconds` reading a step's tokens."""
        self._wait += seconds

    def launched(self) -> None:
        """A step was dispatched (a window of the rate restarts after a pause of more than WINDOW_S)."""
        now = self.clock()
        self._launches += 1
        if self._window is None or (self._last_launch is not None and now - self._last_launch > WINDOW_S):
            self._window = (now, self._launches - 1)
        elif now - self._window[0] >= WINDOW_S:
            start, n0 = self._window
            self.steps_per_second.observe((self._launches - 1 - n0) / (now - start))
            self._window = (now, self._launches - 1)
        self._last_launch = now

    def iteration_ended(self) -> None:
        if self._start is None or self._launches == self._launches_before:
            return
        wall = self.clock() - self._start
        self.host.observe(max(0.0, wall - self._wait))
        self.device_wait.observe(self._wait)
        self._start = None

    def state(self) -> dict:
        """/get_server_info's ``step_stats``: each histogram's buckets (upper bounds, +inf last), counts (per bucket,
        not cumulative) and sum."""
        return {"host_seconds": self.host.to_json(), "device_wait_seconds": self.device_wait.to_json(),
                "steps_per_second": self.steps_per_second.to_json()}
