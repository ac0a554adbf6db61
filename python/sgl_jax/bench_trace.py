"""How busy the device was in a decode loop's `jax.profiler` trace: the kernels' own time, not a re-run's (issue #69).

``python -m sgl_jax.bench_trace TRACE [TRACE...]`` (a ``perfetto_trace.json.gz`` or ``*.trace.json.gz`` file, or a
directory holding one, such as bench_one_batch's ``--profile DIR/bs{B}-in{L}``) prints one markdown row per trace.

bench_one_batch's "device ms" re-runs the step's program back to back and takes the wall time. On a GPU that time
still holds the host's share of every run: launching the program's CUDA graph, updating the graph when buffer
addresses changed, and a conditional that makes the host read its predicate (XLA's ConditionalThunk copies it to
the host and waits). The trace tells them apart. The device's stream events (``/device:GPU:0``'s threads:
kernels and copies) give the time the device really worked. Their union is taken, so work on two streams at
once counts once. The host thread's ``decode`` step annotations (bench_decode_loops' ``StepTraceAnnotation``)
give the loop's iterations. XLA's host spans are summed per iteration: ``command_buffer::update``,
``cuGraphLaunch``, ``cond*`` and ``GpuExecutable::ExecuteThunks``.

busy % = device time inside the iterations' span / the span, for the span from the first iteration's start to the
last one's end. With the overlap loop a step's kernels run during the next iteration, so the share is taken over
the whole span, not per iteration.

A CPU trace has no device stream: `summarize` returns None for it.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import statistics
from typing import Dict, List, Optional, Tuple

STEP_ANNOTATION = "decode"
HOST_SPANS = {  # column -> how a host event's name matches it
    "execute ms": lambda n: n.endswith("GpuExecutable::ExecuteThunks"),
    "graph update ms": lambda n: n == "command_buffer::update",
    "graph launch ms": lambda n: n.startswith("cuGraphLaunch"),
    "conditional ms": lambda n: n.startswith("cond"),
}


def find_trace(path: str) -> str:
    """`path` itself if it is a file, else the newest ``perfetto_trace.json.gz`` (or ``*.trace.json.gz``) under it.

    Raises:
        FileNotFoundError: no trace file under `path`."""
    if os.path.isfile(path):
        return path
    found = (glob.glob(os.path.join(path, "**", "perfetto_trace.json.gz"), recursive=True)
             or glob.glob(os.path.join(path, "**", "*.trace.json.gz"), recursive=True))
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz or *.trace.json.gz under {path}")
    return max(found, key=os.path.getmtime)


def union_ms(intervals: List[Tuple[float, float]], lo: float, hi: float) -> float:
    """Length in ms of the union of `intervals` ((start, end) in us) clipped to [lo, hi] (us)."""
    total, cur_start, cur_end = 0.0, None, None
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi):
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    if cur_end is not None:
        total += cur_end - cur_start
    return total / 1e3


def summarize(events: List[dict]) -> Optional[Dict[str, float]]:
    """The device-busy summary of one trace's ``traceEvents`` (Chrome trace format, times in us).

    Returns:
        None when the trace has no device stream (a CPU trace) or no step annotation; else a dict:
        ``steps`` (iterations), ``iteration ms`` (median), ``device ms`` (device time per iteration over the
        span), ``busy %``, ``device events`` (per iteration), and each `HOST_SPANS` column (median per
        iteration of the spans' summed time).
    """
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name")}
    device_pids = {pid for (pid, tid), n in names.items() if tid is None and n.startswith("/device:")}
    xs = [e for e in events if e.get("ph") == "X"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in xs
                   if e["name"] == STEP_ANNOTATION and e["pid"] not in device_pids)
    device = [(e["ts"], e["ts"] + e.get("dur", 0.0)) for e in xs if e["pid"] in device_pids]
    if not device_pids or not steps:
        return None
    lo, hi = steps[0][0], steps[-1][1]
    busy = union_ms(device, lo, hi)
    span = (hi - lo) / 1e3
    out = {"steps": len(steps), "iteration ms": statistics.median((e - s) / 1e3 for s, e in steps),
           "device ms": busy / len(steps), "busy %": 100.0 * busy / span if span else 0.0,
           "device events": sum(1 for s, _ in device if lo <= s <= hi) / len(steps)}
    for column, match in HOST_SPANS.items():
        per_step = [0.0] * len(steps)
        for e in xs:
            if e["pid"] in device_pids or not match(e["name"]):
                continue
            for i, (s, end) in enumerate(steps):
                if s <= e["ts"] < end:
                    per_step[i] += e["dur"] / 1e3
                    break
        out[column] = statistics.median(per_step)
    return out


def load_events(path: str) -> List[dict]:
    """The ``traceEvents`` of a (gzipped) Chrome-format trace file."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


COLUMNS = ["steps", "iteration ms", "device ms", "busy %", "device events", *HOST_SPANS]


def markdown(rows: List[Tuple[str, Optional[Dict[str, float]]]]) -> str:
    """A markdown table of (name, summary) rows; a summary of None reads "no device stream"."""
    lines = ["| trace | " + " | ".join(COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS)]
    for name, s in rows:
        if s is None:
            lines.append(f"| {name} | no device stream or step annotation |" + " |" * (len(COLUMNS) - 1))
            continue
        cells = [f"{s[c]:.0f}" if c in ("steps", "busy %", "device events") else f"{s[c]:.3f}" for c in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", help="trace files or directories (bench_one_batch --profile DIR/...)")
    args = parser.parse_args(argv)
    rows = []
    for path in args.traces:
        rows.append((path, summarize(load_events(find_trace(path)))))
    print(markdown(rows))


if __name__ == "__main__":
    main()
