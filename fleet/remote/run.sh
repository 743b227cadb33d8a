#!/usr/bin/env bash
# fleet run wrapper, shipped in every release as remote/run.sh and started by fleet as the
# command of the tmux pane (session fleet-run):   run.sh RUN_DIR RELEASE_DIR ARGV...
#
# - takes RUN_DIR/lock (flock) before anything else: every process of the run inherits the open
#   file, so the lock is held exactly as long as any of them lives, whatever happens to tmux or to
#   this shell. That lock is the run's liveness for status, runs, train, stop and pruning; a second
#   wrapper in the same run dir finds it held and exits 75 without starting anything;
# - records its pid and process group (tmux starts the pane with setsid: pgid == pid), which is
#   what `fab stop` signals;
# - loads the run's environment from RUN_DIR/run.env (0600, written from stdin by the launcher,
#   so secrets never appear in argv or `ps`) and deletes the file once read;
# - runs ARGV with cwd and PYTHONPATH = RELEASE_DIR, output teed to RUN_DIR/train.log;
# - writes the trainer's own exit status (not tee's) to RUN_DIR/exit_code and exits with it;
# - with a restart policy (FLEET_RESTART_MAX > 0 in run.env) runs ARGV again after a non-zero exit,
#   up to that many times, FLEET_RESTART_BACKOFF_S seconds apart (the trainer resumes from its
#   newest checkpoint), unless `fab stop` asked for the end (RUN_DIR/stop_signal), the exit was 2
#   (a config error) or the attempt's log shows a cause listed in FLEET_NO_RETRY (lines
#   "signature<TAB>regex", checked by RELEASE_DIR/remote/run_cause.py). Each ended attempt is one line of RUN_DIR/attempts.jsonl.
# - with notifications (FLEET_NOTIFY_URL and/or FLEET_NOTIFY_COMMAND in run.env) runs
#   RELEASE_DIR/remote/run_notify.py with ARGV's python: `watch` beside the trainer (stalls) and
#   `send` when the run finishes, fails or is restarted. Those values (a webhook URL or header may
#   hold a secret) reach only the notifier's environment: never argv, the trainer or the log.
#
# The file and variable names are training/contract.py's, put in place of the include line below
# when fleet.deploy writes this file into the release (deploy.release_file). Every path is made
# here, before run.env is loaded: a run.env key of the same name as one of them (LOG_FILE) must not
# move the run's files.
set -u
run_dir=$1
release_dir=$2
shift 2
# fleet: include contract
log="$run_dir/$LOG_FILE"
lock="$run_dir/$LOCK_FILE"
run_env="$run_dir/$RUN_ENV_FILE"
exit_file="$run_dir/$EXIT_CODE_FILE"
stop_file="$run_dir/$STOP_SIGNAL_FILE"
attempts_log="$run_dir/$ATTEMPTS_FILE"
max_var=$RESTART_MAX_ENV
backoff_var=$RESTART_BACKOFF_ENV
no_retry_var=$NO_RETRY_ENV
url_var=$NOTIFY_URL_ENV
command_var=$NOTIFY_COMMAND_ENV
notify_envs=("$NOTIFY_URL_ENV" "$NOTIFY_HEADERS_ENV" "$NOTIFY_COMMAND_ENV" "$NOTIFY_PASS_ENV" "$NOTIFY_TARGET_ENV")
stall_var=$NOTIFY_STALL_ENV
run_dir_var=$RUN_DIR_ENV
release_var=$RELEASE_DIR_ENV

exec 9>>"$lock"
# -w: a status read holds the lock shared for an instant; a live trainer holds it for good.
if command -v flock >/dev/null 2>&1 && ! flock -w 5 9; then
    printf 'fleet: a process of this run still holds %s (a trainer is live in this run dir); not starting a second\n' \
        "$lock" | tee -a -- "$log" >&2
    exit 75
fi

# The clock in epoch seconds with a decimal point whatever the locale (run.env may set one).
epoch_now() {
    local t=${EPOCHREALTIME:-$(date +%s)}
    printf '%s' "${t/,/.}"
}
# First, so that a status read that finds the lock held also finds when this launch began: the
# events before it are an earlier launch's.
printf '%s\n' "$(epoch_now)" > "$run_dir/$LAUNCHED_AT_FILE"

read -r stat < "/proc/$$/stat" || stat=""
rest=${stat##*) }
read -r _state _ppid pgid _rest <<< "$rest" || true
pgid=${pgid:-$$}
printf '%s\n' "$$" > "$run_dir/$PID_FILE"
printf '%s\n' "$pgid" > "$run_dir/$PGID_FILE"
if [ -f "$run_env" ]; then
    # shellcheck disable=SC1090  # the run's environment, written by the launcher
    . "$run_env"
    rm -f -- "$run_env"
fi
# The wrapper's own settings (${!name}: the variable that name names), taken out of the environment
# so neither the trainer nor the log sees them; the notifier gets its own back (notify_run).
restart_max=${!max_var:-0}
backoff_s=${!backoff_var:-60}
no_retry=${!no_retry_var:-}
unset "$max_var" "$backoff_var" "$no_retry_var"
notify_on=${!url_var:-}${!command_var:-}
notify_pass=()
for name in "${notify_envs[@]}"; do
    notify_pass+=("$name=${!name:-}")
    unset "$name"
done
stall_s=${!stall_var:-600}
unset "$stall_var"
notifier="$release_dir/remote/run_notify.py"
python=${1:-python3}
notifying=""
if [ -n "$notify_on" ] && [ -f "$notifier" ]; then
    notifying=1
fi
# The notifier's environment only; its output (one line per failed delivery) goes to the log.
notify_run() {
    env "${notify_pass[@]}" "$python" -I "$notifier" "$@" >> "$log" 2>&1
}
# In the background and without the run's lock: a slow or hanging webhook or command (the
# notifier bounds both) never holds a restart, the exit status or the run's liveness. It ignores
# the SIGHUP that tmux's closing pane sends once this shell has exited.
notify() {  # STATE CAUSE
    if [ -n "$notifying" ]; then
        (trap '' HUP; notify_run send "$run_dir" "$1" "$2" 9>&- || true) &
    fi
}
export PYTHONPATH="$release_dir"
export PYTHONUNBUFFERED=1
export "$run_dir_var=$run_dir"
export "$release_var=$release_dir"

finish() {
    if [ -n "${watcher:-}" ]; then
        kill "$watcher" 2>/dev/null || true
    fi
    printf '%s\n' "$1" > "$exit_file.tmp" && mv -f -- "$exit_file.tmp" "$exit_file"
    printf 'fleet: run exited with code %s\n' "$1" | tee -a "$log"
    exit "$1"
}

cd -- "$release_dir" || finish 97
# Signals reach the whole group: this shell only notes them (so it still records the exit code),
# tee ignores them (so the trainer can still log its checkpoint), the trainer handles them.
trap ':' TERM INT HUP
# Why an attempt that failed must not be retried ("" = it may be): exit 2, or a known cause.
no_retry_cause() {
    code=$1
    from=$2
    if [ "$code" -eq 2 ]; then
        printf 'config-error'
        return
    fi
    if [ -n "$no_retry" ]; then
        env "$no_retry_var=$no_retry" "$python" -I "$release_dir/remote/run_cause.py" "$log" "$from" 2>/dev/null || true
    fi
}

record_attempt() {  # attempt exit_code cause retry
    printf '{"attempt": %s, "exit_code": %s, "cause": "%s", "retry": %s, "ts": %s}\n' \
        "$1" "$2" "$3" "$4" "$(epoch_now)" >> "$attempts_log"
}

watcher=""
cause=""
if [ -n "$notifying" ]; then
    (trap - TERM INT HUP; notify_run watch "$run_dir" "$stall_s") &
    watcher=$!
fi
attempt=1
while :; do
    from=$(($(stat -c %s -- "$log" 2>/dev/null || echo 0) + 1))
    printf 'fleet: %s\n' "$*" >> "$log"
    "$@" 2>&1 | (trap '' TERM INT HUP; exec tee -a -- "$log")
    code=${PIPESTATUS[0]}
    if [ "$code" -eq 0 ] || [ "$restart_max" -le 0 ]; then
        break
    fi
    cause=$(no_retry_cause "$code" "$from")
    if [ -e "$stop_file" ]; then
        record_attempt "$attempt" "$code" "stopped by fab stop" false
        break
    fi
    if [ -n "$cause" ]; then
        record_attempt "$attempt" "$code" "$cause (not retryable)" false
        printf 'fleet: exit %s: %s is not retryable; no restart\n' "$code" "$cause" | tee -a -- "$log"
        break
    fi
    if [ "$attempt" -gt "$restart_max" ]; then
        record_attempt "$attempt" "$code" "exit $code" false
        printf 'fleet: exit %s; the %s restart(s) allowed are used up\n' "$code" "$restart_max" | tee -a -- "$log"
        break
    fi
    record_attempt "$attempt" "$code" "exit $code" true
    notify restarted "exit $code; attempt $((attempt + 1)) of $((restart_max + 1)) in ${backoff_s}s"
    printf 'fleet: exit %s; restart %s of %s in %ss (attempt %s)\n' \
        "$code" "$attempt" "$restart_max" "$backoff_s" "$((attempt + 1))" | tee -a -- "$log"
    sleep "$backoff_s"
    if [ -e "$stop_file" ]; then  # `fab stop` during the back-off
        break
    fi
    attempt=$((attempt + 1))
    # The next attempt's start: status reads its events from here on (until then: restarted).
    printf '%s\n' "$(epoch_now)" > "$run_dir/$LAUNCHED_AT_FILE"
done
if [ "$code" -ne 0 ]; then
    if [ ! -e "$stop_file" ]; then
        notify failed "exit $code${cause:+ ($cause)}"
    fi
elif [ ! -e "$stop_file" ]; then
    notify finished ""
fi
finish "$code"
