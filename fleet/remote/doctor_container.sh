# shellcheck shell=sh
# `fab doctor`: what a training run will meet where it runs (the container, or the target itself),
# in one round trip. Sent as `sh -c <this> fleet-doctor-ct NVSMI TIMEOUT WORKDIR MANIFEST MODEL GPU`:
#   NVSMI     nvidia-smi command          TIMEOUT   seconds per nvidia-smi call
#   WORKDIR   the target's workdir        MANIFEST  the env's fleet-env/manifest.json ("" = no env)
#   MODEL     the target model folder ("" = none)
#   GPU       none | ct (nvidia-smi -q -x here) | all (also topo -m and -p2p r: no container)
# Reads only; prints sections `@@fleet <name> <exit code>` followed by their text. POSIX sh.
# shellcheck disable=SC2034  # smi and timeout_s are read by the prelude
smi=$1 timeout_s=$2
workdir=$3
manifest=$4
model=$5
gpu=$6

# fleet: include contract
# fleet: include prelude.sh
# fleet: include doctor.sh
libs() {  # the NVIDIA user-space libraries: "link NAME TARGET" / "file NAME REALPATH"
    for dir in /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64 /usr/lib \
        /lib/x86_64-linux-gnu /lib64 /usr/local/nvidia/lib64 /usr/local/lib; do
        for lib in "$dir"/libnvidia-ml.so* "$dir"/libcuda.so*; do
            [ -e "$lib" ] || continue
            if [ -L "$lib" ]; then
                printf 'link %s %s\n' "$lib" "$(readlink -f "$lib")"
            else
                printf 'file %s %s\n' "$lib" "$(readlink -f "$lib")"
            fi
        done
    done
    return 0
}
existing() {  # the nearest existing ancestor of $1 (df needs a path that exists)
    p=$1
    while [ ! -e "$p" ] && [ "$p" != / ]; do p=$(dirname "$p"); done
    printf '%s\n' "$p"
}
memory() {
    printf 'cgroup2 %s\n' "$(cat /sys/fs/cgroup/memory.max 2>/dev/null || echo -)"
    printf 'cgroup1 %s\n' "$(cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || echo -)"
    printf 'meminfo %s\n' "$(sed -n 's/^MemTotal: *\([0-9]*\) kB$/\1/p' /proc/meminfo)"
}

host=$(uname -n)
emit hostname 0 "$host"
out=$(limited getent hosts "$host" 2>&1)
emit resolve "$?" "$out"
section shm df -P -k /dev/shm
# dash, bash and busybox sh all have ulimit -l / -n (POSIX only defines -f)
# shellcheck disable=SC3045
emit ulimit 0 "memlock $(ulimit -l)
nofile $(ulimit -n)"
disk_path=$(existing "$workdir")
section disk df -P -k "$disk_path"
out=$(memory 2>&1)
emit memory "$?" "$out"
out=$(nodes 2>&1)
emit nodes "$?" "$out"
out=$(libs 2>&1)
emit libs "$?" "$out"
section module cat /proc/driver/nvidia/version
if [ -n "$manifest" ]; then section env cat "$manifest"; fi
if [ -n "$model" ]; then
    section model_config cat "$model/$HF_CONFIG_FILE"
    section model_bytes du -s -k -L "$model"
fi
if [ "$gpu" != none ]; then
    smi_section smi_xml -q -x
    smi_section caps --query-gpu=index,name,compute_cap --format=csv
fi
if [ "$gpu" = all ]; then
    smi_section topo topo -m
    smi_section p2p topo -p2p r
fi
exit 0
