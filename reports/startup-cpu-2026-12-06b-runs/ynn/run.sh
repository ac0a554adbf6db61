#!/bin/bash
# A/B: XLA's YNN fusions on (default) against off for the step programs (--xla-compiler-options), one after the other.
set -u
cd /work/main
OFF='{"xla_cpu_experimental_ynn_fusion_type": ""}'
M="--model-path benchmark/configs/tiny-llama-vocab512 --load-format dummy --batch-size 1 16 64 --input-len 128 --output-len 64 --warmup-steps 4 --precompile-bs-paddings 1 16 64 --precompile-token-paddings 2048"
JAX_PLATFORMS=cpu .venv/bin/python -m sgl_jax.bench_one_batch $M --report /tmp/s17/ynn/obb-on.md > /tmp/s17/ynn/obb-on.log 2>&1; echo "obb-on rc=$?"
JAX_PLATFORMS=cpu .venv/bin/python -m sgl_jax.bench_one_batch $M --xla-compiler-options "$OFF" --report /tmp/s17/ynn/obb-off.md > /tmp/s17/ynn/obb-off.log 2>&1; echo "obb-off rc=$?"
JAX_PLATFORMS=cpu .venv/bin/python -m sgl_jax.bench_buckets --report /tmp/s17/ynn/buckets-on.md > /tmp/s17/ynn/buckets-on.log 2>&1; echo "buckets-on rc=$?"
JAX_PLATFORMS=cpu .venv/bin/python -m sgl_jax.bench_buckets --xla-compiler-options "$OFF" --report /tmp/s17/ynn/buckets-off.md > /tmp/s17/ynn/buckets-off.log 2>&1; echo "buckets-off rc=$?"
