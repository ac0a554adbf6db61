#!/bin/bash
# A/B of the server bench at batch 1, alternating the working tree (new) and HEAD's package (base), twice each.
for round in 1 2; do
cd /work/main && PYTHONPATH=python .venv/bin/python -m sgl_jax.bench_hot_loop --batch-size 1 --repeats 7 --instances 3 --output-file /tmp/hot1_new_$round.json > /tmp/hot1_new_$round.txt 2>&1
cd /tmp/wt_base && PYTHONPATH=python /work/main/.venv/bin/python -m sgl_jax.bench_hot_loop --batch-size 1 --repeats 7 --instances 3 --output-file /tmp/hot1_base_$round.json > /tmp/hot1_base_$round.txt 2>&1
done
