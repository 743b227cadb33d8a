# shellcheck shell=sh
# Everything `fab status` needs about the latest run, in one command (fleet.status.fetch), sent as
#   sh -c <this> fleet-status-fetch WORKDIR TMUX SESSION EVENT_BYTES BOUNDARY NVIDIA_SMI FIELDS [LOG_BYTES]
# Prints sections `<BOUNDARY> <name>` (BOUNDARY is random per call): the target's clock, the latest
# run id, whether it is alive (its lock), its tmux pane, run.json, the pid, exit_code and stop_signal files of run.sh / `fab stop`,
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
# A run is alive while RUN_DIR/lock is held: run.sh takes it first and every process of the run
# inherits it, so it outlives tmux and run.sh itself. Without flock, or for a run dir from before
# the lock, a process of the recorded group that is not a zombie (tmux may leave a dead pane's
# process unreaped). Never `kill -0 -- -PGID`: dash rejects it.
run_alive() {
    if [ -e "$1/lock" ] && command -v flock >/dev/null 2>&1; then
        flock -n -s -E 75 "$1/lock" true 2>/dev/null
        [ $? -eq 75 ]
        return
    fi
    pgid=$(cat -- "$1/pgid" 2>/dev/null) || return 1
    case "$pgid" in '' | *[!0-9]*) return 1 ;; esac
    for st in /proc/[0-9]*/stat; do
        { read -r line < "$st"; } 2>/dev/null || continue
        rest=${line##*) }
        # shellcheck disable=SC2086
        set -- $rest
        if [ "${3:-}" = "$pgid" ] && [ "$1" != Z ]; then
            return 0
        fi
    done
    return 1
}
# The latest run's id: runs/latest, or when that dangles (its dir removed by hand) or is missing
# while run dirs exist, the newest run dir (run ids start with their UTC start time).
latest_run() {
    id=$(readlink -- "$1/runs/latest" 2>/dev/null) || id=""
    id=${id##*/}
    if [ -n "$id" ] && [ -d "$1/runs/$id" ] && [ ! -L "$1/runs/$id" ]; then
        printf '%s' "$id"
        return
    fi
    id=""
    for d in "$1"/runs/*; do
        if [ -d "$d" ] && [ ! -L "$d" ]; then id=${d##*/}; fi
    done
    printf '%s' "$id"
}
sec() { printf '\n%s %s\n' "$b" "$1"; }
sec now
date +%s
run=$(latest_run "$wd")
sec run
printf '%s' "$run"
d="$wd/runs/$run"
if [ -n "$run" ] && [ -d "$d" ]; then
    sec pane
    "$tmux" list-panes -s -t "=$session" -F '#{pane_dead} #{pane_dead_status} #{pane_dead_signal} #{pane_pid}' 2>/dev/null
    sec alive
    if run_alive "$d"; then echo 1; else echo 0; fi
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
