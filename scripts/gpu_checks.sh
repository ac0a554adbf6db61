#!/usr/bin/env bash
# The checks that need a GPU, in one go (run from the repository root on a machine with JAX for CUDA, flax and
# the runtime dependencies importable; the package from ./python, not installed):
#
#   scripts/gpu_checks.sh OUT_DIR [tests] [kernel] [score] [score-native]
#
#   tests         the GPU kernel compiled by Triton against the reference (test_ragged_paged_attention_gpu.py)
#   kernel        benchmark/kernels/bench_ragged_paged_attention.py: native vs pallas, bfloat16
#   score         test_bench_multi_item_score.py at the seed shape (query 2,000 tokens, 500 items x 20), Qwen3-0.6B
#                 shapes with random weights (benchmark/configs/Qwen3-0.6B), bfloat16, the Pallas kernel
#   score-native  the same with --attention-backend native (XLA's attention)
#
# The scoring runs need a tokenizer: SmolLM2's HF directory in $TOKENIZER_PATH (its ids are valid Qwen3 ids).
# Every stage runs under its own time limit and writes its log and report under OUT_DIR; the script goes on
# after a failed stage and exits non-zero if any failed.
set -u
out=${1:?usage: scripts/gpu_checks.sh OUT_DIR [stage...]}
shift
stages=${*:-tests kernel score}
mkdir -p "$out"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export SGL_JAX_CACHE_DIR=${SGL_JAX_CACHE_DIR:-/tmp/sgl_jax_cache}
failed=0

stage() {  # stage NAME LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    echo "=== $name: exit $rc in $((SECONDS - t0)) s"
    tail -n 40 "$out/$name.log"
    [ $rc -eq 0 ] || failed=1
}

nvidia-smi -L
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"

score_args=(--query-tokens 2000 --num-items 500 --item-tokens 20 --model-path benchmark/configs/Qwen3-0.6B
            --load-format dummy --dtype bfloat16 --tokenizer-path "${TOKENIZER_PATH:-}")
for s in $stages; do
    case $s in
        tests) stage tests 200 python3 -m pytest -q -x -p no:cacheprovider test/srt/test_ragged_paged_attention_gpu.py ;;
        kernel) stage kernel 240 python3 benchmark/kernels/bench_ragged_paged_attention.py \
                    --output "$out/ragged-paged-attention-gpu.md" ;;
        score) stage score 360 python3 test/srt/test_bench_multi_item_score.py "${score_args[@]}" \
                   --report "$out/multi-item-score-gpu.md" ;;
        score-native) stage score-native 360 python3 test/srt/test_bench_multi_item_score.py "${score_args[@]}" \
                          --attention-backend native --report "$out/multi-item-score-gpu-native.md" ;;
        *) echo "unknown stage $s"; failed=1 ;;
    esac
done
exit $failed
