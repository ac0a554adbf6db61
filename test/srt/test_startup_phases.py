"""StartupPhases (issue #70): the phases a start-up records, their sum, and the process start time from /proc."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from sgl_jax.srt.startup_phases import StartupPhases, process_started_at


def test_phases_add_up_to_the_time_since_the_start():
    phases = StartupPhases(time.time() - 2.0)  # a process that started 2 s ago
    phases.since_start("process start and imports")
    with phases.phase("weights"):
        time.sleep(0.05)
    with pytest.raises(RuntimeError):
        with phases.phase("broken"):
            raise RuntimeError("a phase that fails records nothing")
    t0 = time.perf_counter()
    time.sleep(0.1)
    phases.add("weights", time.perf_counter() - t0, "again")  # (a second piece of the same phase adds to it)
    phases.since_start("other")
    out = phases.to_json(total=phases.total())
    names = [p["name"] for p in out["phases"]]
    assert names == ["process start and imports", "weights", "other"]
    seconds = {p["name"]: p["seconds"] for p in out["phases"]}
    assert 1.99 <= seconds["process start and imports"] <= 2.1
    assert 0.15 <= seconds["weights"] <= 0.3  # 0.05 + 0.1 slept
    # the time the phases leave out is "other": the three sum to the total (each rounded to 1 ms)
    assert abs(sum(seconds.values()) - out["total_s"]) < 0.01
    described = phases.describe()
    assert described.startswith("process start and imports 2.0 s, weights 0.") and " s (again), other " in described


def test_process_start_time_is_the_child_process_start():
    """A child's /proc start time lies between its launch (parent's clock) and its own first statement."""
    code = "import time; t = time.time(); from sgl_jax.srt.startup_phases import process_started_at as p; " \
           "print(t, p())"
    before = time.time()
    first, started = map(float, subprocess.check_output([sys.executable, "-c", code], text=True).split())
    assert before - 0.02 <= started <= first + 0.02  # (/proc's clock ticks: 10 ms)
    assert process_started_at() < before
