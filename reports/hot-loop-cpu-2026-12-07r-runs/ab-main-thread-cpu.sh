#!/bin/bash
# usage: ab.sh rounds ; alternates base (/tmp/wt_base) and new (/work/main)
for r in $(seq $1); do
for v in base new; do
  root=/work/main; [ $v = base ] && root=/tmp/wt_base
  pkill -f sgl_jax.launch_server; sleep 2
  (ROOT=$root nohup /tmp/probe/serve.sh > /tmp/probe/server.$v.log 2>&1 &)
  for i in $(seq 90); do curl -s 127.0.0.1:31000/health >/dev/null && break; sleep 2; done
  /work/main/.venv/bin/python /tmp/probe/loop.py 5 > /dev/null
  P=$(pgrep -f spawn_main | head -1)
  for k in 1 2; do
    a=$(awk '{print $1}' /proc/$P/task/$P/schedstat)
    out=$(/work/main/.venv/bin/python /tmp/probe/loop.py 20)
    b=$(awk '{print $1}' /proc/$P/task/$P/schedstat)
    echo "$v round$r.$k main-cpu/token $(( (b - a) / 6000 / 1000 )) us :: $out"
  done
done; done
pkill -f sgl_jax.launch_server
