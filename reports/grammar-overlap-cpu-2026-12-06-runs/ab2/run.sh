#!/bin/bash
# A/B 2: before (4d7b727) vs after (d3ba313): start-up, then structured-output throughput on one warm server each
cd /work/main
PY=/work/main/.venv/bin/python
port=31190
for side in after before; do
  W=/tmp/wt_$side
  echo "== $side startup $(date)"
  PYTHONPATH=$W/python $PY -m sgl_jax.bench_startup --restarts 1 --report /tmp/ab2/startup-$side > /tmp/ab2/startup-$side.log 2>&1
done
for side in before after; do
  W=/tmp/wt_$side
  echo "== $side server $(date)"
  port=$((port+1))
  PYTHONPATH=$W/python $PY -m sgl_jax.launch_server --host 127.0.0.1 --port $port > /tmp/ab2/server-$side.log 2>&1 &
  spid=$!
  for i in $(seq 600); do curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:$port/health 2>/dev/null | grep -q 200 && break; sleep 1; done
  for rep in 1 2 3 4 5; do
    for n in 1 16; do
      echo "== $side so n=$n rep=$rep $(date)"
      PYTHONPATH=$W/python $PY -m sgl_jax.bench_structured_output --base-url http://127.0.0.1:$port --num-requests $n \
        --report /tmp/ab2/so-$side-n$n-$rep.md > /tmp/ab2/so-$side-n$n-$rep.log 2>&1
    done
  done
  curl -s http://127.0.0.1:$port/get_server_info > /tmp/ab2/info-$side.json
  kill $spid; wait $spid
done
echo "== done $(date)"
