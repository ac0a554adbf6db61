"""XLA's threads kept off one core while a small decode step runs on a CPU device (model_executor/host_core.py).

In process, with JAX's CPU client running (its worker threads started): `ThreadPlacement.reserve` moves every native
thread off the host core and no Python thread, a process started meanwhile gets every core, and `release` gives them
all back. `HostCoreTuner` is driven by real launches spaced by sleeps that depend on the placement in force: it keeps
the placement with the shorter launch-to-launch interval, leaves a device-bound shape shared without trying, releases
for other steps, and obeys "on" / "off". The runner's hooks (placement by the decode launches of a real ModelRunner,
release at an extend step) are checked in test_hot_loop.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import jax.numpy as jnp
import pytest

from sgl_jax.srt.model_executor import host_core
from sgl_jax.srt.model_executor.host_core import HostCoreTuner, ThreadPlacement
from sgl_jax.srt.server_args import ServerArgs

SHORT_S, LONG_S = 0.0015, 0.003  # launch intervals of the two placements (2x apart, far beyond the margin)


def native_masks() -> dict:
    return {tid: os.sched_getaffinity(tid) for tid in host_core.native_worker_threads()}


@pytest.fixture
def placement():
    jnp.ones(1024).sum().block_until_ready()  # (XLA's CPU client and its threads are up)
    assert host_core.supported(), "these tests need Linux and at least 2 cores"
    p = ThreadPlacement()
    yield p
    p.release()


def test_reserve_moves_native_threads_only(placement):
    cores = set(placement.cores)
    before = native_masks()
    assert before and all(m == cores for m in before.values())
    python = {t.native_id: os.sched_getaffinity(t.native_id) for t in threading.enumerate()}
    placement.reserve()
    assert placement.reserved
    after = native_masks()
    assert set(before) <= set(after)
    assert all(m == cores - {placement.host_core} for m in after.values())
    assert {t: os.sched_getaffinity(t) for t in python} == python
    child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str(sorted(cores))
    placement.release()
    assert not placement.reserved and all(m == cores for m in native_masks().values())


def drive(tuner: HostCoreTuner, key, launches: int, shared_s: float, reserved_s: float, wait_share: float = 0.0):
    """`launches` launches of `key`, each followed by the host's work: `shared_s` or `reserved_s` of sleep, by the
    placement in force; the step before waited `wait_share` of the interval for the device."""
    interval = shared_s
    for _ in range(launches):
        tuner.before_launch(key, wait_share * interval)
        interval = reserved_s if tuner.placement.reserved else shared_s
        time.sleep(interval)


def test_tuner_keeps_the_faster_placement(placement):
    tuner = HostCoreTuner(placement, "auto", trial=6)
    drive(tuner, ("small",), 30, shared_s=LONG_S, reserved_s=SHORT_S)
    assert tuner.trials[("small",)].choice is True and placement.reserved
    drive(tuner, ("other",), 30, shared_s=SHORT_S, reserved_s=LONG_S)
    assert tuner.trials[("other",)].choice is False and not placement.reserved
    trial = tuner.trials[("other",)]
    assert len(trial.shared) == len(trial.reserved) == 6  # both tried, then no more samples
    drive(tuner, ("small",), 3, shared_s=LONG_S, reserved_s=SHORT_S)  # a decided shape: placed at once
    assert placement.reserved
    tuner.before_launch(None)  # any other step: every core
    assert not placement.reserved


def test_a_device_bound_shape_stays_shared_untried(placement):
    tuner = HostCoreTuner(placement, "auto", trial=6)
    drive(tuner, ("large",), 20, shared_s=SHORT_S, reserved_s=SHORT_S / 4, wait_share=0.5)
    trial = tuner.trials[("large",)]
    assert trial.choice is False and trial.reserved == [] and not placement.reserved


def test_modes_on_and_off(placement):
    on = HostCoreTuner(placement, "on")
    on.before_launch(("any",))
    assert placement.reserved
    on.before_launch(None)
    assert not placement.reserved
    off = HostCoreTuner(placement, "off")
    drive(off, ("small",), 20, shared_s=LONG_S, reserved_s=SHORT_S)
    assert not placement.reserved and off.trials == {}
    with pytest.raises(ValueError, match="host core mode"):
        HostCoreTuner(placement, "sometimes")
    with pytest.raises(ValueError, match="--host-core-reservation"):
        ServerArgs(model_path="m", host_core_reservation="sometimes")


def test_unsupported_without_two_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert not host_core.supported()
