# shellcheck shell=sh
# fleet run state in one round trip (sent as `sh -c <this> fleet-run-state WORKDIR TMUX SESSION LINES`).
# Prints sections `@@name` followed by their text; the log tail comes last and runs to the end.
workdir=$1
tmux=$2
session=$3
lines=$4
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
run_id=$(latest_run "$workdir")
run_dir="$workdir/runs/${run_id:-latest}"
printf '@@pane\n'
"$tmux" list-panes -s -t "=$session" -F '#{pane_dead} #{pane_pid} #{pane_dead_status} #{pane_dead_signal}' 2>/dev/null
printf '\n@@current\n'
readlink -- "$workdir/current" 2>/dev/null
printf '\n@@latest\n'
printf '%s' "$run_id"
printf '\n@@run_json\n'
cat -- "$run_dir/run.json" 2>/dev/null
printf '\n@@exit_code\n'
cat -- "$run_dir/exit_code" 2>/dev/null
printf '\n@@pgid\n'
cat -- "$run_dir/pgid" 2>/dev/null
printf '\n@@alive\n'
if [ -n "$run_id" ] && run_alive "$run_dir"; then echo 1; else echo 0; fi
printf '\n@@log\n'
if [ "$lines" -gt 0 ]; then
    tail -n "$lines" -- "$run_dir/train.log" 2>/dev/null
fi
exit 0
