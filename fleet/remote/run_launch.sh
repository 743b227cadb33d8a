# shellcheck shell=sh
# fleet run launch (sent as `sh -c <this> fleet-run-launch WORKDIR TMUX SESSION RUN_ID RELEASE_ID MODE RUN_JSON ARGV...`).
# stdin carries the run's environment file (`export K='v'` lines): secrets never travel in argv.
# MODE `new` makes the run dir; `resume` launches again in the existing one (the trainer continues
# from its newest checkpoint): run.json becomes this launch's record, the previous launch's exit
# files go, and nothing of the run dir is removed if the launch fails.
# Every launch that started appends its record to RUN_DIR/segments.jsonl as {"segment": N, ...}.
# Exit 75: a run is live (in SESSION, or any run dir whose lock is held: tmux may be gone while
# its trainer lives on); 73: RUN_ID exists (new) or is missing (resume); 66: the release has no
# remote/run.sh; 70: the wrapper did not start; 74: the environment file arrived incomplete.
#
# The environment file ends with `# fleet-env-bytes N`, N the bytes before that line: a short or
# empty stdin (a connection dropped mid-launch) is refused before anything starts, so a launch is
# whole or nothing and a retry finds either the complete run or none.
# ARGV's interpreter given as <env>/current/bin/python is pinned to the build `current` names now
# (its real path, also recorded in run.json as "env_dir"): a later env switch (rebuild, rollback,
# a deploy with another lock) never changes a live run's interpreter or its imports, and env gc
# keeps the build while run.json names it.
#
# A launch is done when run.sh has taken its environment (it deletes run.env once sourced).
# Only then does runs/latest move to the new run. Any failure before that removes the new run
# dir (run.env with it: no secret is left at rest) and the half-made tmux session, so runs/latest
# still names the previous run and nothing looks like a run that never started.
set -eu
workdir=$1
tmux=$2
session=$3
run_id=$4
release=$5
mode=$6
run_json=$7
shift 7
rel_dir="$workdir/releases/$release"
run_dir="$workdir/runs/$run_id"
test -f "$rel_dir/remote/run.sh" || { echo "release $release has no remote/run.sh: redeploy" >&2; exit 66; }
# fleet: include contract
# fleet: include rundir.sh
for dir in "$workdir"/runs/*; do
    if [ -d "$dir" ] && [ ! -L "$dir" ] && run_alive "$dir"; then
        echo "run ${dir##*/} is live (its processes hold $dir/$LOCK_FILE; tmux may be gone)" >&2
        exit 75
    fi
done
if "$tmux" has-session -t "=$session" 2>/dev/null; then
    if "$tmux" list-panes -s -t "=$session" -F '#{pane_dead}' | grep -qx 0; then
        echo "a run is live in tmux session $session" >&2
        exit 75
    fi
    "$tmux" kill-session -t "=$session"
fi
mkdir -p -- "$workdir/runs"
if [ "$mode" = resume ]; then
    if [ ! -d "$run_dir" ] || [ -L "$run_dir" ]; then
        echo "run directory $run_dir is missing" >&2
        exit 73
    fi
else
    if [ -e "$run_dir" ] || [ -L "$run_dir" ]; then
        echo "run directory $run_dir exists" >&2
        exit 73
    fi
    mkdir -- "$run_dir"
fi
started=""
undo() {
    [ -n "$started" ] && return 0
    # Our session only: its pane runs (or was to run) this run's wrapper.
    if "$tmux" list-panes -s -t "=$session" -F '#{pane_start_command}' 2>/dev/null | grep -qF -- "$run_dir"; then
        "$tmux" kill-session -t "=$session" 2>/dev/null || true
    fi
    if [ "$mode" = resume ]; then
        # The run's history stays, as the previous launch left it; no secret is left at rest.
        rm -f -- "$run_dir/$RUN_ENV_FILE"
        for f in $LAUNCH_FILES; do
            if [ -e "$run_dir/$SET_ASIDE_PREFIX$f" ]; then mv -f -- "$run_dir/$SET_ASIDE_PREFIX$f" "$run_dir/$f"; fi
        done
    else
        rm -rf -- "$run_dir"
    fi
}
trap undo EXIT
(umask 077 && cat > "$run_dir/$RUN_ENV_FILE")
last=$(tail -n 1 -- "$run_dir/$RUN_ENV_FILE")
have=$(($(wc -c < "$run_dir/$RUN_ENV_FILE") - ${#last} - 1))
case "$last" in
    "# $RUN_ENV_TRAILER "[0-9]*) want=${last#"# $RUN_ENV_TRAILER "} ;;
    *) want="" ;;
esac
case "$want" in *[!0-9]*) want="" ;; esac
if [ "$have" != "$want" ]; then
    echo "the run's environment arrived incomplete ($have bytes, expected ${want:-a complete file}; the connection dropped?): nothing was started" >&2
    exit 74
fi
case "${1:-}" in
    */current/bin/python | */current/bin/python3)
        env_link=${1%/bin/*}
        if [ -L "$env_link" ] && env_dir=$(readlink -f -- "$env_link") && [ -x "$env_dir/bin/${1##*/}" ]; then
            py="$env_dir/bin/${1##*/}"
            shift
            set -- "$py" "$@"
            case "$env_dir" in
                *[\"\\]*) ;;  # not written into JSON unescaped (a workdir with quotes)
                *) run_json="${run_json%\}}, \"env_dir\": \"$env_dir\"}" ;;
            esac
        fi
        ;;
esac
# The previous launch's outcome is not this one's (status reads exit_code and stop_signal); kept
# aside until this launch has started, put back if it does not. The restart policy counts the
# attempts of one launch: the previous launch's go to attempts-earlier.jsonl.
for f in $LAUNCH_FILES; do
    if [ -e "$run_dir/$f" ]; then mv -f -- "$run_dir/$f" "$run_dir/$SET_ASIDE_PREFIX$f"; fi
done
record="$run_dir/$RUN_RECORD_FILE"
printf '%s\n' "$run_json" > "$record.tmp" && mv -f -- "$record.tmp" "$record"
# The pane starts as a placeholder so remain-on-exit is set before the run's command exists;
# respawn-pane then replaces it: a run that dies at once still leaves its exit status readable.
# The placeholder reads the pane's terminal and so ends when respawn-pane closes it: the hangup
# signal alone can miss a child that has not yet made the terminal its own (under load a
# `sleep 3600` placeholder outlived the launch by its hour).
"$tmux" new-session -d -s "$session" -c "$rel_dir" sh -c 'cat > /dev/null' "$run_dir" \; \
    set-option -w -t "=$session:" remain-on-exit on \; \
    respawn-pane -k -t "=$session:" -c "$rel_dir" bash "$rel_dir/remote/run.sh" "$run_dir" "$rel_dir" "$@"
# Wait (bounded) until run.sh has read run.env; a wrapper that cannot start leaves a dead pane.
tries=0
while [ -e "$run_dir/$RUN_ENV_FILE" ]; do
    pane=$("$tmux" list-panes -s -t "=$session" -F '#{pane_dead} #{pane_dead_status}' 2>/dev/null | head -n 1)
    case "$pane" in
        "0 "*) ;;
        *)
            echo "the run's wrapper (bash $rel_dir/remote/run.sh) exited at once (pane: ${pane:-gone})" >&2
            exit 70
            ;;
    esac
    if [ "$tries" -ge 600 ]; then
        echo "the run's wrapper did not read its environment within 30 s" >&2
        exit 70
    fi
    sleep 0.05
    tries=$((tries + 1))
done
ln -s -- "$run_id" "$workdir/runs/.latest.tmp-$run_id"
mv -T -- "$workdir/runs/.latest.tmp-$run_id" "$workdir/runs/latest"
started=1
if [ -e "$run_dir/$SET_ASIDE_PREFIX$ATTEMPTS_FILE" ]; then
    cat -- "$run_dir/$SET_ASIDE_PREFIX$ATTEMPTS_FILE" >> "$run_dir/$EARLIER_ATTEMPTS_FILE"
fi
for f in $LAUNCH_FILES; do
    rm -f -- "$run_dir/$SET_ASIDE_PREFIX$f"
done
segments="$run_dir/$SEGMENTS_FILE"
segment=1
if [ -f "$segments" ]; then
    segment=$(($(wc -l < "$segments") + 1))
fi
printf '{"segment": %s, %s\n' "$segment" "${run_json#\{}" >> "$segments"
printf '%s\n' "$run_dir"
