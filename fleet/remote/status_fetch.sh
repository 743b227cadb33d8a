# shellcheck shell=sh
# Everything `fab status` needs about the latest run, in one command (fleet.status.fetch), sent as
#   sh -c <this> fleet-status-fetch WORKDIR TMUX SESSION EVENT_BYTES NVIDIA_SMI FIELDS [LOG_BYTES]
# Prints the prelude's sections: the target's clock (now), the latest run id (run), whether it is
# alive (its lock), its tmux pane, run.json, the pid, exit_code, stop_signal and launched_at files
# of run.sh / `fab stop`, the last lines of attempts.jsonl (the restart policy's record), size+mtime and the
# last bytes (`tail -c`) of events.jsonl and train.log (events_stat, events_tail, log_stat,
# log_tail), and the `nvidia-smi --query-gpu` table (gpus) when NVIDIA_SMI is not empty.
# A log of many GB is never read whole. The `end` section tells the caller the answer is complete.
wd=$1
tmux=$2
session=$3
n=$4
smi=$5
fields=$6
m=${7:-$4}
# shellcheck disable=SC2034  # timeout_s is read by the prelude's limited
timeout_s=10
# fleet: include contract
# fleet: include prelude.sh
# fleet: include rundir.sh
section now date +%s
run=$(latest_run "$wd")
emit run 0 "$run"
d="$wd/runs/$run"
if [ -n "$run" ] && [ -d "$d" ]; then
    section pane "$tmux" list-panes -s -t "=$session" -F '#{pane_dead} #{pane_dead_status} #{pane_dead_signal} #{pane_pid}'
    if run_alive "$d"; then alive=1; else alive=0; fi
    emit alive 0 "$alive"
    section run_json cat -- "$d/$RUN_RECORD_FILE"
    for f in "$PID_FILE" "$EXIT_CODE_FILE" "$STOP_SIGNAL_FILE" "$LAUNCHED_AT_FILE"; do
        section "$f" cat -- "$d/$f"
    done
    section attempts tail -n 20 -- "$d/$ATTEMPTS_FILE"
    section events_stat stat -c '%s %Y' -- "$d/$EVENTS_FILE"
    tail_section events_tail "$n" "$d/$EVENTS_FILE"
    section log_stat stat -c '%s %Y' -- "$d/$LOG_FILE"
    tail_section log_tail "$m" "$d/$LOG_FILE"
fi
if [ -n "$smi" ]; then
    smi_section gpus --query-gpu="$fields" --format=csv
fi
emit end 0 ""
exit 0
