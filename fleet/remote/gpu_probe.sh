# shellcheck shell=sh
# One location's whole GPU probe (fleet.gpus), sent as
#   sh -c <this> fleet-gpu-probe TIMEOUT_S NVIDIA_SMI QUERY_FIELDS APPS_FIELDS PARTS LATEST_RUN_DIR
# PARTS is a subset of "query apps xml"; LATEST_RUN_DIR may be empty. Prints sections
# `@@fleet <part> <exit status>` followed by what nvidia-smi (or ps) printed; always exits 0, so the
# caller reads every answer. Each nvidia-smi call runs under `timeout` where the target has it.
t=$1
smi=$2
if command -v timeout >/dev/null 2>&1; then has_timeout=1; else has_timeout=0; fi
run_smi() { if [ "$has_timeout" = 1 ]; then timeout -k 2 "$t" "$smi" "$@"; else "$smi" "$@"; fi; }
section() {
    name=$1
    shift
    out=$(run_smi "$@" 2>&1)
    rc=$?
    printf '@@fleet %s %s\n%s\n' "$name" "$rc" "$out"
}
section query --query-gpu="$3" --format=csv
# a hung (timeout), unrunnable or missing nvidia-smi: the other parts would only repeat it
case $rc in 124 | 126 | 127 | 137) exit 0 ;; esac
case " $5 " in *" apps "*)
    section apps --query-compute-apps="$4" --format=csv
    pids=$(printf '%s\n' "$out" | sed -n 's/^ *\([0-9][0-9]*\) *,.*/\1/p' | sort -u | tr '\n' ',')
    pids=${pids%,}
    if [ -n "$pids" ]; then
        psout=$(ps -ww -o pid=,pgid=,user=,args= -p "$pids" 2>&1)
        prc=$?
        printf '@@fleet ps %s\n%s\n' "$prc" "$psout"
    fi
    ;;
esac
case " $5 " in *" xml "*) section xml -q -x ;; esac
if [ -n "$6" ]; then
    printf '@@fleet runids 0\n'
    cat -- "$6/pid" "$6/pgid" 2>/dev/null
fi
exit 0
