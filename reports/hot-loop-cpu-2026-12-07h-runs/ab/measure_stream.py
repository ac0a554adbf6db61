"""The A/B of 36567da (SSE events that arrive together written at once): bench_hot_loop's differential server step,
plain and streaming, at batch 1 and 16, against a server already running at URL (started from either tree);
the client is this tree's bench_hot_loop (d019a77), the same for both.

python reports/hot-loop-cpu-2026-12-07h-runs/ab/measure_stream.py http://127.0.0.1:PORT
"""
import sys

import numpy as np

from sgl_jax.bench_hot_loop import server_step_ms, timed_batch

url = sys.argv[1]
rng = np.random.default_rng(0)
timed_batch(url, rng.integers(1, 500, size=(16, 192)).tolist(), 8, False)
for bs in (1, 16):
    for stream in (False, True):
        r = server_step_ms(url, bs, 192, 500, (32, 160), 5, stream, rng)
        print("bs", bs, "stream" if stream else "plain", f"{r['median_ms']:.3f}", r["repeats_ms"])
