#!/usr/bin/env bash
# The checks that need a GPU, in one go (run from the repository root on a machine with JAX for CUDA, flax and
# the runtime dependencies importable; the package from ./python, not installed):
#
#   scripts/gpu_checks.sh OUT_DIR [all] [tests] [kernel] [decode-tiles] [pages] [serving] [score] [score-native]
#                         [overlap] [serving-no-overlap] [moe] [moe-probe] [moe-serving] [spec] [hotloop]
#                         [hotloop-xla] [grammar-overlap]
#
#   all           (the default) tests, kernel, decode-tiles, serving and score, each under its own limit (240, 150,
#                 120, 180 and 360 s); issue #38 asks for all of it within 9 minutes on an H100
#
#   tests         the GPU kernels compiled by Triton against the reference (test_ragged_paged_attention_gpu.py)
#   kernel        benchmark/kernels/bench_ragged_paged_attention.py: native vs pallas, bfloat16
#   decode-tiles  benchmark/kernels/tune_flash_decode.py: the flash-decoding kernel's tile sizes against XLA's
#                 attention at 64 x 2,048 and 8 x 8,192 (Qwen3-0.6B heads)
#   pages         the kernel benchmark on Qwen3-0.6B's heads at page sizes 1, 16, 64 and 128 (the page size default)
#   serving       a server with Qwen3-0.6B's shapes (benchmark/configs/Qwen3-0.6B, dummy weights, bfloat16,
#                 --attention-backend $ATTENTION_BACKEND, default auto) answering /generate, then bench_serving's
#                 baseline and continuous_batching at half their request counts
#   score         test_bench_multi_item_score.py at the seed shape (query 2,000 tokens, 500 items x 20), Qwen3-0.6B
#                 shapes with random weights (benchmark/configs/Qwen3-0.6B), bfloat16, the Pallas kernel
#   score-native  the same with --attention-backend native (XLA's attention)
#   overlap       bench_one_batch with and without the overlap scheduler's decode loop (device-busy share, steps/s,
#                 identical tokens) on a tiny Llama (benchmark/configs/tiny-llama: 2 layers, hidden 64; issue #38
#                 asks for >= 1.3x decode steps/s at batch 64), the same with a 512-token vocabulary
#                 (benchmark/configs/tiny-llama-vocab512: no 49k-wide sampling, so host time dominates a step) and
#                 on Qwen3-0.6B's shapes, dummy weights, bfloat16
#   serving-no-overlap  the serving stage's server and workloads with --disable-overlap-schedule
#   moe           bench_one_batch on Qwen3-30B-A3B's shapes at 4 layers (benchmark/configs/Qwen3-30B-A3B-4-layers),
#                 dummy weights, bfloat16, --moe-backend tiled, ragged_dot and dense, batch 1, 8 and 64
#   moe-probe     benchmark/kernels/ragged_dot_probe.py: one grouped matmul at Qwen3-30B-A3B's expert shape, 64 to
#                 16,384 rows, bfloat16, by ragged_dot, tiled, dense and tokamax (its default and its triton
#                 kernel; tokamax's rows fail, and say so, unless it is importable: $MOE_PROBE_PATH is added to
#                 PYTHONPATH for this stage only)
#   moe-serving   the serving stage with the whole Qwen3-30B-A3B (48 layers) and bench_serving's baseline,
#                 continuous_batching and paged_attention workloads
#   spec          speculative decoding at real sizes (issue #39), dummy weights, bfloat16, bench_serving's baseline
#                 (batch 1) at 0.3 of its requests, a Llama-3.1-8B target (benchmark/configs/Llama-3.1-8B): without
#                 speculation, with and without the overlap scheduler (which speculation turns off); with STANDALONE
#                 drafts of Llama-3.2-1B's shapes and of the target's own config (the same dummy weights: the
#                 accept-everything bound); with an EAGLE-3 head of the published EAGLE3-LLaMA3.1-Instruct-8B's
#                 shapes; 3 steps, top-k 1, 4 draft tokens. $SPEC_TARGET, $SPEC_DRAFT and $SPEC_HEAD replace the
#                 three configs (tiny ones for a dry run on CPU with GPU_CHECKS_PLATFORMS=cpu); $SPEC_RUNS picks
#                 some of the five servers by name (spec-off, spec-off-no-overlap, spec-standalone-1b, spec-eagle3,
#                 spec-standalone-self). About 100 s a server on an H200
#
#   hotloop-xla   bench_one_batch on Qwen3-0.6B's shapes (batch 1 and 16, a trace each) under XLA option variants
#                 (--xla-compiler-options: CUB's radix sort off, the CUDA graph never updated, both): the device's
#                 own busy share and the host's graph and conditional spans per variant (bench_trace.py's table);
#                 $HOTLOOP_XLA_MODEL replaces the model (a tiny one for a dry run on CPU)
#   hotloop       issue #69's GPU rows in one call of under 6 minutes: bench_one_batch on the tiny Llama in
#                 bfloat16 at batch 1, 16 and 64 with the overlap loop (device busy %, where each iteration's time
#                 goes) and a jax.profiler trace of 16 of its iterations per row under OUT_DIR/hotloop-trace (also
#                 with --num-continuous-decode-steps 8); bench_hot_loop on Qwen3-0.6B's shapes (dummy weights,
#                 bfloat16: bench_one_batch's step beside a server's, one and 16 concurrent requests); and
#                 bench_one_batch at batch 1 on Llama-3.1-8B's shapes (its decode step against the weight-read
#                 floor measured in the run)
#   grammar-overlap  bench_structured_output (16 JSON-schema requests at once, then the same unconstrained) against
#                 a server of Qwen3-0.6B's shapes (dummy weights, bfloat16) with --grammar-overlap on, then off: a
#                 grammar step launched ahead and drawn again with its masks, against one that waits for the step
#                 before (issue #69 item 4; on CPU auto turns it off). $GRAMMAR_MODEL replaces the model (a tiny one
#                 for a dry run on CPU)
#
# The scoring and serving runs need a tokenizer: SmolLM2's HF directory in $TOKENIZER_PATH (its ids are valid
# Qwen3 ids). With $GPU_CHECKS_ARCHIVE set, OUT_DIR is packed into that .tar.gz after every stage (so a run cut
# short still leaves what it did in one file). $GPU_CHECKS_PLATFORMS (default cuda) is the JAX platform the stages run on.
# Every stage runs under its own time limit and writes its log and report under OUT_DIR; the script goes on
# after a failed stage and exits non-zero if any failed.
set -u
out=${1:?usage: scripts/gpu_checks.sh OUT_DIR [stage...]}
shift
stages=${*:-all}
stages=${stages/all/tests kernel decode-tiles serving score}
mkdir -p "$out"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 JAX_PLATFORMS=${GPU_CHECKS_PLATFORMS:-cuda}
export SGL_JAX_CACHE_DIR=${SGL_JAX_CACHE_DIR:-/tmp/sgl_jax_cache}
failed=0

stage() {  # stage NAME LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    if declare -F "$1" > /dev/null; then  # a function of this script: in a child bash, which timeout can stop
        timeout "$limit" bash -c '"$@"' _ "$@" > "$out/$name.log" 2>&1
    else
        timeout "$limit" "$@" > "$out/$name.log" 2>&1
    fi
    local rc=$?
    echo "=== $name: exit $rc in $((SECONDS - t0)) s"
    tail -n 40 "$out/$name.log"
    [ $rc -eq 0 ] || failed=1
    [ -z "${GPU_CHECKS_ARCHIVE:-}" ] || tar czf "$GPU_CHECKS_ARCHIVE" -C "$out" .
}

moe_one_batch() {  # the MoE slice with one --moe-backend
    python3 -m sgl_jax.bench_one_batch --model-path benchmark/configs/Qwen3-30B-A3B-4-layers --load-format dummy \
        --dtype bfloat16 --moe-backend "$1" --batch-size 1 8 64 --input-len 512 --output-len 8 --warmup-steps 2 \
        --precompile-bs-paddings 1 8 64 --precompile-token-paddings 512 2048 \
        --report "$out/moe-one-batch-$1-gpu.md"
}

hotloop_tiny() {  # [FLAGS...]: the tiny Llama's rows, bfloat16, with a trace of each row's overlapped loop
    local k=${1:-1}
    python3 -m sgl_jax.bench_one_batch --model-path benchmark/configs/tiny-llama --load-format dummy \
        --dtype bfloat16 --batch-size 1 16 64 --input-len 128 --output-len 64 --warmup-steps 8 \
        --precompile-bs-paddings 1 16 64 --precompile-token-paddings 2048 --num-continuous-decode-steps "$k" \
        --profile "$out/hotloop-trace-k$k" --profile-steps 16 --report "$out/hot-loop-tiny-llama-k$k-gpu.md"
}

hotloop_xla() {  # the Qwen3-0.6B decode loop (batch 1 and 16, with a trace) under each --xla-compiler-options
    # variant: XLA's defaults; CUB's radix sort off (on 2026-12-04 batch 1's sampling conditional ran outside the
    # CUDA graph, its host waiting ~1.5 ms a step for the predicate, while batch 16's ran inside); the CUDA graph
    # never updated (VA remapping: the graph was re-recorded every step, ~0.9 ms); both
    local rc=0 name opts
    for v in 'default|' 'no-cub-sort|{"xla_gpu_enable_cub_radix_sort": false}' \
             'never-update|{"xla_gpu_command_buffer_update_mode": "NEVER_UPDATE"}' \
             'both|{"xla_gpu_enable_cub_radix_sort": false, "xla_gpu_command_buffer_update_mode": "NEVER_UPDATE"}'; do
        name=${v%%|*} opts=${v#*|}
        echo "--- $name: ${opts:-(defaults)}"
        python3 -m sgl_jax.bench_one_batch --model-path "${HOTLOOP_XLA_MODEL:-benchmark/configs/Qwen3-0.6B}" \
            --load-format dummy --dtype bfloat16 --batch-size 1 16 --input-len 512 --output-len 32 --warmup-steps 4 \
            --precompile-bs-paddings 1 16 --precompile-token-paddings 2048 ${opts:+--xla-compiler-options "$opts"} \
            --profile "$out/hotloop-xla-trace-$name" --profile-steps 8 --report "$out/hot-loop-xla-$name-gpu.md" \
            || rc=1
    done
    return $rc
}

overlap_one_batch() {  # NAME MODEL_DIR INPUT_LEN: bench_one_batch's rows with and without the overlap loop
    python3 -m sgl_jax.bench_one_batch --model-path "$2" --load-format dummy --dtype bfloat16 \
        --batch-size 1 16 64 --input-len "$3" --output-len 64 --warmup-steps 4 \
        --precompile-bs-paddings 1 16 64 --precompile-token-paddings 2048 \
        --report "$out/overlap-one-batch-$1-gpu.md"
}

serve_and_bench() {  # NAME MODEL_DIR MAX_TOTAL_TOKENS WORKLOADS [BENCH_SERVING_ARGS...]: a server of MODEL_DIR
    # (dummy weights, bfloat16), one /generate answered, then bench_serving's WORKLOADS against it; the server's log
    # beside the report serving-NAME-gpu.md
    local name=$1 model=$2 tokens=$3 workloads=$4 port=30000 url=http://127.0.0.1:30000
    shift 4
    python3 -m sgl_jax.launch_server --model-path "$model" --load-format dummy \
        --dtype bfloat16 --tokenizer-path "${TOKENIZER_PATH:-}" --host 127.0.0.1 --port $port \
        --attention-backend "${ATTENTION_BACKEND:-auto}" ${SERVER_FLAGS:-} \
        --context-length 4096 --max-total-tokens "$tokens" --max-running-requests 64 \
        ${PRECOMPILE_FLAGS:---precompile-bs-paddings 1 8 64 --precompile-token-paddings 256 2048} \
        > "$out/$name-server.log" 2>&1 &
    local pid=$!
    python3 - "$url" $pid <<'PY' || { kill $pid; return 1; }
import json, os, sys, time, urllib.request
while True:  # until the server answers, or its process has gone (the stage's limit ends a hang)
    try:
        if urllib.request.urlopen(sys.argv[1] + "/health", timeout=5).status == 200:
            break
    except OSError:
        try:
            os.kill(int(sys.argv[2]), 0)
        except OSError:
            sys.exit("the server exited before it was ready")
        time.sleep(1)
body = json.dumps({"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}).encode()
req = urllib.request.Request(sys.argv[1] + "/generate", body, {"Content-Type": "application/json"})
out = json.load(urllib.request.urlopen(req, timeout=120))
print("/generate answered:", json.dumps(out["meta_info"]["completion_tokens"]), "tokens,", repr(out["text"]))
assert out["meta_info"]["completion_tokens"] == 8, out
PY
    if [ -n "${STRUCTURED_REQUESTS:-}" ]; then  # bench_structured_output instead of bench_serving's workloads
        JAX_PLATFORMS=cpu python3 -m sgl_jax.bench_structured_output --base-url "$url" \
            --num-requests "$STRUCTURED_REQUESTS" --report "$out/structured-output-$name-gpu.md"
    else
        JAX_PLATFORMS=cpu python3 -m sgl_jax.bench_serving --base-url "$url" --backend openai \
            --workload "$workloads" --tokenizer "${TOKENIZER_PATH:-}" --report "$out/serving-$name-gpu.md" "$@"
    fi
    local rc=$?
    kill $pid; wait $pid
    return $rc
}

spec_serving() {  # the spec stage's five servers in turn (see the header); fails if any failed
    local target=${SPEC_TARGET:-benchmark/configs/Llama-3.1-8B} rc=0
    local steps="--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
    export PRECOMPILE_FLAGS="--max-running-requests 4 --chunked-prefill-size 512 --precompile-bs-paddings 1 4
        --precompile-token-paddings 512"
    local draft=${SPEC_DRAFT:-benchmark/configs/Llama-3.2-1B} head=${SPEC_HEAD:-benchmark/configs/EAGLE3-LLaMA3.1-8B}
    local -a runs=(  # NAME|SERVER_FLAGS
        "spec-off|"
        "spec-off-no-overlap|--disable-overlap-schedule"  # speculation turns the overlap loop off: the equal peer
        "spec-standalone-1b|--speculative-algorithm STANDALONE $steps --speculative-draft-model-path $draft"
        "spec-eagle3|--speculative-algorithm EAGLE3 $steps --speculative-draft-model-path $head"
        "spec-standalone-self|--speculative-algorithm STANDALONE $steps --speculative-draft-model-path $target")
    for r in "${runs[@]}"; do
        [[ " ${SPEC_RUNS:-${runs[*]%%|*}} " == *" ${r%%|*} "* ]] || continue  # $SPEC_RUNS: some of them, by name
        echo "--- ${r%%|*}: ${r#*|}"
        SERVER_FLAGS="${r#*|}" serve_and_bench "${r%%|*}" "$target" 65536 baseline --num-requests-scale 0.3 || rc=1
        grep -E "Speculative|speculative|accept" "$out/${r%%|*}-server.log" | head -n 5
    done
    return $rc
}

command -v nvidia-smi > /dev/null && nvidia-smi -L
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"

export out
export -f moe_one_batch serve_and_bench overlap_one_batch spec_serving hotloop_tiny hotloop_xla
score_args=(--query-tokens 2000 --num-items 500 --item-tokens 20 --model-path benchmark/configs/Qwen3-0.6B
            --load-format dummy --dtype bfloat16 --tokenizer-path "${TOKENIZER_PATH:-}")
for s in $stages; do
    case $s in
        tests) stage tests 240 python3 -m pytest -q --maxfail=3 -p no:cacheprovider \
                   test/srt/test_ragged_paged_attention_gpu.py ;;
        kernel) stage kernel 150 python3 benchmark/kernels/bench_ragged_paged_attention.py \
                    --output "$out/ragged-paged-attention-gpu.md" ;;
        decode-tiles) stage decode-tiles 120 python3 benchmark/kernels/tune_flash_decode.py \
                          --output "$out/flash-decode-tiles-gpu.md" ;;
        pages) stage pages 150 python3 benchmark/kernels/bench_ragged_paged_attention.py --models Qwen3-0.6B \
                   --page-size 1 16 64 128 --output "$out/ragged-paged-attention-pages-gpu.md" ;;
        score) stage score 360 python3 test/srt/test_bench_multi_item_score.py "${score_args[@]}" --attention-backend pallas \
                   --report "$out/multi-item-score-gpu.md" ;;
        score-native) stage score-native 360 python3 test/srt/test_bench_multi_item_score.py "${score_args[@]}" \
                          --attention-backend native --report "$out/multi-item-score-gpu-native.md" ;;
        moe) stage moe-tiled 120 moe_one_batch tiled
             stage moe-ragged_dot 120 moe_one_batch ragged_dot
             stage moe-dense 120 moe_one_batch dense ;;
        moe-probe) stage moe-probe 240 env PYTHONPATH="$PYTHONPATH${MOE_PROBE_PATH:+:$MOE_PROBE_PATH}" \
                       python3 benchmark/kernels/ragged_dot_probe.py 64,512,4096,16384 \
                       ragged_dot,tiled,dense,tokamax,tokamax-triton bfloat16 ;;
        moe-serving) stage moe-serving 400 serve_and_bench moe benchmark/configs/Qwen3-30B-A3B 262144 \
                         baseline,continuous_batching,paged_attention ;;
        overlap) stage overlap-tiny 120 overlap_one_batch tiny-llama benchmark/configs/tiny-llama 128
                 stage overlap-tiny-vocab512 120 overlap_one_batch tiny-llama-vocab512 \
                     benchmark/configs/tiny-llama-vocab512 128
                 stage overlap-qwen3 150 overlap_one_batch qwen3-0.6b benchmark/configs/Qwen3-0.6B 512 ;;
        serving-no-overlap) SERVER_FLAGS=--disable-overlap-schedule stage serving-no-overlap 180 \
                                serve_and_bench qwen3-0.6b-no-overlap benchmark/configs/Qwen3-0.6B 131072 \
                                baseline,continuous_batching --num-requests-scale 0.5 ;;
        spec) stage spec 540 spec_serving ;;
        hotloop) stage hotloop-tiny 90 hotloop_tiny 1
                 stage hotloop-tiny-k8 60 hotloop_tiny 8
                 stage hotloop-qwen3 180 python3 -m sgl_jax.bench_hot_loop --model-path benchmark/configs/Qwen3-0.6B \
                     --load-format dummy --tokenizer-path "${TOKENIZER_PATH:-}" --batch-size 1 16 --input-len 192 \
                     --repeats 2 --report "$out/hot-loop-qwen3-0.6b-gpu.md" -- --dtype bfloat16 \
                     --context-length 4096 --max-running-requests 16 --precompile-bs-paddings 1 16 \
                     --precompile-token-paddings 256 2048
                 stage hotloop-llama8b 120 python3 -m sgl_jax.bench_one_batch --model-path benchmark/configs/Llama-3.1-8B \
                     --load-format dummy --dtype bfloat16 --batch-size 1 --input-len 512 --output-len 32 \
                     --warmup-steps 4 --precompile-bs-paddings 1 --precompile-token-paddings 512 \
                     --chunked-prefill-size 512 --report "$out/hot-loop-llama-3.1-8b-gpu.md" ;;
        hotloop-xla) stage hotloop-xla 240 hotloop_xla ;;
        grammar-overlap) for m in on off; do
                             SERVER_FLAGS="--grammar-overlap $m" STRUCTURED_REQUESTS=16 stage grammar-overlap-$m 150 \
                                 serve_and_bench "grammar-overlap-$m" "${GRAMMAR_MODEL:-benchmark/configs/Qwen3-0.6B}" \
                                 131072 none
                         done ;;
        serving) stage serving 180 serve_and_bench qwen3-0.6b benchmark/configs/Qwen3-0.6B 131072 \
                     baseline,continuous_batching --num-requests-scale 0.5 ;;
        *) echo "unknown stage $s"; failed=1 ;;
    esac
done
exit $failed
