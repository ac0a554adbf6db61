#!/bin/bash
set -u
cd /work/main
M="--model-path benchmark/configs/tiny-llama-vocab512 --load-format dummy --batch-size 1 16 64 --input-len 128 --output-len 64"
for i in 1 2; do
  PYTHONPATH=/tmp/wt_before/python JAX_PLATFORMS=cpu .venv/bin/python -m sgl_jax.bench_one_batch $M --report /tmp/s17/obb/before-$i.md > /tmp/s17/obb/before-$i.log 2>&1; echo "before-$i rc=$?"
  JAX_PLATFORMS=cpu .venv/bin/python -m sgl_jax.bench_one_batch $M --report /tmp/s17/obb/after-$i.md > /tmp/s17/obb/after-$i.log 2>&1; echo "after-$i rc=$?"
done
