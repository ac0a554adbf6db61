#!/bin/bash
cd ${ROOT:-/work/main}
PYTHONPATH=${ROOT:-/work/main}/python exec ${PYTHON:-python} -m sgl_jax.launch_server --model-path benchmark/configs/tiny-llama-vocab512 --load-format dummy --tokenizer-path ${TOKENIZER:?SmolLM2 tokenizer dir} --random-seed 0 --log-level warning --port 31000 "$@"
