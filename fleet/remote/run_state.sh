# shellcheck shell=sh
# fleet run state in one round trip (sent as `sh -c <this> fleet-run-state WORKDIR TMUX SESSION LINES`).
# Prints sections `@@name` followed by their text; the log tail comes last and runs to the end.
workdir=$1
tmux=$2
session=$3
lines=$4
run_dir="$workdir/runs/latest"
printf '@@pane\n'
"$tmux" list-panes -s -t "=$session" -F '#{pane_dead} #{pane_pid} #{pane_dead_status} #{pane_dead_signal}' 2>/dev/null
printf '\n@@current\n'
readlink -- "$workdir/current" 2>/dev/null
printf '\n@@latest\n'
readlink -- "$run_dir" 2>/dev/null
printf '\n@@run_json\n'
cat -- "$run_dir/run.json" 2>/dev/null
printf '\n@@exit_code\n'
cat -- "$run_dir/exit_code" 2>/dev/null
printf '\n@@pgid\n'
cat -- "$run_dir/pgid" 2>/dev/null
printf '\n@@log\n'
if [ "$lines" -gt 0 ]; then
    tail -n "$lines" -- "$run_dir/train.log" 2>/dev/null
fi
exit 0
