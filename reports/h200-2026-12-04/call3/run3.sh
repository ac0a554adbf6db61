#!/usr/bin/env bash
# Third device call (issue #69): a jax.profiler trace of Qwen3-0.6B's decode loop (bench_one_batch, batch 1 and 16)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/python:/tmp/site JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
o=/tmp/gc3; mkdir -p $o
timeout 110 python3 -m sgl_jax.bench_one_batch --model-path benchmark/configs/Qwen3-0.6B --load-format dummy \
    --dtype bfloat16 --batch-size 1 16 --input-len 512 --output-len 24 --warmup-steps 4 \
    --precompile-bs-paddings 1 16 --precompile-token-paddings 2048 --profile $o/trace --profile-steps 8 \
    --report $o/trace-qwen3-0.6b-gpu.md > $o/trace.log 2>&1
echo "exit $?"; grep -a -E "^\| (1|16) \|" $o/trace.log
find $o/trace -name '*.xplane.pb' -delete
tar czf $OUT/gc3.tar.gz -C $o .; ls -la $OUT
