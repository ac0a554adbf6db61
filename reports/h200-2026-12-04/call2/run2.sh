#!/usr/bin/env bash
# Second device call (issue #69): bench_one_batch on Qwen3-0.6B's shapes under XLA's command-buffer (CUDA graph)
# settings, each a variant of XLA_FLAGS, in one run; then `gpu_checks.sh hotloop` (with the K=8 fix) under the
# variant with the shortest overlapped batch-1 step; then pack $OUT.
set -u
t0=$SECONDS
o=${GC_DIR:-/tmp/gc2}; mkdir -p "$o"
if [ -z "${GC_NO_WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export TOKENIZER_PATH=$PWD/.gpu/tok
base_py=${PYTHONPATH:-}
variants=(
  "default|"
  "never-update|--xla_gpu_command_buffer_update_mode=NEVER_UPDATE"
  "no-graphs|--xla_gpu_enable_command_buffer="
  "whole-graph|--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE,DYNAMIC_SLICE_FUSION --xla_gpu_graph_min_graph_size=1 --xla_gpu_command_buffer_update_mode=NEVER_UPDATE"
)
for v in "${variants[@]}"; do
    name=${v%%|*}; flags=${v#*|}
    [ $(( SECONDS - t0 )) -lt ${VARIANT_BUDGET:-200} ] || break
    PYTHONPATH="$PWD/python${base_py:+:$base_py}" JAX_PLATFORMS=${GPU_CHECKS_PLATFORMS:-cuda} XLA_FLAGS="$flags" \
        timeout ${VARIANT_LIMIT:-75} python3 -m sgl_jax.bench_one_batch --model-path ${VARIANT_MODEL:-benchmark/configs/Qwen3-0.6B} \
        --load-format dummy --dtype bfloat16 --batch-size 1 16 --input-len 512 --output-len 32 --warmup-steps 4 \
        --precompile-bs-paddings 1 16 --precompile-token-paddings 2048 \
        --report "$o/xla-$name-qwen3-0.6b-gpu.md" > "$o/xla-$name.log" 2>&1
    echo "variant $name: exit $? at $((SECONDS - t0)) s"; grep -a -E "^\| (1|16) \| (no overlap|overlap) " "$o/xla-$name.log"
done
best=$(python3 - "$o" <<'PY'
import glob, json, sys
best = None
for f in glob.glob(sys.argv[1] + "/xla-*-gpu.json"):
    rows = json.load(open(f))["rows"]
    ms = [r["decode_overlap_median_ms"] for r in rows if r["batch_size"] == 1]
    if ms and (best is None or ms[0] < best[0]):
        best = (ms[0], f.split("/xla-")[1][:-len("-qwen3-0.6b-gpu.json")])
print(best[1] if best else "default")
PY
)
for v in "${variants[@]}"; do [ "${v%%|*}" = "$best" ] && flags=${v#*|}; done
echo "best: $best ($flags)" | tee "$o/best.txt"
XLA_FLAGS="$flags" timeout $(( ${TOTAL_LIMIT:-470} - (SECONDS - t0) )) scripts/gpu_checks.sh "$o" ${GC_STAGES:-hotloop} \
    > "$o/gpu_checks.log" 2>&1
echo "gpu_checks: exit $? at $((SECONDS - t0)) s"
dest=${OUT:-/tmp/gc2-out}; mkdir -p "$dest"
tar czf "$dest/gc2.tar.gz" --exclude='hotloop-trace*' -C "$o" .
for d in "$o"/hotloop-trace-k*; do
    [ -d "$d" ] || continue
    n=$(basename "$d"); tar czf "/tmp/$n.tar.gz" -C "$o" "$n"
    split -b 15M -d "/tmp/$n.tar.gz" "$dest/$n.tar.gz.part"
done
ls -la "$dest"; grep -a "===" "$o/gpu_checks.log"; cat "$o"/hot-loop-qwen3-0.6b-gpu.md 2>/dev/null | tail -8
echo "done at $((SECONDS - t0)) s"
