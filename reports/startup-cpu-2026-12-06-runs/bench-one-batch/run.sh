#!/bin/bash
# bench_one_batch A/B: 5bf420f (base, a worktree) against ab5b66a (head), alternating, on this machine.
set -u
cd /work/main
M="--model-path benchmark/configs/tiny-llama-vocab512 --load-format dummy --batch-size 1 16 64 --input-len 128 --output-len 64"
for i in 1 2 3; do
  for side in base:/tmp/wt_base head:/work/main; do
    n=${side%%:*}; r=${side#*:}
    JAX_PLATFORMS=cpu PYTHONPATH=$r/python .venv/bin/python -m sgl_jax.bench_one_batch $M --report /tmp/ab10/ob-$n-$i.md > /tmp/ab10/ob-$n-$i.log 2>&1
    echo "$n-$i rc=$?"
  done
done
