#!/bin/bash
# bench_one_batch on benchmark/configs/tiny-llama (SmolLM2 vocabulary), before (4d7b727) / after (cebd77c: the cond), alternating
cd /work/main
M="--model-path benchmark/configs/tiny-llama --load-format dummy --batch-size 1 16 --input-len 128 --output-len 32 --warmup-steps 4 --precompile-bs-paddings 1 16 --precompile-token-paddings 256 --chunked-prefill-size 256"
for side in before after before after; do PYTHONPATH=/tmp/wt_$side/python JAX_PLATFORMS=cpu timeout 600 .venv/bin/python -m sgl_jax.bench_one_batch $M --report /tmp/ab6/ob-$side-$(date +%s).md; done
