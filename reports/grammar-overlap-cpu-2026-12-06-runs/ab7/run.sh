#!/bin/bash
# A/B 3: tiny Llama (benchmark/configs/tiny-llama, SmolLM2's vocabulary, dummy weights): the host-bound case.
# before (4d7b727) / after (ef0579a), one warm server each, bench_structured_output n=1 and n=16, 5 rounds
cd /work/main
PY=/work/main/.venv/bin/python
TOK=/root/.cache/sgl_jax/gguf/SmolLM2-135M-Instruct.Q4_1-6d40d32e25aacb46
port=31270
for side in before fwd; do
  W=/tmp/wt_$side
  echo "== $side server $(date)"
  port=$((port+1))
  PYTHONPATH=$W/python JAX_PLATFORMS=cpu $PY -m sgl_jax.launch_server --host 127.0.0.1 --port $port \
    --model-path benchmark/configs/tiny-llama --load-format dummy --tokenizer-path $TOK > /tmp/ab7/server-$side.log 2>&1 &
  spid=$!
  for i in $(seq 600); do curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:$port/health 2>/dev/null | grep -q 200 && break; sleep 1; done
  for rep in 1 2 3 4 5; do
    for n in 1 16; do
      echo "== $side so n=$n rep=$rep $(date)"
      PYTHONPATH=$W/python $PY -m sgl_jax.bench_structured_output --base-url http://127.0.0.1:$port --num-requests $n \
        --report /tmp/ab7/so-$side-n$n-$rep.md > /tmp/ab7/so-$side-n$n-$rep.log 2>&1
    done
  done
  curl -s http://127.0.0.1:$port/get_server_info > /tmp/ab7/info-$side.json
  kill $spid; wait $spid
done
echo "== done $(date)"
