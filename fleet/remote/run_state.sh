# shellcheck shell=sh
# fleet run state in one round trip (sent as `sh -c <this> fleet-run-state WORKDIR TMUX SESSION LINES`).
# Prints the prelude's sections: pane, current, latest, run_json, exit_code, pgid, alive, log (the
# last LINES lines of train.log).
workdir=$1
tmux=$2
session=$3
lines=$4
# fleet: include contract
# fleet: include prelude.sh
# fleet: include rundir.sh
run_id=$(latest_run "$workdir")
run_dir="$workdir/runs/${run_id:-latest}"
section pane "$tmux" list-panes -s -t "=$session" -F '#{pane_dead} #{pane_pid} #{pane_dead_status} #{pane_dead_signal}'
section current readlink -- "$workdir/current"
emit latest 0 "$run_id"
section run_json cat -- "$run_dir/$RUN_RECORD_FILE"
section exit_code cat -- "$run_dir/$EXIT_CODE_FILE"
section pgid cat -- "$run_dir/$PGID_FILE"
if [ -n "$run_id" ] && run_alive "$run_dir"; then alive=1; else alive=0; fi
emit alive 0 "$alive"
if [ "$lines" -gt 0 ]; then
    section log tail -n "$lines" -- "$run_dir/$LOG_FILE"
fi
exit 0
