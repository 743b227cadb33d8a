# shellcheck shell=sh
# fleet run launch (sent as `sh -c <this> fleet-run-launch WORKDIR TMUX SESSION RUN_ID RELEASE_ID RUN_JSON ARGV...`).
# stdin carries the run's environment file (`export K='v'` lines): secrets never travel in argv.
# Exit 75: a run is live in SESSION (the caller re-checks and names it); 73: RUN_ID exists;
# 66: the release has no remote/run.sh.
set -eu
workdir=$1
tmux=$2
session=$3
run_id=$4
release=$5
run_json=$6
shift 6
rel_dir="$workdir/releases/$release"
run_dir="$workdir/runs/$run_id"
test -f "$rel_dir/remote/run.sh" || { echo "release $release has no remote/run.sh: redeploy" >&2; exit 66; }
if "$tmux" has-session -t "=$session" 2>/dev/null; then
    if "$tmux" list-panes -s -t "=$session" -F '#{pane_dead}' | grep -qx 0; then
        echo "a run is live in tmux session $session" >&2
        exit 75
    fi
    "$tmux" kill-session -t "=$session"
fi
mkdir -p -- "$workdir/runs"
if [ -e "$run_dir" ] || [ -L "$run_dir" ]; then
    echo "run directory $run_dir exists" >&2
    exit 73
fi
mkdir -- "$run_dir"
(umask 077 && cat > "$run_dir/run.env")
printf '%s\n' "$run_json" > "$run_dir/run.json"
ln -s -- "$run_id" "$workdir/runs/.latest.tmp-$run_id"
mv -T -- "$workdir/runs/.latest.tmp-$run_id" "$workdir/runs/latest"
# The pane starts as a placeholder so remain-on-exit is set before the run's command exists;
# respawn-pane then replaces it: a run that dies at once still leaves its exit status readable.
"$tmux" new-session -d -s "$session" -c "$rel_dir" sleep 3600 \; \
    set-option -w -t "=$session:" remain-on-exit on \; \
    respawn-pane -k -t "=$session:" -c "$rel_dir" bash "$rel_dir/remote/run.sh" "$run_dir" "$rel_dir" "$@"
printf '%s\n' "$run_dir"
