"""Small helpers shared by the benchmarks: timing, the machine's name, XLA's measured matmul rate, the commit."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time


def timed(fn):
    """(fn(), seconds it took) by time.perf_counter."""
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (else platform.processor()) and its core count, e.g. "AMD EPYC, 2 cores"."""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")][0]
    except (OSError, IndexError):
        cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores"


def xla_matmul_gflops(n: int = 2048, repeats: int = 5, dtype: str = "float32") -> float:
    """XLA's matmul rate on the default device (n x n x n operands of `dtype`, best of `repeats` after one
    warm-up; random normal data, not zeros), GFLOP/s."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), np.float32), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = min(timed(lambda: f(a).block_until_ready())[1] for _ in range(repeats))
    return 2 * n ** 3 / best / 1e9


# (dense bf16 matmul TFLOP/s, HBM GB/s) from the vendors' datasheets, by the start of jax's device_kind
DEVICE_PEAKS = {
    "TPU v6 lite": (918.0, 1640.0),
    "TPU v5 lite": (197.0, 819.0),
    "NVIDIA H100 80GB HBM3": (989.0, 3350.0),
    "NVIDIA H200": (989.0, 4800.0),
}


def datasheet_peaks(device_kind: str):
    """(kind, dense bf16 TFLOP/s, HBM GB/s) of DEVICE_PEAKS for a jax ``device_kind``; None when unknown."""
    return next(((k, *v) for k, v in DEVICE_PEAKS.items() if device_kind.startswith(k)), None)


def accelerator_matmul_gflops() -> float:
    """XLA's bfloat16 matmul rate on the default TPU/GPU (8192^3, the precision its matrix units serve), GFLOP/s."""
    return xla_matmul_gflops(8192, repeats=10, dtype="bfloat16")


def write_json(path: str, obj) -> None:
    """Write `obj` as indented JSON to `path`, creating its directory."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def git_commit(short: bool = False) -> str:
    """HEAD of the checkout sgl_jax is installed from (``-dirty`` with uncommitted changes to tracked files;
    "unknown" outside a git checkout)."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args):
        return subprocess.run(["git", "--no-optional-locks", *args], cwd=here, capture_output=True, text=True,
                              check=True).stdout.strip()

    try:
        head = git("rev-parse", *(["--short"] if short else []), "HEAD")
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
