# shellcheck shell=sh
# Everything `fab status` needs about the latest run, in one command (fleet.status.fetch), sent as
#   sh -c <this> fleet-status-fetch WORKDIR TMUX SESSION EVENT_BYTES BOUNDARY NVIDIA_SMI FIELDS [LOG_BYTES]
# Prints sections `<BOUNDARY> <name>` (BOUNDARY is random per call): the target's clock, the latest
# run id, its tmux pane, run.json, the pid, exit_code and stop_signal files of run.sh / `fab stop`,
# the last lines of attempts.jsonl (the restart policy's record),
# size+mtime and the last bytes (`tail -c`) of events.jsonl and train.log, and the
# `nvidia-smi --query-gpu` table when NVIDIA_SMI is not empty.
# A log of many GB is never read whole. The `end` section tells the caller the answer is complete.
wd=$1
tmux=$2
session=$3
n=$4
b=$5
nvsmi=$6
fields=$7
m=${8:-$4}
sec() { printf '\n%s %s\n' "$b" "$1"; }
sec now
date +%s
run=$(readlink -- "$wd/runs/latest" 2>/dev/null)
run=${run##*/}
sec run
printf '%s' "$run"
d="$wd/runs/$run"
if [ -n "$run" ] && [ -d "$d" ]; then
    sec pane
    "$tmux" list-panes -s -t "=$session" -F '#{pane_dead} #{pane_dead_status} #{pane_dead_signal} #{pane_pid}' 2>/dev/null
    sec run_json
    cat -- "$d/run.json" 2>/dev/null
    for f in pid exit_code stop_signal; do
        sec "$f"
        cat -- "$d/$f" 2>/dev/null
    done
    sec attempts
    tail -n 20 -- "$d/attempts.jsonl" 2>/dev/null
    for f in events.jsonl train.log; do
        sec "stat $f"
        stat -c '%s %Y' -- "$d/$f" 2>/dev/null
        sec "tail $f"
        tail -c "$n" -- "$d/$f" 2>/dev/null
        n=$m
    done
fi
if [ -n "$nvsmi" ]; then
    sec gpus
    if command -v timeout >/dev/null 2>&1; then
        timeout -k 2 10 "$nvsmi" --query-gpu="$fields" --format=csv 2>/dev/null
    else
        "$nvsmi" --query-gpu="$fields" --format=csv 2>/dev/null
    fi
fi
sec end
exit 0
