#!/bin/bash
# A/B of start-up: 5bf420f (before) against ab5b66a (after), alternating, one after the other on this machine.
set -u
cd /work/main
for i in 1 2; do
  for side in before:/tmp/wt_base after:/work/main; do
    n=${side%%:*}; r=${side#*:}
    PYTHONPATH=$r/python .venv/bin/python -m sgl_jax.bench_startup --restarts 1 --report /tmp/su6/$n-$i > /tmp/su6/$n-$i.log 2>&1
    echo "$n-$i rc=$?"
  done
done
