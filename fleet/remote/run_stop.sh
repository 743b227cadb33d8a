# shellcheck shell=sh
# fleet run stop (sent as `sh -c <this> fleet-run-stop WORKDIR TMUX SESSION SIGNAL TIMEOUT_S`).
# Signals only the process group that run.sh recorded, and only while that group's leader is the
# live pane process of SESSION (so a stale pgid can never hit another process). Prints one word:
#   none               no live run
#   mismatch           the live pane is not a fleet run.sh (pgid file missing or different)
#   gone TENTHS        the group exited after the signal (TENTHS of a second later)
#   alive TIMEOUT_S    still running when TIMEOUT_S ran out
workdir=$1
tmux=$2
session=$3
sig=$4
timeout_s=$5
pane=$("$tmux" list-panes -s -t "=$session" -F '#{pane_dead} #{pane_pid}' 2>/dev/null | head -n 1)
case "$pane" in
    "0 "*) pane_pid=${pane#0 } ;;
    *) echo none; exit 0 ;;
esac
# A run started a moment ago may not have written its pgid yet: wait for it (bounded).
tries=0
while [ -e "$workdir/runs/latest" ] && [ ! -s "$workdir/runs/latest/pgid" ] && [ "$tries" -lt 50 ]; do
    sleep 0.1
    tries=$((tries + 1))
done
pgid=$(cat -- "$workdir/runs/latest/pgid" 2>/dev/null) || pgid=""
if [ -z "$pgid" ] || [ "$pgid" != "$pane_pid" ]; then
    echo "mismatch"
    exit 0
fi
# Alive = a process of the group that is not a zombie. (`kill -0` is not enough: tmux 3.3a
# sometimes leaves a dead pane's process unreaped, a zombie that would look alive forever.)
group_alive() {
    [ -d /proc/self ] || { kill -s 0 -- "-$pgid" 2>/dev/null; return; }
    for st in /proc/[0-9]*/stat; do
        { read -r line < "$st"; } 2>/dev/null || continue
        rest=${line##*) }
        # shellcheck disable=SC2086
        set -- $rest
        if [ "${3:-}" = "$pgid" ] && [ "$1" != "Z" ]; then
            return 0
        fi
    done
    return 1
}
# Recorded first, so `fab status` can tell a `fab stop --force` (exit 137) from an OOM kill.
printf '%s\n' "$sig" > "$workdir/runs/latest/stop_signal" 2>/dev/null || true
kill -s "$sig" -- "-$pgid" 2>/dev/null || true
ticks=0
limit=$((timeout_s * 5))
while group_alive; do
    if [ "$ticks" -ge "$limit" ]; then
        echo "alive $timeout_s"
        exit 0
    fi
    sleep 0.2
    ticks=$((ticks + 1))
done
run_dir=$(readlink -f -- "$workdir/runs/latest")
if [ "$sig" = KILL ] && [ ! -e "$run_dir/exit_code" ]; then
    # run.sh was killed too and could not record it: record what a shell would report.
    printf '137\n' > "$run_dir/exit_code"
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
