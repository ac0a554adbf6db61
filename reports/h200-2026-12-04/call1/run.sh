#!/usr/bin/env bash
# One device call (issue #69): the runtime wheels, `scripts/gpu_checks.sh hotloop`, then bench_one_batch on
# Qwen3-0.6B's shapes with a small and a large KV pool (does a step's time grow with the pool?), then pack $OUT.
set -u
t0=$SECONDS
o=${GC_DIR:-/tmp/gc}; mkdir -p "$o"
if [ -z "${GC_NO_WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export TOKENIZER_PATH=$PWD/.gpu/tok
git log --oneline -1 > "$o/commit.txt" 2>/dev/null; git status --short >> "$o/commit.txt" 2>/dev/null
timeout "${HOT_LIMIT:-440}" scripts/gpu_checks.sh "$o" ${GC_STAGES:-hotloop} > "$o/gpu_checks.log" 2>&1
echo "gpu_checks: exit $? at $((SECONDS - t0)) s"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" JAX_PLATFORMS=${GPU_CHECKS_PLATFORMS:-cuda}
for T in ${POOLS:-32768 524288}; do
    left=$(( ${TOTAL_LIMIT:-560} - (SECONDS - t0) ))
    [ $left -gt 30 ] || break
    timeout $(( left < 90 ? left : 90 )) python3 -m sgl_jax.bench_one_batch --model-path ${POOL_MODEL:-benchmark/configs/Qwen3-0.6B} \
        --load-format dummy --dtype bfloat16 --batch-size 1 16 --input-len 512 --output-len 32 --warmup-steps 4 \
        --precompile-bs-paddings 1 16 --precompile-token-paddings 2048 --max-total-tokens $T \
        --report "$o/pool-$T-gpu.md" > "$o/pool-$T.log" 2>&1
    echo "pool $T: exit $? at $((SECONDS - t0)) s"; grep -a -E "^\| (1|16) \|" "$o/pool-$T.log"
done
dest=${OUT:-/tmp/gc-out}; mkdir -p "$dest"
tar czf "$dest/gc.tar.gz" --exclude='hotloop-trace*' -C "$o" .
for d in "$o"/hotloop-trace-k*; do
    [ -d "$d" ] || continue
    n=$(basename "$d"); tar czf "/tmp/$n.tar.gz" -C "$o" "$n"
    split -b 15M -d "/tmp/$n.tar.gz" "$dest/$n.tar.gz.part"
done
ls -la "$dest"; tail -n 60 "$o/gpu_checks.log"
echo "done at $((SECONDS - t0)) s"
