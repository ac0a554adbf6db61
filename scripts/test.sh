#!/usr/bin/env bash
# Set up ./.venv (scripts/setup.sh) and run the whole test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
export JAX_PLATFORMS=cpu
exec .venv/bin/python -m pytest test -q -n 2 --durations=25 "$@"
