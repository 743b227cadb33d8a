#!/usr/bin/env bash
# fleet run wrapper, shipped in every release as remote/run.sh and started by fleet as the
# command of the tmux pane (session fleet-run):   run.sh RUN_DIR RELEASE_DIR ARGV...
#
# - records its pid and process group (tmux starts the pane with setsid: pgid == pid), which is
#   what `fab stop` signals;
# - loads the run's environment from RUN_DIR/run.env (0600, written from stdin by the launcher,
#   so secrets never appear in argv or `ps`) and deletes the file once read;
# - runs ARGV with cwd and PYTHONPATH = RELEASE_DIR, output teed to RUN_DIR/train.log;
# - writes the trainer's own exit status (not tee's) to RUN_DIR/exit_code and exits with it.
set -u
run_dir=$1
release_dir=$2
shift 2
log="$run_dir/train.log"

read -r stat < "/proc/$$/stat" || stat=""
rest=${stat##*) }
read -r _state _ppid pgid _rest <<< "$rest" || true
pgid=${pgid:-$$}
printf '%s\n' "$$" > "$run_dir/pid"
printf '%s\n' "$pgid" > "$run_dir/pgid"
printf '%s\n' "${EPOCHREALTIME:-$(date +%s)}" > "$run_dir/launched_at"

if [ -f "$run_dir/run.env" ]; then
    # shellcheck disable=SC1091
    . "$run_dir/run.env"
    rm -f -- "$run_dir/run.env"
fi
export PYTHONPATH="$release_dir"
export PYTHONUNBUFFERED=1
export FLEET_RUN_DIR="$run_dir"
export FLEET_RELEASE_DIR="$release_dir"

finish() {
    printf '%s\n' "$1" > "$run_dir/exit_code.tmp" && mv -f -- "$run_dir/exit_code.tmp" "$run_dir/exit_code"
    printf 'fleet: run exited with code %s\n' "$1" | tee -a "$log"
    exit "$1"
}

cd -- "$release_dir" || finish 97
# Signals reach the whole group: this shell only notes them (so it still records the exit code),
# tee ignores them (so the trainer can still log its checkpoint), the trainer handles them.
trap ':' TERM INT HUP
printf 'fleet: %s\n' "$*" >> "$log"
"$@" 2>&1 | (trap '' TERM INT HUP; exec tee -a -- "$log")
finish "${PIPESTATUS[0]}"
