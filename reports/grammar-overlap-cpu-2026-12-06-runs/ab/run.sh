#!/bin/bash
# A/B: start-up and structured-output throughput, before (4d7b727) and after (104e64d) the grammar split
cd /work/main
PY=/work/main/.venv/bin/python
port=31170
for side in before after; do
  W=/tmp/wt_$side
  echo "== $side startup $(date)"
  PYTHONPATH=$W/python $PY -m sgl_jax.bench_startup --restarts 1 --report /tmp/ab/startup-$side > /tmp/ab/startup-$side.log 2>&1
  echo "== $side server $(date)"
  port=$((port+1))
  PYTHONPATH=$W/python $PY -m sgl_jax.launch_server --host 127.0.0.1 --port $port > /tmp/ab/server-$side.log 2>&1 &
  spid=$!
  for i in $(seq 600); do curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:$port/health 2>/dev/null | grep -q 200 && break; sleep 1; done
  for rep in 1 2; do
    for n in 1 16; do
      echo "== $side so n=$n rep=$rep $(date)"
      PYTHONPATH=$W/python $PY -m sgl_jax.bench_structured_output --base-url http://127.0.0.1:$port --num-requests $n \
        --report /tmp/ab/so-$side-n$n-$rep.md > /tmp/ab/so-$side-n$n-$rep.log 2>&1
    done
  done
  curl -s http://127.0.0.1:$port/get_server_info > /tmp/ab/info-$side.json
  kill $spid; wait $spid
done
echo "== done $(date)"
