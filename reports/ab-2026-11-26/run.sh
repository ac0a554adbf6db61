#!/usr/bin/env bash
# A/B: a702789 (before #35's restructuring, /tmp/base) vs HEAD (/work/main), same machine, one after the other.
set -x
cd /work/main
export JAX_PLATFORMS=cpu
SCORE_ARGS="--query-tokens 2000 --num-items 500 --item-tokens 20 --serial-items 4 --hf-items 1 --hf-batch 1"
# scoring
PYTHONPATH=/tmp/base/python .venv/bin/python /tmp/base/test/srt/test_bench_multi_item_score.py $SCORE_ARGS --report /tmp/ab/score-a702789.md > /tmp/ab/score-base.log 2>&1
.venv/bin/python test/srt/test_bench_multi_item_score.py $SCORE_ARGS --report reports/multi-item-score-cpu-2026-11-26.md > /tmp/ab/score-head.log 2>&1
# serving
serve() {  # $1 PYTHONPATH ('' for HEAD), $2 report path
  PYTHONPATH=$1 .venv/bin/python -m sgl_jax.launch_server --host 127.0.0.1 --port 30000 > /tmp/ab/server-$3.log 2>&1 &
  pid=$!
  until curl -sf http://127.0.0.1:30000/health > /dev/null; do sleep 2; done
  .venv/bin/python -m sgl_jax.bench_serving --base-url http://127.0.0.1:30000 --backend openai \
      --workload baseline,continuous_batching,paged_attention --report $2 > /tmp/ab/bench-$3.log 2>&1
  kill -TERM $pid; wait $pid
}
serve /tmp/base/python /tmp/ab/serving-a702789.md base
serve "" reports/serving-cpu-2026-11-26.md head
echo done
