#!/bin/bash
# The checklist's bench_one_batch command, before (61d8234, /tmp/wt_base) and after (HEAD, /work/main), three
# alternating runs each; each run's table is printed after a "== <variant> run <i>" line.
for i in 1 2 3; do
for v in before after; do
  root=/work/main; [ $v = before ] && root=/tmp/wt_base
  echo "== $v run $i"
  cd $root && JAX_PLATFORMS=cpu PYTHONPATH=python /work/main/.venv/bin/python -m sgl_jax.bench_one_batch --model-path benchmark/configs/tiny-llama-vocab512 --load-format dummy --batch-size 1 16 64 --input-len 128 --output-len 64 2>&1 | grep -v "^Compiling\|it/s\|shape/s"
done; done
