#!/bin/bash
# The measurements of reports/hot-loop-cpu-2026-12-07r.notes.md: base = /tmp/wt_base (61d8234), new = /work/main (37c79e9).
R=/work/main/reports
/tmp/probe/ab.sh 2 2>&1 | grep round > $R/hot-loop-cpu-2026-12-07r-runs/ab-main-thread-cpu.txt
cd /work/main && PYTHONPATH=python .venv/bin/python -m sgl_jax.bench_hot_loop --batch-size 1 16 --repeats 7 --instances 3 --report reports/hot-loop-cpu-2026-12-07r-server.md > /tmp/r_new.txt 2>&1
cd /tmp/wt_base && PYTHONPATH=python /work/main/.venv/bin/python -m sgl_jax.bench_hot_loop --batch-size 1 16 --repeats 7 --instances 3 --report reports/hot-loop-cpu-2026-12-07r-server-before.md > /tmp/r_base.txt 2>&1
cp /tmp/wt_base/reports/hot-loop-cpu-2026-12-07r-server-before.* $R/
rm -rf /tmp/su_b /tmp/su_n
cd /tmp/wt_base && PYTHONPATH=python timeout 600 /work/main/.venv/bin/python -m sgl_jax.bench_startup --restarts 1 --cache-dir /tmp/su_b --report reports/startup-cpu-2026-12-07r-before.md > /tmp/su_b.txt 2>&1
cp /tmp/wt_base/reports/startup-cpu-2026-12-07r-before.* $R/
cd /work/main && PYTHONPATH=python timeout 600 .venv/bin/python -m sgl_jax.bench_startup --restarts 1 --cache-dir /tmp/su_n --report reports/startup-cpu-2026-12-07r-after.md > /tmp/su_n.txt 2>&1
echo done
