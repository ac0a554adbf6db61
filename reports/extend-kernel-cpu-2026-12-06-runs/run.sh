#!/bin/bash
# The CPU extend kernel (8a3b5d5) against the commit before it (94bcfbe, a worktree at /tmp/wt_before with the
# same built kernel library), one run after the other on this 2-core machine, nothing else running.
# Start-up: alternating before/after; buckets and scoring: the same code with SGL_JAX_CPU_EXTEND_KERNEL=0 as the peer.
set -x
cd /work/main
R=reports/extend-kernel-cpu-2026-12-06-runs
export JAX_PLATFORMS=cpu
for i in 1 2; do
  PYTHONPATH=/tmp/wt_before/python .venv/bin/python -m sgl_jax.bench_startup --restarts 1 --report $R/startup-before-$i.md
  .venv/bin/python -m sgl_jax.bench_startup --restarts 1 --report $R/startup-after-$i.md
done
.venv/bin/python -m sgl_jax.bench_buckets --report $R/buckets-kernel.md
SGL_JAX_CPU_EXTEND_KERNEL=0 .venv/bin/python -m sgl_jax.bench_buckets --report $R/buckets-pure-jax.md
for side in kernel pure-jax; do
  sw=1; [ $side = pure-jax ] && sw=0
  SGL_JAX_CPU_EXTEND_KERNEL=$sw .venv/bin/python test/srt/test_bench_multi_item_score.py --query-tokens 2000 \
    --num-items 200 --item-tokens 20 --serial-items 4 --hf-items 1 --hf-batch 1 --report $R/score-$side.md
done
# After the accumulation fix (each key block's P.V summed in its own tile; the first kernel run, renamed
# score-kernel-one-chain.*, failed the benchmark's packed-vs-serial agreement check at 1.01e-4 against 1e-4):
SGL_JAX_CPU_EXTEND_KERNEL=1 .venv/bin/python test/srt/test_bench_multi_item_score.py --query-tokens 2000 \
  --num-items 200 --item-tokens 20 --serial-items 4 --hf-items 1 --hf-batch 1 --report $R/score-kernel.md
