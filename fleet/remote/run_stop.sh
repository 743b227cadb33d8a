# shellcheck shell=sh
# fleet run stop (sent as `sh -c <this> fleet-run-stop WORKDIR TMUX SESSION SIGNAL TIMEOUT_S`).
# Signals the process group that run.sh recorded for the latest run, only while that run is alive
# by its lock (run_alive): with or without tmux, and never a stale pgid. Prints one word:
#   none               no live run
#   mismatch           no live run of this workdir, but SESSION has a live pane (another workdir's
#                      run, or not a fleet run)
#   gone TENTHS        the run ended after the signal (TENTHS of a second later)
#   alive TIMEOUT_S    still running when TIMEOUT_S ran out
workdir=$1
tmux=$2
session=$3
sig=$4
timeout_s=$5
# fleet: include contract
# fleet: include rundir.sh
run_id=$(latest_run "$workdir")
run_dir="$workdir/runs/$run_id"
pgid=$(cat -- "$run_dir/$PGID_FILE" 2>/dev/null) || pgid=""
case "$pgid" in '' | *[!0-9]*) pgid="" ;; esac
if [ -z "$run_id" ] || [ -z "$pgid" ] || ! run_alive "$run_dir"; then
    pane=$("$tmux" list-panes -s -t "=$session" -F '#{pane_dead}' 2>/dev/null | head -n 1)
    if [ "$pane" = 0 ]; then echo mismatch; else echo none; fi
    exit 0
fi
# Recorded first, so `fab status` can tell a `fab stop --force` (exit 137) from an OOM kill.
printf '%s\n' "$sig" > "$run_dir/$STOP_SIGNAL_FILE" 2>/dev/null || true
kill -s "$sig" -- "-$pgid" 2>/dev/null || true
ticks=0
limit=$((timeout_s * 5))
while run_alive "$run_dir"; do
    if [ "$ticks" -ge "$limit" ]; then
        echo "alive $timeout_s"
        exit 0
    fi
    sleep 0.2
    ticks=$((ticks + 1))
done
if [ "$sig" = KILL ] && [ ! -e "$run_dir/$EXIT_CODE_FILE" ]; then
    # run.sh was killed too and could not record it: record what a shell would report.
    printf '137\n' > "$run_dir/$EXIT_CODE_FILE"
fi
# run.sh has exited; give tmux a moment to mark the pane dead so a status read right after is exact.
wait=0
while [ "$wait" -lt 30 ]; do
    dead=$("$tmux" list-panes -s -t "=$session" -F '#{pane_dead}' 2>/dev/null | head -n 1)
    [ "$dead" = "0" ] || break
    sleep 0.1
    wait=$((wait + 1))
done
echo "gone $((ticks * 2))"
