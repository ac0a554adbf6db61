#!/bin/bash
cd ${ROOT:-/work/main}
PYTHONPATH=/tmp/probe/site:${ROOT:-/work/main}/python PROBE_ON=${PROBE_ON:-0} exec /work/main/.venv/bin/python -m sgl_jax.launch_server --model-path benchmark/configs/tiny-llama-vocab512 --load-format dummy --tokenizer-path /root/.cache/sgl_jax/gguf/SmolLM2-135M-Instruct.Q4_1-f8df9f39d006e284 --random-seed 0 --log-level warning --port 31000 "$@"
