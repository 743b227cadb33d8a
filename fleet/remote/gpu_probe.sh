# shellcheck shell=sh
# The prelude (fleet/remote/prelude.sh) reads timeout_s and smi and sets rc and out:
# shellcheck disable=SC2034,SC2154
# One location's whole GPU probe (fleet.gpus), sent as
#   sh -c <this> fleet-gpu-probe TIMEOUT_S NVIDIA_SMI QUERY_FIELDS APPS_FIELDS PARTS LATEST_RUN_DIR
# PARTS is a subset of "query apps xml"; LATEST_RUN_DIR may be empty. Prints sections
# `@@fleet <part> <exit status>` followed by what nvidia-smi (or ps) printed; always exits 0, so the
# caller reads every answer. Each nvidia-smi call runs under `timeout` where the target has it.
timeout_s=$1
smi=$2
# fleet: include contract
# fleet: include prelude.sh
smi_section query --query-gpu="$3" --format=csv
# a hung (timeout), unrunnable or missing nvidia-smi: the other parts would only repeat it
case $rc in 124 | 126 | 127 | 137) exit 0 ;; esac
case " $5 " in *" apps "*)
    smi_section apps --query-compute-apps="$4" --format=csv
    pids=$(printf '%s\n' "$out" | sed -n 's/^ *\([0-9][0-9]*\) *,.*/\1/p' | sort -u | tr '\n' ',')
    pids=${pids%,}
    if [ -n "$pids" ]; then
        section ps ps -ww -o pid=,pgid=,user=,args= -p "$pids"
    fi
    ;;
esac
case " $5 " in *" xml "*) smi_section xml -q -x ;; esac
if [ -n "$6" ]; then
    emit runids 0 "$(cat -- "$6/$PID_FILE" "$6/$PGID_FILE" 2>/dev/null)"
fi
exit 0
