#!/usr/bin/env bash
# The user's 5+3 job shape on 8 GPUs (nvidia-h200-x8), through fleet on the device as a
# `local` target. Steps (each with its own time limit; outputs in $OUT, default ./gpu-out):
#   gpus    fab gpus: 8 clean GPUs (exit 0)
#   warm    fab deploy + fab warm: every bucket of qwen3-27b-random into <workdir>/compile-cache,
#           cold; its manifest's seconds = the cold time to a compiled first step
#   splits  benchmarks/topology_bench.py for 5+3, 6+2 and 4+4 on the warm cache: tokens/s, MFU and
#           idle per role, plan's prediction; the 5+3 run's first drafter step = the warm start
# Usage: bash benchmarks/gpu/run_x8.sh [step ...]   (default: gpus warm splits)
# Device time is 10 min a call: run `gpus warm` in one call and `splits` in the next.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
CONFIG="${CONFIG:-qwen3-27b-random}"
WORKDIR="${WORKDIR:-/tmp/fleet-x8}"
SPLITS="${SPLITS:-5+3 6+2 4+4}"
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(gpus warm splits)
export FLEET_CONFIG=/tmp/fleet-x8.toml
cat > "$FLEET_CONFIG" <<TOML
default_target = "x8"
[targets.x8]
host = "local"
workdir = "$WORKDIR"
gpus = ${GPUS:-8}
topology = "${TOPOLOGY:-5+3}"
env = ""
[targets.x8.run]
config = "$CONFIG"
overrides = ["--data.corpus_files=300"]
[targets.x8.commands]
python = "python3"
TOML

gpus() {
    python3 -m fabric gpus; echo "fab gpus exit=$?"
    python3 -m fabric gpus --json > "$OUT/gpus.json"
}
warm() {
    python3 -m fabric deploy || return 1
    timeout -k 20 "${WARM_LIMIT_S:-560}" python3 -m fabric warm 2>&1 | tee "$OUT/warm.log"
    cp "$WORKDIR"/compile-cache/*/manifest.json "$OUT/" 2>/dev/null
}
splits() {
    export FLEET_COMPILE_CACHE="$WORKDIR/compile-cache"
    for split in $SPLITS; do
        timeout -k 20 "${SPLIT_LIMIT_S:-180}" python3 benchmarks/topology_bench.py --config "$CONFIG" \
            --topology "$split" --steps "${STEPS:-30}" --warmup-steps 5 --plan-batches 3 --plan-warmup 2 \
            --run-dir "$OUT/run-$split" --data.corpus_files=300 --append-results | tail -1 | tee "$OUT/split-$split.json"
        rm -rf "$OUT/run-$split/checkpoints" "$OUT/run-$split/data-cache"
    done
}
for s in "${steps[@]}"; do echo "=== $s $(date -u +%T)"; "$s"; echo "=== $s done rc=$? $(date -u +%T)"; done
cp benchmarks/RESULTS.md "$OUT/RESULTS.md"
