#!/usr/bin/env bash
# Before (BEFORE_TREE: a checkout of 8dd2a34, its own .venv) and after (this tree), alternating, three runs each.
set -euo pipefail
AFTER=$(cd "$(dirname "$0")/../.." && pwd)
BEFORE=${BEFORE_TREE:?a checkout of 8dd2a34 with its .venv}
for i in 1 2 3; do
  for m in "smollm2 none" "smollm2 int8" "gemma3 none" "gemma3 int8"; do
    for tree in "$BEFORE" "$AFTER"; do
      label=$([ "$tree" = "$BEFORE" ] && echo before || echo after)
      echo "$label $(cd "$tree" && JAX_PLATFORMS=cpu .venv/bin/python "$AFTER/reports/load-hugepages-cpu-2026-12-04/load_time.py" $m 2>/dev/null | tail -1)"
    done
  done
done
