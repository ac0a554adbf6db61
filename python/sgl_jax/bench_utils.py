"""Helpers shared by the benchmarks: timing, the machine's name, the machine's rates measured in the run (the one
source of every floor), a server's raw /get_server_info (and waiting until it is idle), a server launched for a run
and checked when it stops (`LaunchedServer`), generated reports (a .json of raw output beside the .md), the commit.

Floors: a benchmark's floor is the least time its work can take on this machine, ``max(FLOPs / matmul rate,
bytes / memory rate)``, with both rates measured in the same run by `measure_machine_rates` (`MachineRates.floor`).
Datasheet peaks (`datasheet_peaks`) may be printed beside the measured rates; they are never a floor.

Generated reports: `write_report` writes ``NAME.md`` (title, the command that reproduces it, the body) and
``NAME.json`` (the command and the raw output every claim of the .md is computed from). Neither is edited by
hand; human notes go in ``NAME.notes.md`` beside them (`notes_path`), which no generator writes. The .json keeps
the SHA-256 of the .md it was written with, so `generated_report_problem` finds a .md edited afterwards.

``python -m sgl_jax.bench_utils --machine-rates [--matmul-dtype bfloat16]`` prints `measure_machine_rates`'s
result as one JSON line (`machine_rates_in_subprocess` runs it, so a client process never holds the device
that the server it measures needs).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable, List, Optional, Tuple

# (dense bf16 matmul TFLOP/s, HBM GB/s) from the vendors' datasheets, by the start of jax's device_kind
DEVICE_PEAKS = {
    "TPU v6 lite": (918.0, 1640.0),
    "TPU v5 lite": (197.0, 819.0),
    "NVIDIA H100 80GB HBM3": (989.0, 3350.0),
    "NVIDIA H200": (989.0, 4800.0),
}
MEMORY_PROBE_BYTES = 2 ** 30  # 1 GiB: far beyond any cache, so the read rate is the memory's


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


def datasheet_peaks(device_kind: str):
    """(kind, dense bf16 TFLOP/s, HBM GB/s) of DEVICE_PEAKS for a jax ``device_kind``; None when unknown. For
    printing beside measured rates only: never a floor."""
    return next(((k, *v) for k, v in DEVICE_PEAKS.items() if device_kind.startswith(k)), None)


# ---------------------------------------------------------------------------------------------- machine rates
def xla_matmul_gflops(n: int = 2048, repeats: int = 5, dtype: str = "float32") -> float:
    """XLA's matmul rate on the default device, GFLOP/s: an n x n by n x n product of `dtype` operands
    accumulated in float32 and cast back to `dtype` (as the model's Linear layers run it), best of `repeats`
    after one warm-up; random normal data, not zeros."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), np.float32), dtype)
    f = jax.jit(lambda x: jax.lax.dot(x, x, preferred_element_type=jnp.float32).astype(x.dtype))
    f(a).block_until_ready()
    best = min(timed(lambda: f(a).block_until_ready())[1] for _ in range(repeats))
    return 2 * n ** 3 / best / 1e9


def memory_read_gbps(nbytes: int = MEMORY_PROBE_BYTES, repeats: int = 5) -> float:
    """The default device's memory read rate, GB/s (1e9 bytes/s): the sum of an `nbytes` float32 array (every
    byte read once, one scalar written), best of `repeats` after one warm-up."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 4,), jnp.float32)
    s = jax.jit(jnp.sum)
    s(x).block_until_ready()
    best = min(timed(lambda: s(x).block_until_ready())[1] for _ in range(repeats))
    return x.nbytes / best / 1e9


@dataclasses.dataclass(frozen=True)
class MachineRates:
    """The machine's rates as `measure_machine_rates` measured them in this run.

    matmul_gflops: XLA's matmul rate, GFLOP/s (matmul_probe says which). memory_gbps: the memory read rate, GB/s
    = 1e9 bytes/s (memory_probe says which). datasheet: ``{"kind", "bf16_tflops", "hbm_gbps"}`` of
    `DEVICE_PEAKS` for the device, or None: printed beside, never used for a floor.
    """

    platform: str
    device: str
    matmul_gflops: float
    matmul_probe: str
    memory_gbps: float
    memory_probe: str
    datasheet: Optional[dict] = None

    def floor(self, flops: float, nbytes: float) -> Tuple[float, str]:
        """(seconds, "F" or "B"): the least time of work of `flops` FLOPs that moves `nbytes` bytes,
        max(flops / matmul rate, nbytes / memory rate); "F" when the FLOPs bound it (compute-bound), "B" when
        the bytes do (bandwidth-bound)."""
        t_flop, t_byte = flops / (self.matmul_gflops * 1e9), nbytes / (self.memory_gbps * 1e9)
        return max(t_flop, t_byte), "F" if t_flop >= t_byte else "B"

    def describe(self) -> str:
        """One line for a report: both measured rates and their probes, the datasheet's beside when known."""
        text = (f"measured in this run: {self.matmul_gflops:.1f} GFLOP/s ({self.matmul_probe}), "
                f"{self.memory_gbps:.1f} GB/s ({self.memory_probe})")
        if self.datasheet:
            d = self.datasheet
            text += (f"; {d['kind']} datasheet (not a floor): {d['bf16_tflops']:.0f} TFLOP/s dense bf16, "
                     f"{d['hbm_gbps']:.0f} GB/s HBM")
        return text

    def to_json(self) -> dict:
        """The rates as a JSON-ready dict (what reports save raw)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> "MachineRates":
        """The rates a report saved with `to_json`."""
        return cls(**obj)


def measure_machine_rates(matmul_dtype: Optional[str] = None,
                          memory_bytes: int = MEMORY_PROBE_BYTES) -> MachineRates:
    """Measure the default JAX device's matmul rate (GFLOP/s) and memory read rate (GB/s) now: the one source of
    every benchmark's floor.

    Matmul: `xla_matmul_gflops` at 2048^3 on CPU (best of 5), 8192^3 on an accelerator (best of 10), in
    `matmul_dtype` (default float32 on CPU, bfloat16 on an accelerator: the precision its matrix units serve).
    Memory: `memory_read_gbps` over `memory_bytes` bytes (default 1 GiB).
    """
    import jax

    dev = jax.devices()[0]
    on_cpu = dev.platform == "cpu"
    dtype = matmul_dtype or ("float32" if on_cpu else "bfloat16")
    n, repeats = (2048, 5) if on_cpu else (8192, 10)
    gflops = xla_matmul_gflops(n, repeats, dtype)
    gbps = memory_read_gbps(memory_bytes, repeats)
    sheet = None if on_cpu else datasheet_peaks(dev.device_kind)
    return MachineRates(
        platform=dev.platform, device=cpu_name() if on_cpu else f"{dev.device_kind} ({dev.platform})",
        matmul_gflops=gflops, matmul_probe=f"XLA {dtype} matmul {n}^3, float32 accumulation, best of {repeats}",
        memory_gbps=gbps, memory_probe=f"sum of a {memory_bytes / 2 ** 30:g} GiB float32 array, best of {repeats}",
        datasheet=None if sheet is None else {"kind": sheet[0], "bf16_tflops": sheet[1], "hbm_gbps": sheet[2]})


def machine_rates_in_subprocess(matmul_dtype: Optional[str] = None, env: Optional[dict] = None,
                                timeout: float = 600.0) -> MachineRates:
    """`measure_machine_rates` in a fresh ``python -m sgl_jax.bench_utils --machine-rates`` process (its own
    JAX, gone when it returns; XLA_PYTHON_CLIENT_PREALLOCATE=false, so it takes only the probes' memory): for
    benchmarks whose server, not the benchmark's process, uses the device. `env`: extra environment (e.g.
    JAX_PLATFORMS).

    Raises:
        RuntimeError: the probe process failed (its stderr tail in the message).
    """
    cmd = [sys.executable, "-m", "sgl_jax.bench_utils", "--machine-rates"]
    if matmul_dtype:
        cmd += ["--matmul-dtype", matmul_dtype]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", **(env or {})})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return MachineRates.from_json(json.loads(proc.stdout.strip().splitlines()[-1]))


# ---------------------------------------------------------------------------------------------- raw server output
def fetch_server_info(base_url: str, timeout: float = 60.0, headers: Optional[dict] = None) -> dict:
    """The raw JSON of an sgl-jax server's GET /get_server_info (flags, ``scheduler_info``, ``internal_states``
    per DP rank: ``num_compiles_after_warmup``, ``memory_errors``, ``prefill_step_budget``, KV accounting).

    Raises:
        httpx.HTTPError: the server did not answer 200.
    """
    import httpx

    r = httpx.get(base_url.rstrip("/") + "/get_server_info", timeout=timeout, headers=headers)
    r.raise_for_status()
    return r.json()


def server_claims(info: dict) -> dict:
    """What reports claim about a server, read from its raw /get_server_info (`fetch_server_info`): per DP rank,
    ``num_compiles_after_warmup`` (None: not counted), ``memory_errors``, ``peak_running_reqs``,
    ``num_retracted_reqs`` and ``prefill_step_budget`` (None: no budget; else its ``budget_ms``, ``samples``,
    ``coefficients`` in ms per unit of the fit's features, ``last_chunk_limit`` in tokens, ``num_limited``)."""
    keys = ("num_compiles_after_warmup", "memory_errors", "peak_running_reqs", "num_retracted_reqs",
            "prefill_step_budget")
    return {"ranks": [{k: st.get(k) for k in keys} for st in info["internal_states"]]}


def format_server_claims(info: dict) -> str:
    """Markdown lines of `server_claims(info)`: compiles after warm-up, memory errors and the prefill step
    budget's fit, per DP rank, as the raw /get_server_info gives them."""
    lines = []
    for i, r in enumerate(server_claims(info)["ranks"]):
        b = r["prefill_step_budget"]
        fit = ("no prefill step budget" if b is None else
               f"prefill step budget {b['budget_ms']} ms: coefficients {b['coefficients']} (ms per unit of "
               f"[1, 1k padded tokens, 10k decode-step KV tokens, 10k extend-step decode-row KV tokens, 1M "
               f"attention pairs]) from {b['samples']} steps, last chunk limit {b['last_chunk_limit']}, "
               f"cut {b['num_limited']} times")
        lines.append(f"- rank {i}: num_compiles_after_warmup {r['num_compiles_after_warmup']}, memory_errors "
                     f"{r['memory_errors']}; {fit}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- report files
def write_json(path: str, obj) -> None:
    """Write `obj` as indented JSON to `path`, creating its directory."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def notes_path(report_path: str) -> str:
    """Where human notes on a generated report go: ``NAME.notes.md`` beside ``NAME.md`` / ``NAME.json``."""
    return os.path.splitext(report_path)[0] + ".notes.md"


def rank_is_idle(state: dict) -> bool:
    """Whether one DP rank's internal state (/get_server_info ``internal_states[i]``) runs nothing: no request
    running or waiting, no scoring handle held."""
    return state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0 and state["num_score_handles"] == 0


def wait_idle_info(get_info: Callable[[], dict], timeout: float = 60.0) -> dict:
    """Call `get_info()` (a /get_server_info dict, e.g. ``lambda: fetch_server_info(url)``) until every rank is
    idle (`rank_is_idle`, and no KV token in use) or `timeout` s have passed; returns the last answer."""
    deadline = time.time() + timeout
    while True:
        info = get_info()
        if all(rank_is_idle(st) and st["kv_tokens_in_use"] == 0 for st in info["internal_states"]) \
                or time.time() > deadline:
            return info
        time.sleep(0.2)


class LaunchedServer:
    """``python -m sgl_jax.launch_server ARGS`` on a free port until closed (context manager), in its own session
    (process group) and in `env` (None: this process's environment); its log goes to a temp file, whose tail any
    start-up failure raises (RuntimeError). Leaving the context without an exception checks the stop: exit status
    0 and no process of its group left (RuntimeError otherwise, after killing what is left); the log file is removed
    after such a clean stop and kept otherwise.

    /health is polled every `poll_s` seconds; ``started_at`` (``time.perf_counter()`` at the launch) and
    ``ready_s`` (seconds from the launch to the first 200) time the start-up."""

    def __init__(self, args: List[str], timeout: float, env: Optional[dict] = None, poll_s: float = 1.0):
        import httpx

        from sgl_jax.srt.utils import find_free_port

        port = find_free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="sgl_jax_bench_server_", suffix=".log", delete=False)
        self.started_at = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "sgl_jax.launch_server", "--host", "127.0.0.1",
                                      "--port", str(port), *args], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        deadline = time.time() + timeout
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.ready_s = time.perf_counter() - self.started_at
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"server {' '.join(args)} did not start:\n{self.log_tail()}")
            time.sleep(poll_s)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        code, left = self.stop()
        if exc_type is None and (code != 0 or left):
            raise RuntimeError(f"server exited with {code}, processes of its group left: {left}\n{self.log_tail()}")
        if exc_type is None:  # (a clean stop: the log goes; after a failure it stays in the temporary directory)
            self.log.close()
            os.unlink(self.log.name)

    def log_tail(self, n: int = 3000) -> str:
        with open(self.log.name) as f:
            return f.read()[-n:]

    def stop(self) -> Tuple[int, List[int]]:
        """SIGTERM, SIGKILL after 30 s; returns (the exit status, the processes of its group still running 15 s
        later, which are then killed)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        left = group_alive(self.proc.pid)
        if left:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # (they exited in the meantime)
                pass
        return self.proc.returncode, left


def group_alive(pgid: int, timeout: float = 15.0) -> List[int]:
    """The processes of process group `pgid` still running (zombies aside) after waiting up to `timeout` s for
    them to exit (children exit asynchronously once their parent is gone)."""
    deadline = time.time() + timeout
    while True:
        alive = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state, _ppid, group = f.read().rsplit(")", 1)[1].split()[:3]
            except OSError:
                continue
            if int(group) == pgid and state != "Z":
                alive.append(int(pid))
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.2)


GENERATED_MARK = "Generated, with its raw output in `"
REPORT_SHA_KEY = "report_md_sha256"


def write_report(md_path: str, title: str, command: str, body: str, raw: dict) -> str:
    """Write a generated report pair: `md_path` (`title`, `command` in a code block, `body`, and where notes go)
    and its .json beside it (``{"command": command, **raw}``: the raw output every number of `body` comes from,
    plus the .md's SHA-256 under REPORT_SHA_KEY). Returns the .json's path."""
    os.makedirs(os.path.dirname(os.path.abspath(md_path)), exist_ok=True)
    json_path = os.path.splitext(md_path)[0] + ".json"
    notes = os.path.basename(notes_path(md_path))
    text = (f"# {title}\n\n{GENERATED_MARK}{os.path.basename(json_path)}`; not edited by hand "
            f"(notes go in `{notes}`).\n\n```bash\n{command}\n```\n\n{body.rstrip()}\n")
    with open(md_path, "w") as f:
        f.write(text)
    write_json(json_path, {"command": command, **raw, REPORT_SHA_KEY: hashlib.sha256(text.encode()).hexdigest()})
    return json_path


def publish_result(module: str, argv: Optional[List[str]], result: dict, title: str,
                   format_table: Callable[[dict], str], output_file: Optional[str], report: Optional[str]) -> None:
    """A benchmark's end: record in `result` the command that reproduces it (``python -m module`` and `argv`, or
    this process's arguments when None), print its table, write the raw JSON to `output_file` and the generated
    report pair `report` (`write_report`, titled `title`) when given."""
    result["command"] = f"python -m {module} " + shlex.join(sys.argv[1:] if argv is None else argv)
    print(format_table(result))
    if output_file:
        write_json(output_file, result)
    if report:
        write_report(report, title, result["command"], format_table(result), result)


def generated_report_problem(md_path: str) -> Optional[str]:
    """Why the report `md_path` is not as its generator wrote it (None: it is, or it is not a generated report):
    its .json is missing or has no SHA-256 of the .md, or the .md's bytes no longer match it (edited by hand)."""
    with open(md_path, encoding="utf-8") as f:
        text = f.read()
    lines = text.split("\n")
    if len(lines) < 3 or not lines[2].startswith(GENERATED_MARK):  # write_report's third line
        return None
    json_path = os.path.splitext(md_path)[0] + ".json"
    if not os.path.exists(json_path):
        return f"{md_path}: generated, but its raw output {os.path.basename(json_path)} is missing"
    with open(json_path) as f:
        want = json.load(f).get(REPORT_SHA_KEY)
    if want is None:
        return f"{md_path}: {os.path.basename(json_path)} has no {REPORT_SHA_KEY} (not written by write_report)"
    if hashlib.sha256(text.encode()).hexdigest() != want:
        return f"{md_path}: edited after it was generated (notes go in {os.path.basename(notes_path(md_path))})"
    return None


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


def main(argv=None) -> None:
    """``--machine-rates``: print `measure_machine_rates`'s result as one JSON line."""
    p = argparse.ArgumentParser(description="Print the machine's measured rates (measure_machine_rates) as JSON.")
    p.add_argument("--machine-rates", action="store_true", required=True)
    p.add_argument("--matmul-dtype", default=None, help="default: float32 on CPU, bfloat16 on an accelerator")
    args = p.parse_args(argv)
    print(json.dumps(measure_machine_rates(args.matmul_dtype).to_json()))


if __name__ == "__main__":
    main()
